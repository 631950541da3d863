"""The agent's fleet link end to end: a real `edge-agent run` against a real mosquitto on a
loopback port, observed by a real MQTT client (docs/FLEET.md)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.config.file import parse_broker
from agent.fleet import codec
from agent.fleet.device.link import Backoff
from agent.fleet.mqtt import MqttOptions, payload_type
from agent.fleet.topics import Topics
from agent.operator.client import send
from agent.operator.link import FleetError
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.broker import OPERATOR, Mosquitto, Pki, make_pki
from tests.support.daemon_harness import Daemon

PREFIX = "fleet/v1"
FAST = "[fleet]\nhealth_interval_s = 1\nhealth_min_interval_s = 0.2\nmax_command_bytes = 2048\n"
State = fpb.DeviceState


@dataclass(frozen=True)
class Seen:
    topic: str
    payload: bytes
    retain: bool
    content: str | None


class Observer:
    """An MQTT 5 client that records everything under the fleet prefix. Persistent session:
    QoS 1 messages published while it is disconnected (a broker restart) reach it after."""

    def __init__(
        self, broker: Mosquitto, name: str = "observer", who: str = OPERATOR, persistent=False
    ) -> None:
        self.seen: list[Seen] = []
        self._cv = threading.Condition()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
        if broker.pki is not None:
            pki = broker.pki
            self.client.tls_set(str(pki.ca), str(pki.cert(who)), str(pki.key(who)))
        self.client.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/#", qos=1)
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.2, 1)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 600 if persistent else 0
        self.client.connect("127.0.0.1", broker.port, clean_start=not persistent, properties=props)
        self.client.loop_start()

    def _on_message(self, _c, _u, msg: mqtt.MQTTMessage) -> None:
        with self._cv:
            self.seen.append(Seen(msg.topic, msg.payload, bool(msg.retain), payload_type(msg)))
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
                    topics = [s.topic for s in self.seen[since:]][-20:]
                    raise AssertionError(f"not seen within {timeout} s; last topics: {topics}")
                self._cv.wait(left)

    def state(
        self, device: str, kind: int, timeout: float = 30.0, since: int = 0, after_session: int = 0
    ) -> State:
        """The first `kind` state of `device` (with a session above `after_session`: a
        resubscribe also redelivers the old retained one)."""
        topic = Topics(PREFIX, device).state

        def match(s: Seen) -> bool:
            st = State.FromString(s.payload) if s.topic == topic else None
            return st is not None and st.state == kind and st.session > after_session

        return State.FromString(self.wait(match, timeout, since).payload)

    def events(self, device: str) -> list[fpb.Event]:
        topic = Topics(PREFIX, device).event
        with self._cv:
            return [fpb.Event.FromString(s.payload) for s in self.seen if s.topic == topic]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_backoff_doubles_to_two_minutes_with_jitter_and_resets() -> None:
    b = Backoff()
    delays = [b.delay() for _ in range(12)]
    caps = [1, 2, 4, 8, 16, 32, 64, 120, 120, 120, 120, 120]
    assert all(c / 2 <= d <= c for d, c in zip(delays, caps, strict=True)), delays
    assert len({round(d, 6) for d in delays[7:]}) > 1  # jittered, not lockstep
    b.reset()
    assert 0.5 <= b.delay() <= 1


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path_factory.mktemp("broker"))
    yield b
    b.stop()


def agent(tmp: Path, model: Path, broker: Mosquitto, device: str, config: str = FAST) -> Daemon:
    return Daemon(tmp, model, config, args=("--broker", broker.url, "--device-id", device))


def options(broker: Mosquitto, who: str = OPERATOR, protocol: str = "5") -> MqttOptions:
    pki = broker.pki
    return MqttOptions(
        parse_broker("test", "broker", broker.url),
        protocol=protocol,
        ca_file=pki.ca if pki else None,
        cert_file=pki.cert(who) if pki else None,
        key_file=pki.key(who) if pki else None,
    )


def test_birth_health_and_offline_on_a_clean_stop(tiny_model_dir, tmp_path, broker) -> None:
    watch = Observer(broker)
    d = agent(tmp_path, tiny_model_dir, broker, "dev-birth")
    try:
        birth = watch.state("dev-birth", State.ONLINE)
        assert birth.session >= 1 and birth.device_id == "dev-birth"
        assert birth.profile == "generic-x86_64" and "int8" in birth.model
        assert len(birth.model_sha256) == 64
        topic = Topics(PREFIX, "dev-birth").health
        first = watch.wait(lambda s: s.topic == topic)
        assert first.content == "edge_agent.fleet.v1.Health"
        h = fpb.Health.FromString(first.payload)
        assert h.model.sha256 == birth.model_sha256 and h.session == birth.session
        assert h.memory.budget_bytes == 4 << 30 and h.memory.rss_bytes > 0
        assert h.agent_state == "serving" and h.disk.total_bytes > 0
        # the heartbeat: more health within a few intervals, seq increasing
        n = len(watch.seen)
        later = fpb.Health.FromString(watch.wait(lambda s: s.topic == topic, 10, n).payload)
        assert later.seq > h.seq
        # retained: a client that connects now gets birth and health at once
        late = Observer(broker, "late-observer")
        assert late.wait(lambda s: s.topic == topic).retain
        late.close()
    finally:
        n = len(watch.seen)
        assert d.stop() == 0, d.read_log()
    offline = watch.state("dev-birth", State.OFFLINE, since=n)
    assert offline.session == birth.session
    watch.close()


def test_sigkill_fires_the_will_with_the_session_number(tiny_model_dir, tmp_path, broker) -> None:
    watch = Observer(broker)
    d = agent(tmp_path, tiny_model_dir, broker, "dev-will")
    try:
        birth = watch.state("dev-will", State.ONLINE)
        d.proc.kill()
        lost = watch.state("dev-will", State.LOST)
        assert lost.session == birth.session
    finally:
        d.stop()
        watch.close()


def test_reconnect_after_a_broker_restart_and_events_survive_outage_and_restart(
    tiny_model_dir, tmp_path
) -> None:
    broker = Mosquitto(tmp_path / "own-broker")
    watch = Observer(broker, "event-observer", persistent=True)
    d = agent(tmp_path, tiny_model_dir, broker, "dev-outage")
    try:
        birth = watch.state("dev-outage", State.ONLINE)
        broker.stop()
        for _ in range(2):  # reloads while the broker is down: their events wait on disk
            since = len(d.notify.messages)
            d.signal(signal.SIGHUP)
            d.notify.wait_for("READY", "1", since=since)
        assert len(list((tmp_path / "state" / "fleet" / "events").glob("*.event"))) == 2
        d.stop()  # a restart with undelivered events; the new agent starts with no broker
        d = agent(tmp_path, tiny_model_dir, broker, "dev-outage")
        since = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY", "1", since=since)
        n = len(watch.seen)
        broker.start()
        again = watch.state(
            "dev-outage", State.ONLINE, timeout=60, since=n, after_session=birth.session
        )
        # health coalesced while offline: at most the latest snapshot from before the
        # reconnect went out, not one per heartbeat of the outage
        health = Topics(PREFIX, "dev-outage").health

        def fresh(s: Seen) -> bool:  # a live health taken after the reconnect
            return (
                s.topic == health
                and not s.retain
                and fpb.Health.FromString(s.payload).timestamp_unix > again.timestamp_unix
            )

        # one publisher, QoS 1: whatever was flushed from the outage arrived before it
        watch.wait(fresh, 60, n)
        with watch._cv:
            # live publications only: a resubscribe also redelivers the old retained copy
            after = [
                fpb.Health.FromString(s.payload)
                for s in watch.seen[n:]
                if s.topic == health and not s.retain
            ]
        assert after, "no health after the reconnect"
        assert len([h for h in after if h.timestamp_unix < again.timestamp_unix]) <= 1
        deadline = time.monotonic() + 30
        while len(watch.events("dev-outage")) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        events = watch.events("dev-outage")
        assert [e.seq for e in events] == [events[0].seq + i for i in range(3)], events
        assert all(e.WhichOneof("kind") == "reload" and e.reload.ok for e in events)
        assert not list((tmp_path / "state" / "fleet" / "events").glob("*.event"))
    finally:
        d.stop()
        watch.close()
        broker.stop()


def test_commands_and_bad_commands(tiny_model_dir, tmp_path, broker) -> None:
    watch = Observer(broker)
    d = agent(tmp_path, tiny_model_dir, broker, "dev-cmd")
    try:
        watch.state("dev-cmd", State.ONLINE)
        opts = options(broker)
        pong = send(opts, PREFIX, "dev-cmd", "ping", {}, b"", 10)
        assert pong.code == fpb.CommandResponse.OK and pong.pong.session >= 1
        status = send(opts, PREFIX, "dev-cmd", "status", {}, b"", 10)
        assert status.status.model.quantization == "int8"
        assert status.status.device_id == "dev-cmd"
        d.config.write_text(FAST + '[model]\nquantization = "fp32"\n')
        reload = send(opts, PREFIX, "dev-cmd", "reload", {}, b"", 60)
        assert reload.code == fpb.CommandResponse.OK and "fp32" in reload.reload.model
        unknown = send(opts, PREFIX, "dev-cmd", "format-disk", {}, b"", 10)
        assert unknown.code == fpb.CommandResponse.NOT_FOUND and "ping" in unknown.message
        # raw payloads: garbage and oversized, answered on the MQTT 5 response topic
        for payload, code in [
            (b"\xff\x00garbage", fpb.CommandResponse.INVALID_ARGUMENT),
            (b"\x12" + b"\x80" * 4000, fpb.CommandResponse.RESOURCE_EXHAUSTED),
        ]:
            response = raw_request(broker, "dev-cmd", "ping", payload)
            assert response.code == code, response
        assert send(opts, PREFIX, "dev-cmd", "ping", {}, b"", 10).code == fpb.CommandResponse.OK
        assert d.client().health() == "SERVING"
    finally:
        assert d.stop() == 0, d.read_log()
        watch.close()


def raw_request(
    broker: Mosquitto, device: str, name: str, payload: bytes, content: str | None = None
) -> fpb.CommandResponse:
    """Publish `payload` as a command (MQTT 5 response topic + correlation, and `content` as
    its Content-Type if given) and wait for the answer, in whichever encoding it comes."""
    topics = Topics(PREFIX, device)
    got: list[fpb.CommandResponse] = []
    ready = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="raw-req", protocol=mqtt.MQTTv5)
    c.on_subscribe = lambda *_: ready.set()

    def on_message(_c, _u, m: mqtt.MQTTMessage) -> None:  # type: ignore[no-untyped-def]
        ct = codec.parse_content_type(getattr(m.properties, "ContentType", ""))
        got.append(codec.decode(fpb.CommandResponse, bytes(m.payload), ct))

    c.on_message = on_message
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    try:
        c.subscribe(topics.response("raw-req"), qos=1)
        assert ready.wait(60)
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = topics.response("raw-req")
        props.CorrelationData = b"corr-1"
        if content is not None:
            props.ContentType = content
        c.publish(topics.command(name), payload, qos=1, properties=props)
        deadline = time.monotonic() + 60  # a limit: the answer comes in milliseconds
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got, "no response"
        return got[0]
    finally:
        c.loop_stop()
        c.disconnect()


def test_mqtt_311_broker_mode(tiny_model_dir, tmp_path, broker) -> None:
    watch = Observer(broker)
    d = agent(tmp_path, tiny_model_dir, broker, "dev-311", FAST + 'protocol = "3.1.1"\n')
    try:
        watch.state("dev-311", State.ONLINE)
        pong = send(options(broker, protocol="3.1.1"), PREFIX, "dev-311", "ping", {}, b"", 10)
        assert pong.code == fpb.CommandResponse.OK
    finally:
        assert d.stop() == 0, d.read_log()
        watch.close()


def test_username_and_password_file(tiny_model_dir, tmp_path) -> None:
    broker = Mosquitto(tmp_path / "pw-broker", users={"dev-pw": "s3cret", "watcher": "w"})
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    config = FAST + f'username = "dev-pw"\npassword_file = "{secret}"\n'
    d = agent(tmp_path, tiny_model_dir, broker, "dev-pw", config)
    try:
        watch = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pw-watch", protocol=mqtt.MQTTv5)
        watch.username_pw_set("watcher", "w")
        got = threading.Event()
        watch.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/dev-pw/state", qos=1)
        watch.on_message = lambda *_: got.set()
        watch.connect("127.0.0.1", broker.port)
        watch.loop_start()
        assert got.wait(30), d.read_log()  # the agent logged in: its retained birth is there
        watch.loop_stop()
        watch.disconnect()
    finally:
        assert d.stop() == 0, d.read_log()
        broker.stop()
    assert "dev-pw" in broker.read_log() and "s3cret" not in d.read_log()


def test_device_id_defaults_to_the_machine_id(tmp_path) -> None:
    from agent.base.errors import ConfigError
    from agent.config.file import FleetConfig
    from agent.fleet.device.agent import resolve_device_id

    machine_id = tmp_path / "machine-id"
    machine_id.write_text("4c4c4544004a3510804cb4c04f4e3332\n")
    assert resolve_device_id(FleetConfig(), machine_id) == "4c4c4544004a3510804cb4c04f4e3332"
    assert resolve_device_id(FleetConfig(device_id="dev-9"), machine_id) == "dev-9"
    with pytest.raises(ConfigError, match=r"fleet\.device_id"):
        resolve_device_id(FleetConfig(), tmp_path / "absent")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), ["dev-tls", "dev-other", OPERATOR])


def test_mutual_tls_and_a_device_cannot_touch_another_devices_topics(
    tiny_model_dir, tmp_path, pki
) -> None:
    broker = Mosquitto(tmp_path / "tls-broker", pki=pki)
    config = FAST + (
        f'ca_file = "{pki.ca}"\ncert_file = "{pki.cert("dev-tls")}"\n'
        f'key_file = "{pki.key("dev-tls")}"\n'
    )
    watch = Observer(broker, "tls-observer")
    d = agent(tmp_path, tiny_model_dir, broker, "dev-tls", config)
    try:
        assert broker.url.startswith("mqtts://")
        watch.state("dev-tls", State.ONLINE)
        assert send(options(broker), PREFIX, "dev-tls", "ping", {}, b"", 10).code == 0
        # dev-other, with its own valid certificate, tries to command and impersonate dev-tls
        other = options(broker, who="dev-other")
        with pytest.raises(FleetError):
            send(other, PREFIX, "dev-tls", "ping", {}, b"", 3)
        refused = publish_as(pki, broker, "dev-other", Topics(PREFIX, "dev-tls").state)
        assert refused is not None and refused.is_failure
        assert "command ping received" in d.read_log()
        assert d.read_log().count("command ping received") == 1
        # and the state the operator sees is still dev-tls's own
        late = Observer(broker, "tls-late")
        seen = late.wait(lambda s: s.topic == Topics(PREFIX, "dev-tls").state)
        assert State.FromString(seen.payload).state == State.ONLINE
        late.close()
    finally:
        assert d.stop() == 0, d.read_log()
        watch.close()
        broker.stop()


def publish_as(pki: Pki, broker: Mosquitto, who: str, topic: str):  # type: ignore[no-untyped-def]
    """Publish with QoS 1 as `who`; the PUBACK's reason code."""
    codes: list = []
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{who}-raw", protocol=mqtt.MQTTv5)
    c.tls_set(str(pki.ca), str(pki.cert(who)), str(pki.key(who)))
    c.on_publish = lambda _c, _u, _mid, rc, _p: codes.append(rc)
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    try:
        c.publish(topic, b"\x08\x03", qos=1, retain=True)
        deadline = time.monotonic() + 60  # a limit: the PUBACK comes in milliseconds
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
        return codes[0] if codes else None
    finally:
        c.loop_stop()
        c.disconnect()
