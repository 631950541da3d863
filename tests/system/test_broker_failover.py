"""Broker failover on a real three-node RabbitMQ cluster on loopback (tests/support/
broker_rabbitmq.py's RabbitCluster; docs/FLEET.md, "Broker clusters"): the node a real
daemon's link is on is killed (SIGKILL, as a machine dies) during health reports and in the
middle of an update's MQTT block download, and the device is back on the next node of its
`broker = [...]` list within 30 s with every outbox event delivered and the update finished;
the operator's `fleet send`, `fleet watch` and a running `fleet rollout` survive their own node
dying.

Deterministic: every step waits on something observable (a log line, a message seen by an
observer on a node that stays up, a block request held by the test's block server); a dead
node is started again in the background and waited for before the next test.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions, decode_message
from agent.fleet.topics import Topics
from agent.operator.client import watch
from agent.operator.link import _client_id, _Link
from agent.operator.publish import Offer, read_offer
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.broker_rabbitmq import RabbitCluster, RabbitMQ, _mqtt_connects
from tests.support.daemon_harness import Daemon
from tests.system.test_fleet_rabbitmq import FLEET, PREFIX, Observer
from tests.system.test_updates import Models, big_models, bundle, trusted  # noqa: F401  (fixtures)

pytestmark = pytest.mark.rabbitmq

FAILOVER_S = 30.0  # issue 35: back on another node within this
State = fpb.DeviceState
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
RECORDED = re.compile(r"fleet: event (\d+) recorded")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitCluster]:
    c = RabbitCluster(tmp_path_factory.mktemp("rabbit-cluster"), 3)
    yield c
    c.stop()


@pytest.fixture
def nodes(cluster: RabbitCluster) -> list[RabbitMQ]:
    """The cluster's nodes, every one running (a node a test killed is back)."""
    for i, node in enumerate(cluster.nodes):
        if node.proc is None:
            node.launch()
        if not node.running or not _answers(node):
            node.wait_ready(150)
        assert node.running, f"node {i} did not come back:\n{node.read_log()[-3000:]}"
    return cluster.nodes


def _answers(node: RabbitMQ) -> bool:
    return _mqtt_connects(node.port)


def config(brokers: list[RabbitMQ], extra: str = "") -> str:
    """The device's [fleet] section (MQTT 3.1.1) naming `brokers` in this order."""
    urls = ", ".join(f'"{b.url}"' for b in brokers)
    return FLEET.replace("[fleet]\n", f"[fleet]\nbroker = [{urls}]\n") + extra


def start(tmp: Path, model: Path, device: str, text: str) -> Daemon:
    return Daemon(tmp, model, text, args=("--device-id", device))


def operator(*argv: str, brokers: list[RabbitMQ], config: Path) -> list[str]:
    """An `edge-agent fleet` command line with one --broker per node, in this order."""
    config.write_text("")
    flags = [f for b in brokers for f in ("--broker", b.url)]
    return [
        sys.executable,
        "-m",
        "agent",
        "fleet",
        *argv,
        *flags,
        "--protocol",
        "3.1.1",
        "--config",
        str(config),
    ]


def connected_to(d: Daemon, node: RabbitMQ, since: int = 0) -> int:
    return d.wait_log(f"fleet: connected to {node.url} as", FAILOVER_S, since)


def recorded(d: Daemon) -> set[int]:
    """The seq of every event the daemon put in its outbox."""
    return {int(m) for m in RECORDED.findall(d.read_log())}


def delivered(watch: Observer, topics: list[str]) -> set[int]:
    """The seq of every event an observer saw (duplicates are allowed: at least once)."""
    return {fpb.Event.FromString(s.payload).seq for s in watch.seen if s.topic in topics}


def test_a_dead_node_during_health_reports(
    tiny_model_dir: Path, tmp_path: Path, nodes: list[RabbitMQ]
) -> None:
    """The device is on node 0; node 0 dies; it is back on node 1 (the next of its list) with a
    new session within FAILOVER_S, health goes on, and every event (two reloads, one before
    and one after the failover) reaches an observer on node 2."""
    n0, n1, n2 = nodes
    device = "dev-fo-health"
    topics = Topics(PREFIX, device)
    watch = Observer(n2, "fo-health-watch", [topics.state, topics.health, topics.event])
    d = start(tmp_path, tiny_model_dir, device, config([n0, n1, n2]))
    op = tmp_path / "operator.toml"
    try:
        connected_to(d, n0)
        birth = State.FromString(watch.state(device, State.ONLINE).payload)
        mark = len(watch.seen)
        watch.wait(lambda s: s.topic == topics.health, 30, mark)
        sent = subprocess.run(
            operator("send", device, "reload", brokers=[n2], config=op),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=ENV,
        )
        assert sent.returncode == 0, sent.stderr
        at = len(d.read_log())
        killed = time.monotonic()
        n0.kill()
        connected_to(d, n1, at)
        back = State.FromString(watch.state(device, State.ONLINE, since=mark).payload)
        assert time.monotonic() - killed < FAILOVER_S
        assert back.session > birth.session
        n0.launch()  # back in the background; the next test waits for it
        # health goes on in the new session (a health of the old one that was in flight at
        # the kill may come first: paho sends it again after the reconnect)
        watch.wait(
            lambda s: (
                s.topic == topics.health
                and fpb.Health.FromString(s.payload).session == back.session
            ),
            30,
            mark,
        )
        sent = subprocess.run(
            operator("send", device, "reload", brokers=[n1], config=op),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=ENV,
        )
        assert sent.returncode == 0, sent.stderr
        d.wait_log("fleet: event 2 recorded", 30)
        want = recorded(d)
        assert len(want) >= 2, d.read_log()
        watch.wait(lambda _s: delivered(watch, [topics.event]) >= want, 30)
        assert d.client().health() == "SERVING"
    finally:
        assert d.stop() == 0, d.read_log()
        watch.close()


class BlockServer:
    """The operator's side of an MQTT-block update (agent.operator.publish.Offer on a real
    link), with one gate: the first request past the first block is held until `release`, so
    that the test can kill the device's node while its download is half done."""

    def __init__(self, brokers: list[RabbitMQ], bundle_path: Path, device: str) -> None:
        urls = [parse_broker("test", "broker", b.url) for b in brokers]
        self.opts = MqttOptions(urls[0], other_brokers=tuple(urls[1:]), protocol="3.1.1")
        self.statuses: list[fpb.UpdateStatus] = []
        self.held: mqtt.MQTTMessage | None = None
        self.released = False
        signed, manifest, payload = read_offer(bundle_path)
        self.offer = Offer(
            self.opts,
            PREFIX,
            signed,
            manifest,
            payload,
            lambda _d, st, _s: self.statuses.append(st),
        )
        self.device = device
        self.link = _Link(self.opts, _client_id("blocks"), self._on_message)
        deadline = time.monotonic() + 30
        self.link.connect(deadline)
        self.link.subscribe(self.offer.filters(), deadline)
        self.offer.send(self.link, device, deadline)

    def _on_message(self, msg: mqtt.MQTTMessage) -> None:
        if msg.topic == Topics(PREFIX, self.device).block_request and not self.released:
            req = decode_message(opb.BlockRequest, msg)
            if req.offset > 0:
                self.held = msg
                return
        self.offer.handle(self.link, msg)

    def pump_until(self, done: object, timeout: float) -> None:
        assert callable(done)
        self.link.pump_until(done, time.monotonic() + timeout)

    def release(self) -> None:
        """Answer the held request now (into the device's session, wherever it is)."""
        self.released = True
        assert self.held is not None
        self.offer.handle(self.link, self.held)

    def final(self) -> bool:
        done = (fpb.UpdateStatus.COMMITTED, fpb.UpdateStatus.FAILED, fpb.UpdateStatus.REJECTED)
        return any(st.phase in done for st in self.statuses)


def test_a_dead_node_in_the_middle_of_an_mqtt_block_download(
    big_models: Models,  # noqa: F811
    trusted: Path,  # noqa: F811
    tmp_path: Path,
    nodes: list[RabbitMQ],
) -> None:
    """The device is on node 1 and holds the first block of its update; node 1 dies before
    the second block is served. The device moves to node 2, the block comes (from the session
    the cluster kept, or asked again), the update commits, and every update status it
    recorded reaches the operator."""
    n0, n1, n2 = nodes
    device = "dev-fo-ota"
    topics = Topics(PREFIX, device)
    path = bundle(big_models, tmp_path)  # no URL: the payload comes in blocks over MQTT
    extra = (
        '[model]\nquantization = "int8"\n'
        f'[updates]\ntrusted_keys_dir = "{trusted}"\ntrial_s = 1.0\n'
        "retry_s = 0.5\nprogress_interval_s = 0.2\n"
        'clock = "trusted"\n'
    )
    watch = Observer(n0, "fo-ota-watch", [topics.update_status])
    d = start(tmp_path, big_models.base, device, config([n1, n2, n0], extra))
    server: BlockServer | None = None
    try:
        connected_to(d, n1)
        assert d.client().info()["version"] == "1.0.0"
        server = BlockServer([n2, n0], path, device)
        server.pump_until(lambda: server is not None and server.held is not None, 60)
        at = len(d.read_log())
        killed = time.monotonic()
        n1.kill()
        server.release()
        connected_to(d, n2, at)
        assert time.monotonic() - killed < FAILOVER_S
        n1.launch()
        server.pump_until(server.final, 120)
        assert server.statuses[-1].phase == fpb.UpdateStatus.COMMITTED, server.statuses
        assert d.client().info()["version"] == "1.2.0"
        want = recorded(d)
        assert want, d.read_log()
        watch.wait(lambda _s: delivered(watch, [topics.update_status]) >= want, 30)
    finally:
        if server is not None:
            server.link.close()
        assert d.stop() == 0, d.read_log()
        watch.close()


def test_fleet_send_survives_its_node_dying(
    tiny_model_dir: Path, tmp_path: Path, nodes: list[RabbitMQ]
) -> None:
    """`fleet send --broker n0 --broker n1`: the command is out through node 0 and the device
    (stopped, SIGSTOP) has not answered when node 0 dies; the operator sends it again through
    node 1 and gets the answer once the device runs again."""
    n0, n1, n2 = nodes
    device = "dev-fo-send"
    topics = Topics(PREFIX, device)
    watch = Observer(n2, "fo-send-watch", [topics.command("ping")])
    d = start(tmp_path, tiny_model_dir, device, config([n1, n2]))
    op = tmp_path / "operator.toml"
    out, err = tmp_path / "send.out", tmp_path / "send.err"
    proc: subprocess.Popen[bytes] | None = None

    def said() -> str:
        return f"operator stdout:\n{out.read_text()}\nstderr:\n{err.read_text()}"

    try:
        connected_to(d, n1)
        d.signal(signal.SIGSTOP)
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen(
                operator("send", device, "ping", "--timeout", "150", brokers=[n0, n1], config=op),
                stdout=o,
                stderr=e,
                cwd=ROOT,
                env=ENV,
            )
        try:
            watch.wait(lambda s: True, 120)  # the command went out through node 0
            n0.kill()
            watch.wait(lambda s: True, 120, since=1)  # ... and again through node 1
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{said()}") from None
        d.signal(signal.SIGCONT)
        assert proc.wait(180) == 0, said()
        assert f"{device} ping: OK" in out.read_text(), said()
        assert "sending ping again" in err.read_text() and n1.url in err.read_text(), said()
        n0.launch()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        d.signal(signal.SIGCONT)
        assert d.stop() == 0, d.read_log()
        watch.close()


class Screen(io.StringIO):
    """What `fleet watch` draws, readable from the test's thread while it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            return super().write(text)

    def text(self) -> str:
        with self.lock:
            return self.getvalue()

    def wait(self, pred: Callable[[str], bool], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not pred(got := self.text()):
            assert time.monotonic() < deadline, f"not drawn within {timeout} s:\n{got[-3000:]}"
            time.sleep(0.05)
        return got


def test_fleet_watch_survives_its_node_dying(
    tiny_model_dir: Path, tmp_path: Path, nodes: list[RabbitMQ]
) -> None:
    """`fleet watch` on node 0 (of n0, n2) shows a device that is on node 1; node 0 dies; the
    table says DISCONNECTED, then comes back titled with node 2 and shows the device again
    (live health: RabbitMQ sends no retained copy to `+/health`)."""
    n0, n1, n2 = nodes
    device = "dev-fo-watch"
    d = start(tmp_path, tiny_model_dir, device, config([n1, n2]))
    urls = [parse_broker("test", "broker", b.url) for b in (n0, n2)]
    opts = MqttOptions(urls[0], other_brokers=(urls[1],), protocol="3.1.1")
    screen, stop = Screen(), threading.Event()
    watcher = threading.Thread(
        target=watch,
        args=(opts, PREFIX),
        kwargs={
            "once": False,
            "out": screen,
            "stop": stop,
            "screen": False,
            "size": lambda: (200, 40),
        },
    )
    try:
        connected_to(d, n1)
        watcher.start()
        screen.wait(lambda t: f"· {n0.url} ·" in t and device in t)
        n0.kill()
        gone = screen.wait(lambda t: "DISCONNECTED" in t)
        at = gone.index("DISCONNECTED")
        screen.wait(lambda t: f"· {n2.url} ·" in t[at:] and device in t[t.index(n2.url, at) :])
        n0.launch()
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(30)
        assert d.stop() == 0, d.read_log()


def wait_text(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the file holds `text` (a line the rollout wrote); fails if the process ended
    first. `timeout` is a safety limit, not a speed."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if proc.poll() is not None and text not in path.read_text():
            raise AssertionError(f"the rollout exited ({proc.returncode}) before {text!r}")
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
        time.sleep(0.05)


def test_a_rollout_survives_its_node_dying(
    big_models: Models,  # noqa: F811
    trusted: Path,  # noqa: F811
    tmp_path: Path,
    nodes: list[RabbitMQ],
) -> None:
    """`fleet rollout start --target A,B --waves 50%,100% --broker n0 --broker n1 --broker n2`,
    its own process, on node 0; A is on node 1, B (stopped, SIGSTOP) on node 2, and the rollout
    hears them only live (RabbitMQ sends no retained message to `+/health`). So wave 1 offers
    A; node 0 dies once A asks for its first MQTT block, the rollout reconnects to node 1, A
    gets its blocks (asked again if lost) and commits. Wave 2 waits for the named B, which runs
    again only now: it is offered through node 1 and commits; the rollout completes (exit 0),
    each device offered once. Every step waits on an event (a block request seen on node 2, a
    line of the rollout); stopping B is what makes the order certain."""
    n0, n1, n2 = nodes
    a, b = "dev-fo-roll-a", "dev-fo-roll-b"
    path = bundle(big_models, tmp_path)  # no URL: the payload comes in blocks over MQTT
    extra = (
        '[model]\nquantization = "int8"\n'
        f'[updates]\ntrusted_keys_dir = "{trusted}"\ntrial_s = 1.0\n'
        "retry_s = 0.5\nprogress_interval_s = 0.2\n"
        'clock = "trusted"\n'
    )
    blocks = Topics(PREFIX, a).block_request
    watch = Observer(n2, "fo-roll-watch", [blocks])
    daemons: dict[str, Daemon] = {}
    out, err = tmp_path / "rollout.out", tmp_path / "rollout.err"
    proc: subprocess.Popen[bytes] | None = None

    def said() -> str:
        return f"rollout stdout:\n{out.read_text()}\nstderr:\n{err.read_text()[-6000:]}"

    try:
        for device, brokers in ((a, [n1, n2, n0]), (b, [n2, n1, n0])):
            (tmp_path / device).mkdir()
            d = daemons[device] = start(tmp_path / device, big_models.base, device,
                                        config(brokers, extra))  # fmt: skip
            connected_to(d, brokers[0])
            assert d.client().info()["version"] == "1.0.0"
        daemons[b].signal(signal.SIGSTOP)  # not heard by the rollout until it runs again
        argv = operator("rollout", "start", str(path), "--target", f"{a},{b}", "--id", "r-fo",
                        "--waves", "50%,100%", "--soak", "0", "--wave-timeout", "300s",
                        "--rollouts-dir", str(tmp_path / "rollouts"), "--json",
                        brokers=[n0, n1, n2], config=tmp_path / "operator.toml")  # fmt: skip
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen(argv, stdout=o, stderr=e, cwd=ROOT, env=ENV)
        try:
            watch.wait(lambda s: s.topic == blocks, 120)  # A was offered and is downloading
            n0.kill()
            wait_text(err, "lost the broker", proc, 60)
            wait_text(err, "wave 1 ended", proc, 180)  # A committed, heard through node 1
            daemons[b].signal(signal.SIGCONT)
            assert proc.wait(240) == 0
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{said()}") from None
        n0.launch()  # back in the background; the next test waits for it
        rep = json.loads(out.read_text())
        assert rep["state"] == "completed" and rep["not_updated"] == {}, said()
        assert (rep["offered"], rep["committed"], rep["failed"]) == (2, 2, 0), said()
        got = [(d["device"], d["wave"], d["attempt"], d["status"]) for d in rep["devices"]]
        assert got == [(a, 1, 1, "committed"), (b, 2, 1, "committed")], said()
        lines = err.read_text()
        assert lines.index("lost the broker") < lines.index("wave 2 (100%): offering to 1"), said()
        assert f"trying {n1.url}" in lines, said()  # the dead node refused, then the next one
        for d in daemons.values():
            assert d.client().info()["version"] == "1.2.0", d.read_log()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        stopped = []
        for d in daemons.values():
            d.signal(signal.SIGCONT)
            stopped.append((d.stop(), d))
        watch.close()
        for code, d in stopped:
            assert code == 0, d.read_log()
