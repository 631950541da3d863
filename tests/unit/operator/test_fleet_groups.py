"""Groups, tags and inventory (docs/FLEET.md "Groups, tags and inventory"): three real daemons
in two groups against a real mosquitto on loopback; `fleet watch --group`, `fleet send --group`
and `fleet inventory` read what they really announce."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import platform
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import __version__
from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions
from agent.fleet.topics import Topics
from agent.operator.client import watch
from agent.operator.digest import Presence
from agent.operator.fanout import MAX_IN_FLIGHT, Outcome, Result, send_many
from agent.operator.inventory import InventoryRow, inventory, split_model
from agent.operator.render import inventory_json, inventory_table, render
from agent.operator.view import FleetView
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon_harness import Daemon
from tests.unit.operator.test_fleet_operator import cli

PREFIX = "fleet/v1"
State = pb.DeviceState
# device -> (group, tags); dev-a2 is stopped cleanly and dev-b1 killed in the send test
DEVICES = {
    "dev-a1": ("alpha", ("lab", "rack=1")),
    "dev-a2": ("alpha", ()),
    "dev-b1": ("beta", ("edge",)),
}
INVENTORY_KEYS = {
    "device",
    "group",
    "tags",
    "state",
    "session",
    "model",
    "version",
    "sha256",
    "digest",
    "quantization",
    "profile",
    "arch",
    "agent_version",
    "last_seen_unix",
    "last_seen_age_s",
    "update_phase",
    "update_id",
    "update_to_version",
    "switch_policy",
    "waiting_for",
    "switch_window",
    "next_window_unix",
}


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables fit the terminal (shutil.get_terminal_size reads COLUMNS first): the checks below
    read every column, whatever terminal, pipe or test worker runs them."""
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("LINES", "50")


def config(group: str, tags: tuple[str, ...]) -> str:
    return (
        "[fleet]\nhealth_interval_s = 1\nhealth_min_interval_s = 0.2\n"
        f'group = "{group}"\ntags = {json.dumps(list(tags))}\n'
    )


class Retained:
    """A raw MQTT 5 client recording every state and health payload under the prefix."""

    def __init__(self, broker: Mosquitto) -> None:
        self.states: dict[str, list[State]] = {}
        self.healths: dict[str, list[pb.Health]] = {}
        self._cv = threading.Condition()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"groups-{time.monotonic_ns()}",
            protocol=mqtt.MQTTv5,
        )
        self.client.on_connect = lambda c, *_: c.subscribe(
            [(f"{PREFIX}/+/state", 1), (f"{PREFIX}/+/health", 1)]
        )
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()

    def _on_message(self, _c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        device, kind = msg.topic.split("/")[-2:]
        if not msg.payload:
            return
        with self._cv:
            if kind == "state":
                self.states.setdefault(device, []).append(State.FromString(msg.payload))
            else:
                self.healths.setdefault(device, []).append(pb.Health.FromString(msg.payload))
            self._cv.notify_all()

    def state(self, device: str, kind: int, timeout: float = 30.0) -> State:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                found = [s for s in self.states.get(device, []) if s.state == kind]
                if found:
                    return found[-1]
                left = deadline - time.monotonic()
                assert left > 0, f"no state {kind} of {device}: {self.states.get(device)}"
                self._cv.wait(left)

    def health(self, device: str, timeout: float = 30.0) -> pb.Health:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self.healths.get(device):
                left = deadline - time.monotonic()
                assert left > 0, f"no health of {device}"
                self._cv.wait(left)
            return self.healths[device][-1]

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@dataclass
class Fleet:
    broker: Mosquitto
    daemons: dict[str, Daemon]
    retained: Retained
    model_dir: Path


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    broker = Mosquitto(tmp_path_factory.mktemp("groups-broker"))
    retained = Retained(broker)

    def start(device: str) -> Daemon:
        group, tags = DEVICES[device]
        args = ("--broker", broker.url, "--device-id", device)
        tmp = tmp_path_factory.mktemp(device)
        return Daemon(tmp, tiny_model_dir, config(group, tags), args=args)

    with ThreadPoolExecutor(len(DEVICES)) as pool:
        futures = {d: pool.submit(start, d) for d in DEVICES}
    daemons = {}
    try:
        daemons = {d: f.result() for d, f in futures.items()}
        for device in DEVICES:
            retained.state(device, State.ONLINE, timeout=60)
            retained.health(device, timeout=60)
        yield Fleet(broker, daemons, retained, tiny_model_dir)
    finally:
        for f in futures.values():
            if f.exception() is None:
                f.result().stop()
        retained.close()
        broker.stop()


# ----------------------------------------------------------------------------- device side


def test_birth_and_health_carry_group_tags_and_arch(fleet: Fleet) -> None:
    for device, (group, tags) in DEVICES.items():
        birth = fleet.retained.state(device, State.ONLINE)
        health = fleet.retained.health(device)
        for msg in (birth, health):
            assert (msg.group, tuple(msg.tags)) == (group, tags), device
            assert msg.arch == platform.machine() and msg.arch


# ----------------------------------------------------------------------------- watch


def test_watch_group_shows_only_that_group(
    fleet: Fleet, empty_config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["fleet", "watch", "--broker", fleet.broker.url, "--config", empty_config]
    base += ["--once", "--settle", "0.3"]
    assert cli([*base, "--json", "--group", "alpha"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["device"] for d in doc] == ["dev-a1", "dev-a2"]
    assert [(d["group"], tuple(d["tags"])) for d in doc] == [DEVICES["dev-a1"], DEVICES["dev-a2"]]
    assert doc[0]["health"]["arch"] == platform.machine()
    assert cli([*base, "--group", "alpha"]) == 0
    lines = capsys.readouterr().out.strip().split("\n")
    assert lines[0].startswith("group 'alpha': 2 devices: 2 online") and "(of 3)" in lines[0]
    assert lines[1].split()[:3] == ["DEVICE", "STATE", "GROUP"]
    assert [line.split()[:3] for line in lines[2:]] == [
        ["dev-a1", "online", "alpha"],
        ["dev-a2", "online", "alpha"],
    ]
    assert cli([*base, "--group", "nobody"]) == 0
    assert "(no device matches)" in capsys.readouterr().out
    # the live table too
    out, stop = io.StringIO(), threading.Event()
    opts = options(fleet.broker)
    live = threading.Thread(
        target=watch,
        args=(opts, PREFIX),
        kwargs=dict(once=False, group="beta", out=out, size=lambda: (120, 20), stop=stop),
    )
    live.start()
    try:
        deadline = time.monotonic() + 60  # a limit: until the last frame shows the device
        while time.monotonic() < deadline:
            frame = out.getvalue().rsplit("\x1b[H", 1)[-1]
            if "dev-b1" in frame and "group 'beta': 1 device: 1 online" in frame:
                break
            time.sleep(0.1)
    finally:
        stop.set()
        live.join(10)
    frame = out.getvalue().rsplit("\x1b[H", 1)[-1]
    assert "group 'beta': 1 device: 1 online" in frame
    assert "dev-b1" in frame and "dev-a1" not in frame


# ----------------------------------------------------------------------------- inventory


def test_inventory_table_and_json_are_what_the_daemons_serve(
    fleet: Fleet, empty_config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = json.loads((fleet.model_dir / "metadata.json").read_text())
    base = ["fleet", "inventory", "--broker", fleet.broker.url, "--config", empty_config]
    base += ["--settle", "0.3"]
    assert cli([*base, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["device"] for d in doc] == sorted(DEVICES)
    for d in doc:
        assert set(d) == INVENTORY_KEYS
        assert (d["group"], tuple(d["tags"])) == DEVICES[d["device"]]
        assert (d["model"], d["version"]) == (meta["name"], meta["version"])
        assert d["quantization"] == "int8"
        served = fleet.model_dir / f"model_{d['quantization']}.tflite"
        assert d["sha256"] == hashlib.sha256(served.read_bytes()).hexdigest()
        assert (d["profile"], d["arch"]) == ("generic-x86_64", platform.machine())
        assert d["agent_version"] == __version__ and d["state"] == "online"
        assert d["session"] >= 1 and d["update_phase"] == ""
        assert abs(time.time() - d["last_seen_unix"]) < 120
    assert cli([*base, "--group", "beta"]) == 0
    table = capsys.readouterr().out.strip().split("\n")
    assert table[0] == "1 device: 1 online, 0 offline, 0 lost · 1 model build"
    titles = table[1].split()
    assert titles[:4] == ["DEVICE", "GROUP", "TAGS", "MODEL"]
    assert {"VERSION", "SHA256", "QUANT", "PROFILE", "ARCH", "AGENT", "STATE", "SEEN"} <= set(
        titles
    )
    (row,) = table[2:]
    sha = doc[2]["sha256"]
    assert row.split()[:5] == ["dev-b1", "beta", "edge", meta["name"], meta["version"]]
    assert sha[:12] in row.split() and sha not in row


# ----------------------------------------------------------------------------- send


def test_send_group_reaches_only_the_group_and_reports_the_rest(
    fleet: Fleet, empty_config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a device whose retained state says online in alpha but that nothing answers for
    ghost = State(
        state=State.ONLINE,
        session=1,
        device_id="dev-ghost",
        group="alpha",
        timestamp_unix=time.time(),
    )
    fleet.retained.publish(Topics(PREFIX, "dev-ghost").state, ghost.SerializeToString())
    # dev-a2 stops cleanly: its retained OFFLINE still names its group
    a2 = fleet.daemons["dev-a2"]
    assert a2.stop() == 0, a2.read_log()
    offline = fleet.retained.state("dev-a2", State.OFFLINE)
    assert offline.group == "alpha" and offline.arch == platform.machine()

    base = ["--broker", fleet.broker.url, "--config", empty_config]
    t0 = time.monotonic()
    assert cli(["fleet", "send", "--group", "alpha", "ping", "--timeout", "2", *base]) == 1
    took = time.monotonic() - t0
    lines = capsys.readouterr().out.strip().split("\n")
    by_device = {line.split()[0]: line for line in lines[:-1]}
    assert set(by_device) == {"dev-a1", "dev-a2", "dev-ghost"}
    assert by_device["dev-a1"] == "dev-a1 ping: OK"
    assert by_device["dev-a2"].startswith("dev-a2 ping: not sent: offline, last seen ")
    assert by_device["dev-ghost"] == (
        "dev-ghost ping: failed: no answer within 2 s (its retained state: online)"
    )
    assert lines[-1] == "1 of 3 devices of group 'alpha' answered OK"
    assert took < 30  # not waited on forever (2 s per silent device, all at once)
    assert fleet.daemons["dev-a1"].read_log().count("command ping received") == 1
    assert "command ping received" not in fleet.daemons["dev-b1"].read_log()

    assert cli(["fleet", "send", "--group", "beta", "status", "--json", *base]) == 0
    first, summary = [json.loads(line) for line in capsys.readouterr().out.strip().split("\n")]
    assert (first["device"], first["outcome"], first["response"]["code"]) == ("dev-b1", "ok", "OK")
    assert first["response"]["status"]["group"] == "beta"
    assert summary == {"summary": {"group": "beta", "devices": 1, "ok": ["dev-b1"], "failed": {}}}
    assert "command ping received" not in fleet.daemons["dev-b1"].read_log()

    # an MQTT 3.1.1 operator: the route goes in the Command, the topic identifies the answer
    assert cli(["fleet", "send", "--group", "beta", "ping", "--protocol", "3.1.1", *base]) == 0
    assert capsys.readouterr().out.split("\n")[0] == "dev-b1 ping: OK"

    # the Will names the group too
    b1 = fleet.daemons["dev-b1"]
    b1.proc.send_signal(signal.SIGKILL)
    lost = fleet.retained.state("dev-b1", State.LOST)
    assert (lost.group, tuple(lost.tags)) == DEVICES["dev-b1"]


class Responder:
    """One MQTT client answering `ping` for every device under `prefix`; it holds answers back
    until `hold` commands are unanswered (or none came for `idle_s`), then answers them all, and
    records the most it ever saw unanswered."""

    def __init__(self, broker: Mosquitto, prefix: str, hold: int, idle_s: float = 1.0) -> None:
        self.prefix, self.hold, self.idle_s = prefix, hold, idle_s
        self.held: list[tuple[str, bytes]] = []
        self.received: list[str] = []
        self.most = 0
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        ready = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="responder", protocol=mqtt.MQTTv5
        )
        self.client.on_subscribe = lambda *_: ready.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker.port)
        self.client.subscribe(f"{prefix}/+/cmd/+", qos=1)
        self.client.loop_start()
        assert ready.wait(10)
        self._idler = threading.Thread(target=self._idle, daemon=True)
        self._idler.start()

    def _on_message(self, _c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        device = msg.topic.split("/")[-3]
        corr = bytes(msg.properties.CorrelationData)  # type: ignore[union-attr]
        with self._lock:
            self.received.append(device)
            self.held.append((msg.properties.ResponseTopic, corr))  # type: ignore[union-attr]
            self.most = max(self.most, len(self.held))
            self._last = time.monotonic()
            if len(self.held) >= self.hold:
                self._answer()

    def _idle(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                if self.held and time.monotonic() - self._last > self.idle_s:
                    self._answer()

    def _answer(self) -> None:
        for topic, corr in self.held:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.CorrelationData = corr
            resp = pb.CommandResponse(code=pb.CommandResponse.OK, command="ping")
            self.client.publish(topic, resp.SerializeToString(), qos=1, properties=props)
        self.held.clear()

    def close(self) -> None:
        self._stop.set()
        self._idler.join(5)
        self.client.loop_stop()
        self.client.disconnect()


def test_send_many_keeps_16_unanswered_on_one_connection(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path)
    prefix, now = "fleet/many", time.time()
    view = FleetView(prefix)
    for i in range(40):
        kind = State.OFFLINE if i % 10 == 9 else State.ONLINE
        st = State(state=kind, session=1, device_id=f"d{i:02d}", group="g", timestamp_unix=now)
        view.update(f"{prefix}/d{i:02d}/state", st.SerializeToString(), now)
    targets = inventory(view, "g")
    # a sender that kept more than 16 unanswered would make it hold 17
    responder = Responder(broker, prefix, hold=MAX_IN_FLIGHT + 1)
    try:
        connections = broker.read_log().count("New client connected")
        results = send_many(options(broker), prefix, targets, "ping", timeout_s=20)
        assert broker.read_log().count("New client connected") == connections + 1
    finally:
        responder.close()
        broker.stop()
    outcomes = {d: r.outcome for d, r in results.items()}
    assert outcomes == {
        f"d{i:02d}": Outcome.OFFLINE if i % 10 == 9 else Outcome.OK for i in range(40)
    }
    assert sorted(responder.received) == sorted(d for d, o in outcomes.items() if o == "ok")
    # never more than 16 unanswered, and the sender did fill the window (waiting for answers)
    assert responder.most == MAX_IN_FLIGHT


def test_send_many_fails_over_to_the_next_broker_and_sends_the_unanswered_again(
    tmp_path: Path,
) -> None:
    """Two brokers (a cluster's nodes, as the operator sees them): the first dies with 16
    commands sent and none answered; the run connects to the second, sends those 16 again and
    the rest, and every device answers there — no `not_sent`, no `no_answer`."""
    first, second = Mosquitto(tmp_path / "n1"), Mosquitto(tmp_path / "n2")
    prefix, now = "fleet/failover", time.time()
    view = FleetView(prefix)
    for i in range(24):
        st = State(state=State.ONLINE, session=1, device_id=f"d{i:02d}", timestamp_unix=now)
        view.update(f"{prefix}/d{i:02d}/state", st.SerializeToString(), now)
    silent = Responder(first, prefix, hold=10**6, idle_s=1e9)  # takes commands, never answers
    answering = Responder(second, prefix, hold=1)
    opts = dataclasses.replace(
        options(first), other_brokers=(parse_broker("test", "broker", second.url),)
    )
    results: dict[str, Result] = {}
    run = threading.Thread(
        target=lambda: results.update(
            send_many(opts, prefix, inventory(view, None), "ping", timeout_s=120)
        )
    )
    try:
        run.start()
        deadline = time.monotonic() + 120  # a safety limit, not a speed
        while len(silent.received) < MAX_IN_FLIGHT and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(silent.received) == MAX_IN_FLIGHT  # the window is full, nothing answered
        assert first.proc is not None
        first.proc.kill()  # the node dies (no clean shutdown)
        first.proc.wait()
        run.join(240)
        assert not run.is_alive()
    finally:
        silent.close()
        answering.close()
        first.stop()
        second.stop()
    assert {d: r.outcome for d, r in results.items()} == {
        f"d{i:02d}": Outcome.OK for i in range(24)
    }
    # the 16 sent to the dead node were sent again, and the other 8 went to the second only
    assert sorted(answering.received) == [f"d{i:02d}" for i in range(24)]
    assert set(silent.received) <= set(answering.received)


def options(broker: Mosquitto) -> MqttOptions:
    return MqttOptions(parse_broker("test", "broker", broker.url))


def test_a_bad_group_is_one_line_and_exit_2(
    empty_config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    unreachable = ["--broker", f"mqtt://127.0.0.1:{free_port()}", "--config", empty_config]
    for argv in (
        ["fleet", "watch", "--once", "--group", "a b"],
        ["fleet", "inventory", "--group=-lead"],
        ["fleet", "send", "--group", "x" * 65, "ping"],
        ["fleet", "send", "--group", "", "ping"],
    ):
        assert cli([*argv, *unreachable]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("edge-agent: --group "), err
        assert "is not valid: 1-64 of A-Z a-z 0-9 _ . : -" in err
    assert cli(["fleet", "send", "--group", "alpha", "dev-a1", "ping", *unreachable]) == 2
    assert "give CMD, not a device id" in capsys.readouterr().err
    assert cli(["fleet", "send", "ping", *unreachable]) == 2
    assert "give DEVICE CMD, or --group G CMD" in capsys.readouterr().err


# ----------------------------------------------------------------------------- pure


def test_inventory_takes_each_field_from_the_newer_half() -> None:
    view = FleetView("p")
    born = State(
        state=State.ONLINE,
        session=3,
        device_id="d1",
        agent_version="0.9.0",
        profile="rpi5",
        model="my model 2.1 int4",
        model_sha256="ab" * 32,
        timestamp_unix=100.0,
        group="west",
        tags=["t1"],
        arch="aarch64",
    )
    view.update("p/d1/state", born.SerializeToString(), 101.0, retained=True)
    # d2: an older birth, then a newer health of a later session after a reload to 1.1
    old = State(state=State.LOST, session=1, device_id="d2", model="m 1.0 int8", group="east")
    old.timestamp_unix = 50.0
    view.update("p/d2/state", old.SerializeToString(), 101.0, retained=True)
    h = pb.Health(seq=1, session=2, device_id="d2", timestamp_unix=90.0, group="east")
    h.model.name, h.model.version, h.model.quantization, h.model.sha256 = "m", "1.1", "int8", "cd"
    h.last_update.phase, h.last_update.update_id = pb.UpdateStatus.COMMITTED, "u-7"
    h.agent_version, h.arch = "0.9.1", "armv7l"
    h.activation.policy, h.activation.waiting_for = "window", "window"
    h.activation.window, h.activation.next_window_unix = "0 3 * * *", 3600.0
    view.update("p/d2/health", h.SerializeToString(), 102.0, retained=True)

    rows = inventory(view)
    assert list(rows) == ["d1", "d2"]
    assert rows["d1"] == InventoryRow(
        "d1", "west", ("t1",), Presence.ONLINE, "my model", "2.1", "ab" * 32, "int4", "rpi5",
        "aarch64", "0.9.0", 100.0, "", session=3,
    )  # fmt: skip
    d2 = rows["d2"]
    assert d2.presence is Presence.ONLINE  # a late Will: the health is of a newer session
    assert (d2.model, d2.version, d2.sha256, d2.arch, d2.agent_version) == (
        "m", "1.1", "cd", "armv7l", "0.9.1"
    )  # fmt: skip
    assert (d2.update_phase, d2.update_id, d2.session) == ("COMMITTED", "u-7", 2)
    assert list(inventory(view, "east")) == ["d2"] and inventory(view, "north") == {}
    assert split_model("m") == ("m", "", "") and split_model("") == ("", "", "")
    # renderings: the table fits any width and keeps DEVICE, MODEL, VERSION, STATE
    for width in (200, 80, 50):
        text = inventory_table(rows, 200.0, width)
        assert max(len(line) for line in text.split("\n")) <= width
        assert all(t in text.split("\n")[1] for t in ("DEVICE", "MODEL", "VERSION", "STATE"))
    doc = inventory_json(rows, 200.0)
    assert [set(d) for d in doc] == [INVENTORY_KEYS] * 2
    assert doc[0]["last_seen_age_s"] == 100.0 and doc[1]["tags"] == []
    assert (doc[0]["switch_policy"], doc[0]["waiting_for"]) == ("", "")
    assert (doc[1]["switch_policy"], doc[1]["waiting_for"], doc[1]["switch_window"]) == (
        "window", "window", "0 3 * * *"
    )  # fmt: skip
    assert doc[1]["next_window_unix"] == 3600.0
    # the watch table hides GROUP for a fleet without groups
    plain = FleetView("p")
    plain.update("p/d9/state", State(state=State.ONLINE, session=1).SerializeToString(), 1.0)
    assert "GROUP" not in render(plain, 2.0, 120) and "GROUP" in render(view, 200.0, 200)
