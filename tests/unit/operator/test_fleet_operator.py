"""The operator's side of the fleet link (`edge-agent fleet watch|send`) against a real mosquitto
on loopback: ~300 simulated devices' retained state and health, a simulated device answering
commands, the CLI's exit codes, and mutual TLS (docs/FLEET.md)."""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.base.errors import AgentError
from agent.cli.fleet.commands import add_fleet_parser
from agent.config.file import parse_broker
from agent.fleet.device.health import read_thermal
from agent.fleet.mqtt import MqttOptions, publish_properties, response_route
from agent.fleet.topics import Topics, parse
from agent.operator.client import send, watch
from agent.operator.digest import Presence
from agent.operator.link import FleetError
from agent.operator.render import render, to_json
from agent.operator.view import FleetView
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
from agent.pb.edge_agent.v1 import agent_pb2
from tests.support.broker import OPERATOR, Mosquitto, Pki, make_pki
from tests.support.paths import ROOT

PREFIX = "fleet/v1"
N = 300
MIB = 1 << 20
State = pb.DeviceState


# ----------------------------------------------------------------------------- simulated devices


def state(device: str, kind: int, session: int, ts: float) -> pb.DeviceState:
    return State(
        state=kind,
        session=session,
        device_id=device,
        agent_version="0.9.0",
        profile="raspberry-pi-5",
        model="tiny 1.0 int8",
        timestamp_unix=ts,
    )


def health(device: str, session: int, ts: float, **over: object) -> pb.Health:
    h = pb.Health(
        seq=7,
        session=session,
        device_id=device,
        timestamp_unix=ts,
        agent_state="serving",
        agent_version="0.9.0",
        profile="raspberry-pi-5",
        model=pb.ModelRef(name="tiny", version="1.0", quantization="int8"),
        accelerator="cpu",
        uptime_s=3600,
        memory=pb.Memory(rss_bytes=300 * MIB, budget_bytes=512 * MIB),
        requests=pb.Requests(
            total=1200,
            failed=0,
            ttft_ms=agent_pb2.Percentiles(p50=85.0, p95=140.0),
            decode_tok_s=agent_pb2.Percentiles(p50=12.5, p95=10.0),
        ),
        thermal=pb.Thermal(max_celsius=55.0, throttled_known=True),
        disk=pb.Disk(path="/var/lib/edge-agent", free_bytes=2 << 30, total_bytes=8 << 30),
    )
    for key, value in over.items():
        obj, _, field = key.rpartition("__")
        target = h
        for part in filter(None, obj.split("__")):
            target = getattr(target, part)
        setattr(target, field, value)
    return h


def fleet_messages(prefix: str, now: float) -> list[tuple[str, pb.DeviceState | pb.Health]]:
    """N devices: every 30th lost, throttled, failing, stale, offline; the rest healthy."""
    out: list[tuple[str, pb.DeviceState | pb.Health]] = []
    for i in range(N):
        dev = f"dev-{i:03d}"
        t = Topics(prefix, dev)
        kind = {0: State.LOST, 4: State.OFFLINE}.get(i % 30, State.ONLINE)
        over: dict[str, object] = {}
        if i % 30 == 1:
            over = {"thermal__throttled_now": True, "thermal__max_celsius": 83.0}
        elif i % 30 == 2:
            over = {"requests__failed": 3}
        h_ts = now - 3600 if i % 30 == 3 else now - 5
        out.append((t.state, state(dev, kind, 2, now - 7200)))
        out.append((t.health, health(dev, 2, h_ts, **over)))
    return out


class Publisher:
    """A plain MQTT 5 client (a stand-in for many devices) publishing retained, QoS 1."""

    def __init__(self, broker: Mosquitto, who: str | None = None) -> None:
        self.opts = options(broker, who=who or OPERATOR)
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"pub-{time.monotonic_ns()}", protocol=5
        )
        if broker.pki is not None and who is not None:
            pki = broker.pki
            self.client.tls_set(str(pki.ca), str(pki.cert(who)), str(pki.key(who)))
        self.client.max_inflight_messages_set(100)
        self.pending: list[mqtt.MQTTMessageInfo] = []
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()

    def publish(self, topic: str, payload: bytes, message_name: str | None) -> None:
        props = publish_properties(self.opts, message_name) if message_name else None
        info = self.client.publish(topic, payload, qos=1, retain=True, properties=props)
        self.pending.append(info)

    def messages(self, items: list[tuple[str, pb.DeviceState | pb.Health]]) -> None:
        for topic, msg in items:
            self.publish(topic, msg.SerializeToString(), msg.DESCRIPTOR.full_name)
        self.flush()

    def flush(self) -> None:
        for info in self.pending:
            info.wait_for_publish(10)
            assert info.is_published()
        self.pending.clear()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def options(broker: Mosquitto, who: str = OPERATOR, **over: object) -> MqttOptions:
    tls: dict[str, object] = {}
    if broker.pki is not None:
        pki = broker.pki
        tls = {"ca_file": pki.ca, "cert_file": pki.cert(who), "key_file": pki.key(who)}
    fields = {"broker": parse_broker("test", "broker", broker.url), **tls, **over}
    return MqttOptions(**fields)  # type: ignore[arg-type]


class Device:
    """A simulated device answering commands on its cmd topics (MQTT 5 client; for 3.1.1
    requesters the route is in the Command). It first sends a decoy with other correlation
    data, which the requester must ignore."""

    def __init__(
        self,
        broker: Mosquitto,
        device: str,
        decoy: bool = True,
        thermal: pb.Thermal | None = None,
    ) -> None:
        self.topics = Topics(PREFIX, device)
        self.decoy = decoy
        self.thermal = thermal
        self.received: list[str] = []
        self.ready = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=device, protocol=5)
        self.client.on_subscribe = lambda *_: self.ready.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker.port)
        self.client.subscribe(self.topics.commands, qos=1)
        self.client.loop_start()
        assert self.ready.wait(10)
        self.opts = options(broker)

    def _on_message(self, _c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        name = parse(PREFIX, msg.topic).name  # type: ignore[union-attr]
        self.received.append(name)
        cmd = pb.Command.FromString(msg.payload)
        topic, corr = response_route(msg)
        v5 = topic is not None
        if topic is None:  # an MQTT 3.1.1 requester: the route is in the payload
            topic, corr = cmd.reply_topic, cmd.correlation
        code = pb.CommandResponse.OK if name != "reload" else pb.CommandResponse.UNAVAILABLE
        resp = pb.CommandResponse(code=code, command=name)
        if name == "ping":
            resp.pong.session = 2
            resp.pong.timestamp_unix = time.time()
        elif name == "status":
            resp.status.CopyFrom(health(self.topics.device, 2, time.time()))
            if self.thermal is not None:
                resp.status.thermal.CopyFrom(self.thermal)
        else:
            resp.message = "a reload is already running"
        name_ = "edge_agent.fleet.v1.CommandResponse"
        if self.decoy and v5:
            wrong = pb.CommandResponse(code=pb.CommandResponse.INTERNAL, command=name)
            props = publish_properties(self.opts, name_, correlation=b"someone-else")
            self.client.publish(topic, wrong.SerializeToString(), qos=1, properties=props)
        props = publish_properties(self.opts, name_, correlation=corr or None)
        self.client.publish(topic, resp.SerializeToString(), qos=1, properties=props)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path_factory.mktemp("operator-broker"))
    yield b
    b.stop()


@pytest.fixture(scope="module")
def fleet(broker: Mosquitto) -> tuple[FleetView, float, float]:
    """The N devices published, then one `watch --once`: (view, publish s, watch s)."""
    now = time.time()
    t0 = time.monotonic()
    with Publisher(broker) as pub:
        pub.messages(fleet_messages(PREFIX, now))
    published = time.monotonic() - t0
    t0 = time.monotonic()
    view = watch(options(broker), PREFIX, once=True, settle_s=0.5, timeout_s=30)
    took = time.monotonic() - t0
    print(f"\n{N} devices: published in {published:.2f} s, watch --once took {took:.2f} s")
    return view, published, took


def cli(argv: list[str]) -> int:
    """Dispatch like agent.cli.main: `func` from set_defaults, AgentError -> exit 2."""
    parser = argparse.ArgumentParser(prog="edge-agent")
    add_fleet_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
        return rc
    except AgentError:
        return 2


# ----------------------------------------------------------------------------- watch


def test_watch_once_sees_every_device_with_its_fields(fleet) -> None:
    view, _, took = fleet
    assert len(view.devices) == N
    assert view.malformed == 0 and view.late_wills == 0
    assert took < 30  # generous: the measured number goes to docs/FLEET.md
    rows = {r.device_id: r for r in view.rows(time.time())}
    ok = rows["dev-005"]
    assert ok.presence is Presence.ONLINE and ok.session == 2 and not ok.issues
    assert ok.model == "tiny 1.0 int8" and ok.profile == "raspberry-pi-5"
    h = ok.device.health
    assert h is not None
    assert (h.rss_bytes, h.budget_bytes) == (300 * MIB, 512 * MIB)
    assert (h.ttft_p50_ms, h.decode_tok_s_p50) == (85.0, 12.5)
    assert (h.requests_total, h.requests_failed, h.max_celsius) == (1200, 0, 55.0)
    assert h.disk_free_bytes == 2 << 30 and h.update_phase == ""
    assert rows["dev-000"].presence is Presence.LOST
    assert rows["dev-001"].issues == ("throttled",)
    assert rows["dev-002"].issues == ("3 failed",)
    assert rows["dev-003"].stale and rows["dev-003"].issues[0].startswith("stale")
    assert rows["dev-004"].presence is Presence.OFFLINE
    assert sum(r.presence is Presence.LOST for r in rows.values()) == N // 30


def test_render_puts_problems_first_and_fits(fleet) -> None:
    view, _, _ = fleet
    now = time.time()
    text = render(view, now, width=140, max_rows=40)
    lines = text.split("\n")
    assert lines[0].startswith(f"{N} devices: 280 online, 10 offline, 10 lost · 10 stale")
    assert lines[1].split()[:3] == ["DEVICE", "STATE", "SESS"]
    body = lines[2:]
    assert len(body) == 40 and body[-1] == "… 261 more (1 with problems)"
    lost = [f"dev-{i:03d}" for i in range(0, N, 30)]
    assert [line.split()[0] for line in body[:10]] == lost
    assert all(line.split()[1] == "lost" for line in body[:10])
    problems = body[10:39]
    assert all(int(line.split()[0][4:]) % 30 in (1, 2, 3) for line in problems)
    assert [line.split()[0] for line in problems] == sorted(line.split()[0] for line in problems)
    for width in (200, 100, 60, 40):
        narrow = render(view, now, width=width, max_rows=40)
        assert max(len(line) for line in narrow.split("\n")) <= width, width
        assert "DEVICE" in narrow and "ISSUES" in narrow
    wide = render(view, now, width=200).split("\n")
    assert len(wide) == 2 + N
    assert "MODEL" in wide[1] and "tiny 1.0 int8" in wide[2]
    only = render(view, now, width=120, filter="dev-03").split("\n")
    assert only[0].startswith("filter 'dev-03': 10 devices") and len(only) == 12


def test_cli_watch_once_json(broker, fleet, empty_config, capsys) -> None:
    base = ["fleet", "watch", "--broker", broker.url, "--config", empty_config, "--once"]
    rc = cli([*base, "--json", "--settle", "0.3"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out)
    assert [d["device"] for d in doc] == [f"dev-{i:03d}" for i in range(N)]
    assert doc[0]["state"] == "lost" and doc[3]["stale"] is True
    assert doc[5]["health"]["rss_bytes"] == 300 * MIB and doc[5]["model"] == "tiny 1.0 int8"
    rc = cli([*base, "--filter", "dev-29", "--settle", "0.3"])
    assert rc == 0
    table = capsys.readouterr().out
    assert table.startswith("filter 'dev-29': 10 devices") and "dev-299" in table


def test_late_will_is_ignored_in_order_and_in_retained_copies(broker) -> None:
    view = FleetView("p")
    born = state("d1", State.ONLINE, 5, 100.0).SerializeToString()
    will = state("d1", State.LOST, 4, 50.0).SerializeToString()
    assert view.update("p/d1/state", born, 1.0)
    assert not view.update("p/d1/state", will, 2.0)
    assert view.late_wills == 1
    assert view.rows(200.0)[0].presence is Presence.ONLINE
    assert view.update("p/d1/state", state("d1", State.LOST, 5, 150).SerializeToString(), 3.0)
    assert view.rows(200.0)[0].presence is Presence.LOST

    # on the broker the late Will overwrote the retained birth; the health is of session 5
    prefix = "fleet/late"
    now = time.time()
    with Publisher(broker) as pub:
        pub.messages(
            [
                (Topics(prefix, "d1").state, state("d1", State.ONLINE, 5, now)),
                (Topics(prefix, "d1").state, state("d1", State.LOST, 4, now - 60)),
                (Topics(prefix, "d1").health, health("d1", 5, now)),
                (Topics(prefix, "d2").state, state("d2", State.LOST, 5, now)),
                (Topics(prefix, "d2").health, health("d2", 5, now - 10)),
            ]
        )
    seen = watch(options(broker), prefix, once=True, settle_s=0.3, timeout_s=10)
    rows = {r.device_id: r for r in seen.rows(time.time())}
    assert rows["d1"].presence is Presence.ONLINE and rows["d1"].late_will
    assert rows["d2"].presence is Presence.LOST
    assert "1 late will" in render(seen, time.time(), 120)


def test_view_reordered_health_and_cleared_topics() -> None:
    view = FleetView("p")
    view.update("p/d1/state", state("d1", State.ONLINE, 3, 100.0).SerializeToString(), 1.0)
    assert view.update("p/d1/health", health("d1", 3, 110.0, seq=8).SerializeToString(), 2.0)
    assert not view.update("p/d1/health", health("d1", 3, 105.0, seq=7).SerializeToString(), 3.0)
    assert view.out_of_order == 1 and view.devices["d1"].health.seq == 8  # type: ignore[union-attr]
    # a new process (session 4) starts its seq again
    assert view.update("p/d1/health", health("d1", 4, 120.0, seq=1).SerializeToString(), 4.0)
    # an operator clearing a decommissioned device's retained topics removes its row
    assert view.update("p/d1/state", b"", 5.0) and "d1" in view.devices
    assert view.rows(130.0)[0].presence is Presence.UNKNOWN
    assert view.update("p/d1/health", b"", 6.0) and "d1" not in view.devices
    assert "0 devices" in render(view, 130.0, 80) and "(no devices)" in render(view, 130.0, 80)
    # update phases: a failed one is an issue, a download shows its progress
    h = health("d2", 1, 100.0, last_update__phase=pb.UpdateStatus.REJECTED)
    h.last_update.reason_code, h.last_update.to_version = "expired", "1.1"
    view.update("p/d2/health", h.SerializeToString(), 1.0)
    h = health("d3", 1, 100.0, last_update__phase=pb.UpdateStatus.DOWNLOADING)
    h.last_update.downloaded_bytes, h.last_update.total_bytes = 45, 100
    h.last_update.to_version = "1.1"
    view.update("p/d3/health", h.SerializeToString(), 1.0)
    rows = {r.device_id: r for r in view.rows(110.0)}
    assert rows["d2"].issues == ("update rejected (expired)",) and not rows["d3"].issues
    table = render(view, 110.0, 200)
    assert "rejected 1.1" in table and "downloading 1.1 45%" in table


def test_malformed_payloads_are_counted_not_fatal(broker) -> None:
    prefix = "fleet/bad"
    t = Topics(prefix, "good")
    now = time.time()
    with Publisher(broker) as pub:
        pub.messages(
            [(t.state, state("good", State.ONLINE, 1, now)), (t.health, health("good", 1, now))]
        )
        pub.publish(f"{prefix}/junk/state", b"\xff\xff not protobuf", None)
        pub.publish(f"{prefix}/other/health", health("someone", 1, now).SerializeToString(), None)
        wrong = state("typed", State.ONLINE, 1, now).SerializeToString()
        pub.publish(f"{prefix}/typed/health", wrong, "edge_agent.fleet.v1.DeviceState")
        pub.publish(f"{prefix}/kind/state", State(session=1).SerializeToString(), None)
        pub.flush()
    view = watch(options(broker), prefix, once=True, settle_s=0.3, timeout_s=10)
    assert list(view.devices) == ["good"]
    assert view.malformed == 4, view.last_malformed
    assert "ignored 4 malformed" in render(view, time.time(), 120).split("\n")[0]
    # and the pure model survives anything
    for payload in (b"\x00", b"\x0a\xff", bytes(range(256)), b"\x08" * 3):
        view.update(f"{prefix}/x/health", payload, 0.0)
    assert view.malformed >= 6


def _until_drawn(out: io.StringIO, text: str, timeout: float = 60.0) -> None:
    """Until the watch's last frame shows `text` (the watch draws its first frame once it
    has connected and subscribed); `timeout` only a limit."""
    deadline = time.monotonic() + timeout
    while text not in out.getvalue().rsplit("\x1b[H", 1)[-1]:
        assert time.monotonic() < deadline, out.getvalue()[-2000:]
        time.sleep(0.05)


def test_live_watch_redraws_at_most_twice_a_second(broker) -> None:
    prefix = "fleet/live"
    out = io.StringIO()
    stop = threading.Event()
    result: list[FleetView] = []
    runner = threading.Thread(
        target=lambda: result.append(
            watch(
                options(broker),
                prefix,
                once=False,
                out=out,
                size=lambda: (100, 20),
                stop=stop,
                screen=True,
            )
        )
    )
    t0 = time.monotonic()
    runner.start()
    try:
        _until_drawn(out, "edge-agent fleet watch · ")  # subscribed: the burst arrives live
        with Publisher(broker) as pub:
            for i in range(20):  # a burst of changes: still at most 2 frames a second
                now = time.time()
                pub.messages([(Topics(prefix, "d1").health, health("d1", 1, now, seq=i))])
            pub.messages([(Topics(prefix, "d1").state, state("d1", State.ONLINE, 1, time.time()))])
        _until_drawn(out, "1 device: 1 online")
    finally:
        stop.set()
        runner.join(10)
    took = time.monotonic() - t0
    text = out.getvalue()
    frames = text.count("\x1b[H") - 1  # the first one clears the screen
    # a frame per 0.5 s at most, however long this took (a slow machine draws fewer, never
    # more); one per change of the burst would be 20 or more
    assert 1 <= frames <= 2 * took + 3, (frames, took)
    last = text.rsplit("\x1b[H", 1)[1]
    assert "1 device: 1 online" in last and "d1" in last and "Ctrl-C" in last
    assert all(len(line) <= 100 for line in last.replace("\x1b[K", "").split("\n"))
    assert result and "d1" in result[0].devices


def test_live_watch_reconnects_after_a_broker_restart(tmp_path: Path) -> None:
    own = Mosquitto(tmp_path)
    out = io.StringIO()
    stop = threading.Event()
    size = lambda: (100, 20)  # noqa: E731
    runner = threading.Thread(
        target=watch,
        args=(options(own), PREFIX),
        kwargs=dict(once=False, out=out, size=size, stop=stop, screen=True),
    )
    runner.start()
    try:
        _until_drawn(out, "edge-agent fleet watch · ")  # connected before the restart
        own.restart(down_s=0.5)
        with Publisher(own) as pub:
            pub.messages(
                [(Topics(PREFIX, "after").state, state("after", State.ONLINE, 1, time.time()))]
            )
        _until_drawn(out, "after ")
    finally:
        stop.set()
        runner.join(10)
        own.stop()
    text = out.getvalue()
    assert "DISCONNECTED: lost the connection to " + own.url in text
    last = text.rsplit("\x1b[H", 1)[1]
    assert last.startswith("edge-agent fleet watch · ") and "after" in last


# ----------------------------------------------------------------------------- send


def test_send_to_a_missing_device_times_out_clearly(broker) -> None:
    t0 = time.monotonic()
    with pytest.raises(FleetError) as err:
        send(options(broker), PREFIX, "dev-nowhere", "ping", timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "device dev-nowhere did not answer ping within 1 s; is it online?" in msg
    assert "no state was ever published" in msg
    # a lost device: the message says what the broker last heard
    with pytest.raises(FleetError, match="retained state: lost, session 2"):
        send(options(broker), PREFIX, "dev-000", "status", timeout_s=0.5)


def test_send_gets_the_matching_answer_mqtt5_and_311(broker) -> None:
    dev = Device(broker, "dev-cmd")
    try:
        resp = send(options(broker), PREFIX, "dev-cmd", "ping", {"k": "v"}, b"", 60)
        assert resp.code == pb.CommandResponse.OK and resp.pong.session == 2
        resp = send(options(broker, protocol="3.1.1"), PREFIX, "dev-cmd", "status", timeout_s=60)
        assert resp.code == pb.CommandResponse.OK and resp.status.model.name == "tiny"
        assert dev.received == ["ping", "status"]
    finally:
        dev.close()


def test_cli_send_exit_codes(broker, empty_config, capsys) -> None:
    dev = Device(broker, "dev-cli", decoy=False)
    base = ["--broker", broker.url, "--config", empty_config, "--timeout", "5"]
    try:
        assert cli(["fleet", "send", "dev-cli", "ping", *base]) == 0
        assert "dev-cli ping: OK" in capsys.readouterr().out
        assert cli(["fleet", "send", "dev-cli", "status", "--json", *base]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["code"] == "OK" and doc["status"]["memory"]["rss_bytes"] == str(300 * MIB)
        assert cli(["fleet", "send", "dev-cli", "reload", *base]) == 1
        assert "UNAVAILABLE: a reload is already running" in capsys.readouterr().out
    finally:
        dev.close()
    quick = ["--broker", broker.url, "--config", empty_config, "--timeout", "0.5"]
    assert cli(["fleet", "send", "dev-gone", "ping", *quick]) == 1
    assert "did not answer ping within 0.5 s" in capsys.readouterr().err
    assert cli(["fleet", "send", "dev-cli", "ping", "--arg", "novalue", *quick]) == 2
    assert cli(["fleet", "send", "bad/id", "ping", *quick]) == 2


def _sysfs(root: Path, zones: dict[str, str]) -> Path:
    """A /sys with these thermal zones (type -> temp in millidegrees), as the kernel lays it out."""
    for i, (kind, temp) in enumerate(zones.items()):
        zone = root / "class" / "thermal" / f"thermal_zone{i}"
        zone.mkdir(parents=True)
        (zone / "type").write_text(kind + "\n")
        (zone / "temp").write_text(temp + "\n")
    root.mkdir(parents=True, exist_ok=True)
    return root


def test_cli_send_status_says_none_without_a_sensor(
    broker, empty_config, tmp_path: Path, capsys
) -> None:
    """A host without thermal zones reports no temperature: the summary says so, and a sensor
    that reads 0 degrees is still 0 C (the health message's zones tell the two apart)."""
    base = ["--broker", broker.url, "--config", empty_config, "--timeout", "5"]
    readings = {
        "none": read_thermal(_sysfs(tmp_path / "bare", {})),
        "0 C": read_thermal(_sysfs(tmp_path / "cold", {"cpu-thermal": "0"})),
        "-12 C": read_thermal(_sysfs(tmp_path / "arctic", {"cpu-thermal": "-12400"})),
    }
    assert not readings["none"].zones  # what health.py reads on a host without sensors
    for want, thermal in readings.items():
        dev = Device(broker, "dev-thermal", decoy=False, thermal=thermal)
        try:
            assert cli(["fleet", "send", "dev-thermal", "status", *base]) == 0
        finally:
            dev.close()
        lines = [x for x in capsys.readouterr().out.split("\n") if "temperature" in x]
        assert [x.strip() for x in lines] == [f"temperature {want}"], want


def test_watch_json_has_no_temperature_without_a_sensor(broker, tmp_path: Path) -> None:
    now = time.time()
    t = Topics(PREFIX, "dev-bare")
    h = health("dev-bare", 2, now)
    h.thermal.CopyFrom(read_thermal(_sysfs(tmp_path / "bare", {})))
    with Publisher(broker) as pub:
        pub.messages([(t.state, state("dev-bare", State.ONLINE, 2, now)), (t.health, h)])
    view = watch(options(broker), PREFIX, once=True, settle_s=0.3, timeout_s=10, filter="dev-bare")
    (row,) = to_json(view, time.time(), "dev-bare")
    assert row["health"]["max_celsius"] is None  # type: ignore[index]
    table = render(view, time.time(), width=200, filter="dev-bare").split("\n")
    at = table[1].index("TEMP")
    assert table[2][at : at + 6].strip() == "-"


def _agent_commands() -> set[str]:
    """The commands the device answers: the keys of FleetAgent._handlers, read from its source
    (agent/fleet/device/agent.py), not from the operator's code."""
    src = ROOT / "agent" / "fleet" / "device" / "agent.py"
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "_handlers":
            (ret,) = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            assert isinstance(ret.value, ast.Dict)
            return {k.value for k in ret.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("FleetAgent._handlers not found")


def test_send_help_and_fleet_md_name_every_command(capsys) -> None:
    commands = _agent_commands()
    assert {"ping", "status", "reload", "update"} <= commands
    with pytest.raises(SystemExit) as done:
        cli(["fleet", "send", "--help"])
    assert done.value.code == 0
    helptext = " ".join(capsys.readouterr().out.split())
    for name in commands:
        assert re.search(rf"\b{name}\b", helptext), name
    doc = (ROOT / "docs" / "FLEET.md").read_text()
    table = set(re.findall(r"^\| `([a-z_]+)` \| [^|]+ \| [^|]+ \|$", doc, re.M))
    assert commands <= table, commands - table


def test_no_broker_anywhere_is_a_usage_error(empty_config, capsys) -> None:
    assert cli(["fleet", "watch", "--once", "--config", empty_config]) == 2
    assert "no MQTT broker: give --broker" in capsys.readouterr().err
    assert cli(["fleet", "send", "d", "ping", "--config", empty_config]) == 2
    assert cli(["fleet", "watch", "--broker", "http://x", "--config", empty_config]) == 2


def test_unreachable_broker_is_a_clear_error(capsys, empty_config) -> None:
    from tests.support.broker import free_port

    url = f"mqtt://127.0.0.1:{free_port()}"
    with pytest.raises(FleetError, match=f"cannot connect to {url}"):
        watch(options_for(url), PREFIX, once=True, timeout_s=2)
    assert cli(["fleet", "watch", "--once", "--broker", url, "--config", empty_config]) == 1
    assert f"cannot connect to {url}" in capsys.readouterr().err


def options_for(url: str, **over: object) -> MqttOptions:
    return MqttOptions(broker=parse_broker("test", "broker", url), **over)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("op-pki"), ["dev-1", OPERATOR])


def test_tls_operator_watch_and_a_bad_ca(tmp_path: Path, pki: Pki, empty_config, capsys) -> None:
    broker = Mosquitto(tmp_path / "tls", pki=pki)
    try:
        now = time.time()
        with Publisher(broker, who="dev-1") as pub:  # the device's own certificate and ACL
            t = Topics(PREFIX, "dev-1")
            pub.messages(
                [
                    (t.state, state("dev-1", State.ONLINE, 3, now)),
                    (t.health, health("dev-1", 3, now)),
                ]
            )
        view = watch(options(broker), PREFIX, once=True, settle_s=0.3, timeout_s=10)
        assert list(view.devices) == ["dev-1"]
        assert to_json(view, time.time())[0]["state"] == "online"
        tls = ["--ca-file", str(pki.ca), "--cert-file", str(pki.cert(OPERATOR))]
        tls += ["--key-file", str(pki.key(OPERATOR)), "--config", empty_config]
        assert cli(["fleet", "watch", "--broker", broker.url, "--once", "--json", *tls]) == 0
        assert json.loads(capsys.readouterr().out)[0]["device"] == "dev-1"

        other = make_pki(tmp_path / "other-pki", [OPERATOR])
        with pytest.raises(FleetError) as err:
            watch(options(broker, ca_file=other.ca), PREFIX, once=True, timeout_s=5)
        msg = str(err.value)
        assert msg.startswith(f"cannot connect to {broker.url}: TLS:")
        assert "certificate" in msg and "--ca-file" in msg
        # no client certificate: the broker refuses the handshake
        with pytest.raises(FleetError, match="may not accept our client certificate") as err:
            watch(options(broker, cert_file=None, key_file=None), PREFIX, once=True, timeout_s=5)
        assert str(err.value).startswith(f"cannot connect to {broker.url}: ")
    finally:
        broker.stop()


def test_live_watch_into_a_pipe_writes_no_cursor_codes(broker) -> None:
    """`edge-agent fleet watch | tee log`: plain tables, a new one only when something changed."""
    import os
    import signal
    import subprocess
    import sys

    prefix = "fleet/pipe"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "fleet", "watch", "--broker", broker.url,
         "--prefix", prefix],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "COLUMNS": "100", "LINES": "20"},
    )  # fmt: skip
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        seen.append(proc.stdout.readline())  # the first table's title: it is subscribed
        with Publisher(broker) as pub:
            pub.messages([(Topics(prefix, "p1").state, state("p1", State.ONLINE, 1, time.time()))])
        while "1 device: 1 online" not in seen[-1]:
            line = proc.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    text = "".join(seen) + rest
    assert "\x1b" not in text, repr(text[:400])
    assert text.startswith("edge-agent fleet watch · ")
    assert "Traceback" not in err
