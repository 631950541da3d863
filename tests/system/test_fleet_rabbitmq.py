"""The fleet link against a second, independent broker: RabbitMQ's MQTT plugin (Debian's
rabbitmq-server, MQTT 3.1.1), with the real daemon on the tiny model and the real operator
commands. Presence (birth, Will, offline), health, commands with the route inside the Command,
a persistent session holding a command while the device is away, an update whose payload comes
in blocks over MQTT, and JSON payloads (docs/FLEET.md, "Brokers").

RabbitMQ 3.10 sends retained messages only to subscriptions without wildcards: the observers
that check a retained copy subscribe to the exact topic. `test_what_rabbitmq_does_differently`
pins that and the other difference that docs/FLEET.md describes (a `.` in a topic is a level).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.fleet.topics import Topics
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.broker_rabbitmq import RabbitMQ
from tests.support.daemon_harness import Daemon
from tests.system.test_updates import Models, big_models, bundle, trusted  # noqa: F401  (fixtures)
from tests.unit.operator.test_fleet_publish import edge_agent

PREFIX = "fleet/v1"
FLEET = (
    '[fleet]\nprotocol = "3.1.1"\nhealth_interval_s = 1\nhealth_min_interval_s = 0.2\n'
    "max_command_bytes = 2048\n"
)
State = fpb.DeviceState


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMQ]:
    b = RabbitMQ(tmp_path_factory.mktemp("rabbitmq"))
    yield b
    b.stop()


@dataclass(frozen=True)
class Seen:
    topic: str
    payload: bytes
    retain: bool


class Observer:
    """An MQTT 3.1.1 client recording what arrives on `topics` (QoS 1)."""

    def __init__(self, broker: RabbitMQ, name: str, topics: list[str]) -> None:
        self.seen: list[Seen] = []
        self._cv = threading.Condition()
        subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv311
        )
        self.client.on_connect = lambda c, *_: c.subscribe([(t, 1) for t in topics])
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        assert subscribed.wait(10), f"{name}: no SUBACK"

    def _on_message(self, _c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        with self._cv:
            self.seen.append(Seen(msg.topic, bytes(msg.payload), bool(msg.retain)))
            self._cv.notify_all()

    def wait(self, pred: Callable[[Seen], bool], timeout: float = 30.0, since: int = 0) -> Seen:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for s in self.seen[since:]:
                    if pred(s):
                        return s
                left = deadline - time.monotonic()
                if left <= 0:
                    last = [(s.topic, s.retain) for s in self.seen[since:]][-10:]
                    raise AssertionError(f"not seen within {timeout} s; last: {last}")
                self._cv.wait(left)

    def state(self, device: str, kind: int, since: int = 0, timeout: float = 30.0) -> Seen:
        topic = Topics(PREFIX, device).state
        return self.wait(
            lambda s: s.topic == topic and State.FromString(s.payload).state == kind,
            timeout,
            since,
        )

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def retained(broker: RabbitMQ, topic: str) -> Seen:
    """The retained copy a client subscribing to exactly `topic` gets now."""
    late = Observer(broker, f"late-{time.monotonic_ns()}", [topic])
    try:
        return late.wait(lambda s: s.topic == topic, 10)
    finally:
        late.close()


def agent(tmp: Path, model: Path, broker: RabbitMQ, device: str, config: str = FLEET) -> Daemon:
    return Daemon(tmp, model, config, args=("--broker", broker.url, "--device-id", device))


def connection(broker: RabbitMQ, config: Path) -> list[str]:
    config.write_text("")
    return ["--broker", broker.url, "--protocol", "3.1.1", "--config", str(config)]


# ----------------------------------------------------------------------------- presence, health


def test_birth_retained_health_and_offline_on_rabbitmq(
    tiny_model_dir: Path, tmp_path: Path, rabbit: RabbitMQ
) -> None:
    device = "dev-rmq-birth"
    topics = Topics(PREFIX, device)
    watch = Observer(rabbit, "rmq-watch", [f"{PREFIX}/#"])
    d = agent(tmp_path, tiny_model_dir, rabbit, device)
    try:
        birth = State.FromString(watch.state(device, State.ONLINE).payload)
        assert birth.device_id == device and birth.session >= 1
        assert len(birth.model_sha256) == 64 and "int8" in birth.model
        # a second subscriber, connecting now, gets the birth as the retained copy
        kept = retained(rabbit, topics.state)
        assert kept.retain and State.FromString(kept.payload) == birth
        # health: retained too, and the heartbeat moves seq within one session
        first = fpb.Health.FromString(watch.wait(lambda s: s.topic == topics.health).payload)
        n = len(watch.seen)
        later = fpb.Health.FromString(watch.wait(lambda s: s.topic == topics.health, 10, n).payload)
        assert later.seq > first.seq and later.session == first.session == birth.session
        assert later.model.sha256 == birth.model_sha256 and later.agent_state == "serving"
        kept_health = retained(rabbit, topics.health)
        assert kept_health.retain and fpb.Health.FromString(kept_health.payload).seq >= later.seq
    finally:
        n = len(watch.seen)
        assert d.stop() == 0, d.read_log()
    offline = State.FromString(watch.state(device, State.OFFLINE, since=n).payload)
    assert offline.session == birth.session
    time.sleep(1)  # a clean disconnect: no Will after it
    states = [State.FromString(s.payload).state for s in watch.seen[n:] if s.topic == topics.state]
    assert states == [State.OFFLINE]
    assert State.FromString(retained(rabbit, topics.state).payload).state == State.OFFLINE
    watch.close()


def publish(broker: RabbitMQ, topic: str, payload: bytes, retain: bool = False) -> None:
    """One QoS 1 message, acknowledged by the broker."""
    pub = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"pub-{time.monotonic_ns()}", protocol=mqtt.MQTTv311
    )
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    try:
        pub.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)
    finally:
        pub.loop_stop()
        pub.disconnect()


def test_what_rabbitmq_does_differently(rabbit: RabbitMQ) -> None:
    """The two departures from MQTT 3.1.1 that docs/FLEET.md ("Brokers") describes, which
    mosquitto does not make:

    * a retained message goes only to a subscription naming its exact topic, not to
      `fleet/v1/+/state` (§3.3.1.3: to every matching one): `fleet watch` sees live messages only;
    * a `.` in a topic is a level separator (MQTT topics are AMQP routing keys there) and comes
      back as `/`: a device id with a `.` does not work on this broker.
    """
    topic = f"{PREFIX}/dev-rmq-wild/state"
    publish(
        rabbit, topic, State(device_id="dev-rmq-wild", state=State.ONLINE).SerializeToString(), True
    )
    assert retained(rabbit, topic).retain  # stored, and sent to the exact topic
    wild = Observer(rabbit, "rmq-wild-late", [f"{PREFIX}/+/state"])
    try:
        time.sleep(2)  # mosquitto sends it within milliseconds
        assert [s for s in wild.seen if s.topic == topic] == []
    finally:
        wild.close()

    dotted = Topics(PREFIX, "dev.rmq")
    exact = Observer(rabbit, "rmq-dots", [dotted.commands])
    levels = Observer(rabbit, "rmq-dots-levels", [f"{PREFIX}/+/cmd/+"])
    try:
        publish(rabbit, dotted.command("ping"), b"")
        got = exact.wait(lambda s: True)
        assert got.topic == f"{PREFIX}/dev/rmq/cmd/ping"  # not dotted.command("ping")
        publish(rabbit, Topics(PREFIX, "dev-rmq").command("ping"), b"")
        levels.wait(lambda s: True)  # an id without a dot matches `+`; the dotted one did not
        assert [s.topic for s in levels.seen] == [f"{PREFIX}/dev-rmq/cmd/ping"]
    finally:
        exact.close()
        levels.close()


def test_sigkill_fires_the_retained_will_on_rabbitmq(
    tiny_model_dir: Path, tmp_path: Path, rabbit: RabbitMQ
) -> None:
    device = "dev-rmq-will"
    watch = Observer(rabbit, "rmq-will-watch", [f"{PREFIX}/{device}/state"])
    d = agent(tmp_path, tiny_model_dir, rabbit, device)
    try:
        birth = State.FromString(watch.state(device, State.ONLINE).payload)
        d.proc.kill()
        lost = State.FromString(watch.state(device, State.LOST).payload)
        assert lost.session == birth.session
        kept = retained(rabbit, Topics(PREFIX, device).state)
        assert kept.retain and State.FromString(kept.payload).state == State.LOST
    finally:
        d.stop()
        watch.close()


# ----------------------------------------------------------------------------- commands


def test_operator_commands_over_311_carry_their_route_in_the_command(
    tiny_model_dir: Path, tmp_path: Path, rabbit: RabbitMQ
) -> None:
    device = "dev-rmq-cmd"
    topics = Topics(PREFIX, device)
    cmds = Observer(rabbit, "rmq-cmd-watch", [topics.commands, f"{topics.base}/resp/+"])
    d = agent(tmp_path, tiny_model_dir, rabbit, device)
    conn = connection(rabbit, tmp_path / "operator.toml")
    try:
        retained(rabbit, topics.state)  # online: its subscriptions exist
        pong = edge_agent("fleet", "send", device, "ping", "--json", *conn)
        assert pong.returncode == 0, pong.stderr
        answer = json.loads(pong.stdout)
        assert answer["code"] == "OK" and int(answer["pong"]["session"]) >= 1
        sent = cmds.wait(lambda s: s.topic == topics.command("ping"))
        command = fpb.Command.FromString(sent.payload)
        # 3.1.1 has no response topic or correlation data: both travel in the Command
        assert command.reply_topic.startswith(f"{topics.base}/resp/")
        assert len(command.correlation) == 16
        reply = cmds.wait(lambda s: s.topic == command.reply_topic)
        assert fpb.CommandResponse.FromString(reply.payload).code == fpb.CommandResponse.OK
        status = edge_agent("fleet", "send", device, "status", *conn)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith(f"{device} status: OK") and "int8" in status.stdout
        # a garbled command has no route to answer on: ignored, and the agent goes on
        pub = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="rmq-garbage", protocol=mqtt.MQTTv311
        )
        pub.connect("127.0.0.1", rabbit.port)
        pub.loop_start()
        pub.publish(topics.command("ping"), b"\xff\x00garbage", qos=1).wait_for_publish(10)
        pub.loop_stop()
        pub.disconnect()
        again = edge_agent("fleet", "send", device, "ping", *conn)
        assert again.returncode == 0, again.stderr
        assert "without a response topic" in d.read_log()
        assert d.client().health() == "SERVING"
    finally:
        assert d.stop() == 0, d.read_log()
        cmds.close()


def test_a_command_sent_while_the_device_was_away_is_answered_when_it_is_back(
    tiny_model_dir: Path, tmp_path: Path, rabbit: RabbitMQ
) -> None:
    """clean_session=false: RabbitMQ keeps the device's queue while it is disconnected."""
    device = "dev-rmq-away"
    topics = Topics(PREFIX, device)
    reply_topic = topics.response("rmq-waiting")
    requester = Observer(rabbit, "rmq-waiting", [reply_topic])
    d = agent(tmp_path, tiny_model_dir, rabbit, device)
    try:
        retained(rabbit, topics.state)
        assert d.stop() == 0, d.read_log()  # a clean disconnect; the session stays
        ping = fpb.Command(reply_topic=reply_topic, correlation=b"while-away")
        info = requester.client.publish(topics.command("ping"), ping.SerializeToString(), qos=1)
        info.wait_for_publish(10)
        d = agent(tmp_path, tiny_model_dir, rabbit, device)
        got = requester.wait(lambda s: s.topic == reply_topic, 30)
        response = fpb.CommandResponse.FromString(got.payload)
        assert response.code == fpb.CommandResponse.OK and response.pong.session >= 2
    finally:
        d.stop()
        requester.close()


# ----------------------------------------------------------------------------- updates


def test_an_update_in_blocks_over_mqtt_commits_on_rabbitmq(
    big_models: Models,  # noqa: F811
    trusted: Path,  # noqa: F811
    tmp_path: Path,
    rabbit: RabbitMQ,
) -> None:
    device = "dev-rmq-ota"
    topics = Topics(PREFIX, device)
    path = bundle(big_models, tmp_path)  # no URL: the payload comes in blocks over MQTT
    config = (
        FLEET + '[model]\nquantization = "int8"\n'
        f'[updates]\ntrusted_keys_dir = "{trusted}"\ntrial_s = 1.0\n'
        "retry_s = 0.5\nprogress_interval_s = 0.2\n"
        'clock = "trusted"\n'  # this machine's clock may not say it is synchronized
    )
    blocks = Observer(rabbit, "rmq-blocks", [topics.block_data])
    d = agent(tmp_path, big_models.base, rabbit, device, config)
    conn = connection(rabbit, tmp_path / "operator.toml")
    try:
        retained(rabbit, topics.state)
        assert d.client().info()["version"] == "1.0.0"
        done = edge_agent(
            "fleet", "publish-update", str(path), "--device", device, "--timeout", "120", *conn
        )
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.strip().split("\n")
        assert lines[-1] == "1 of 1 devices committed the update", done.stdout
        assert f"{device}: COMMITTED" in done.stdout and f"{device}: DOWNLOADING" in done.stdout
        assert d.client().info()["version"] == "1.2.0"
        served = [opb.Block.FromString(s.payload) for s in blocks.seen]
        # the device asks for 64 KiB blocks: this payload is one full block and a short one
        assert len(served) >= 2 and max(len(b.data) for b in served) == 64 << 10
        assert sorted(b.offset for b in served) == [b.offset for b in served]
        assert served[-1].offset + len(served[-1].data) == served[-1].total
    finally:
        assert d.stop() == 0, d.read_log()
        blocks.close()


def test_json_payloads_over_311_on_rabbitmq(
    tiny_model_dir: Path, tmp_path: Path, rabbit: RabbitMQ
) -> None:
    """`encoding = "json"` with no MQTT 5 properties: the payload alone says it is JSON, and
    the operator tools read it (docs/FLEET.md, "Payloads")."""
    device = "dev-rmq-json"
    topics = Topics(PREFIX, device)
    d = agent(tmp_path, tiny_model_dir, rabbit, device, FLEET + 'encoding = "json"\n')
    conn = connection(rabbit, tmp_path / "operator.toml")
    try:
        birth = json.loads(retained(rabbit, topics.state).payload)
        assert birth["deviceId"] == device and birth["state"] == "ONLINE"
        pong = edge_agent("fleet", "send", device, "ping", "--json", *conn)
        assert pong.returncode == 0, pong.stderr
        assert json.loads(pong.stdout)["code"] == "OK"
    finally:
        assert d.stop() == 0, d.read_log()
