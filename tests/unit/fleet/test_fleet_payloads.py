"""Payloads for stock tools (docs/FLEET.md "Payloads"): MQTT 5's Content-Type and Payload Format
Indicator on every topic, `[fleet] encoding = "json"`, receivers that read both encodings, and
`edge-agent fleet decode` — against real daemons (the tiny model) and a real mosquitto, with the
doc's own `mosquitto_sub` examples run as they are written."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.fleet import codec
from agent.fleet.topics import Topics, parse
from agent.model.directory import load_model_dir
from agent.operator.publish import read_offer
from agent.operator.view import FleetView
from agent.ota.artifact import keys
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.broker import Mosquitto
from tests.support.daemon_harness import Daemon
from tests.support.paths import ROOT
from tests.system.test_fleet_link import raw_request
from tests.system.test_updates import TRUSTED, Models, bundle, make_models

PREFIX = "fleet/v1"
DOC_DEVICE = "dev-7"  # the device the doc's examples name
LIMIT = 4096  # max_command_bytes of the agents here
FLEET_MD = ROOT / "docs" / "FLEET.md"
BIN = Path(sys.executable).parent
AGENT_TOPICS = ("state", "health", "event", "update/status", "update/block", "resp/<requester>")
OPERATOR_TOPICS = ("cmd/<name>", "update/data")


# ----------------------------------------------------------------------------- the doc


def payloads_section() -> str:
    text = FLEET_MD.read_text()
    start = text.index("\n## Payloads\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def doc_examples() -> list[str]:
    """Every command in the Payloads section's ```sh blocks."""
    blocks = re.findall(r"```sh\n(.*?)```", payloads_section(), re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def topic_key(parsed_kind: str, name: str) -> str:
    """A topic's row in TOPIC_TYPES."""
    if parsed_kind == "cmd":
        return "cmd/<name>"
    if parsed_kind == "resp":
        return "resp/<requester>"
    return f"update/{name}" if parsed_kind == "update" else parsed_kind


def key_of(topic: str) -> str:
    p = parse(PREFIX, topic)
    assert p is not None, topic
    return topic_key(p.kind, p.name)


def test_the_docs_topic_table_is_the_codes() -> None:
    rows = re.findall(r"^\| `([^`]+)` \| `(edge_agent\.[\w.]+)` \|$", payloads_section(), re.M)
    assert rows == [(t, cls.DESCRIPTOR.full_name) for t, cls in codec.TOPIC_TYPES]
    # every topic has an example that decodes it
    filters = {re.search(r"-t '([^']+)'", c).group(1) for c in doc_examples() if "decode" in c}  # type: ignore[union-attr]
    covered = {key_of(f.replace("+", "x", 1) if f.count("+") else f) for f in filters}
    assert covered == {t for t, _ in codec.TOPIC_TYPES}


# ----------------------------------------------------------------------------- codec (pure)


def samples() -> list[tuple[str, object]]:
    health = fpb.Health(seq=7, session=2, device_id="d", agent_state="serving", group="lab")
    health.model.sha256 = "ab" * 32
    health.memory.rss_bytes = 1 << 40  # a 64-bit integer: a string in JSON
    health.tags.extend(["a", "b"])
    return [
        ("state", fpb.DeviceState(device_id="d", state=fpb.DeviceState.LOST, session=3)),
        ("health", health),
        ("event", fpb.Event(seq=4, reload=fpb.ReloadDone(ok=True, model="m"))),
        ("update/status", fpb.Event(seq=5, update=fpb.UpdateStatus(update_id="u", phase=2))),
        ("update/block", opb.BlockRequest(update_id="u", offset=65536, length=65536)),
        ("update/data", opb.Block(update_id="u", offset=1, data=bytes(range(256)), total=9)),
        ("cmd/<name>", fpb.Command(args={"k": "v"}, body=b"\x00\xff", correlation=b"c")),
        ("resp/<requester>", fpb.CommandResponse(code=3, message="big", command="ping")),
    ]


def test_every_topics_message_round_trips_in_both_encodings() -> None:
    types = dict(codec.TOPIC_TYPES)
    for key, msg in samples():
        cls = types[key]
        assert isinstance(msg, cls)
        for enc in codec.ENCODINGS:
            data = codec.encode(msg, enc)
            ctype = codec.parse_content_type(codec.content_type(cls.DESCRIPTOR.full_name, enc))
            assert ctype.encoding == enc and ctype.message == cls.DESCRIPTOR.full_name
            assert codec.decode(cls, data, ctype) == msg  # by the content type
            assert codec.decode(cls, data) == msg  # by the sniff (MQTT 3.1.1)
            assert codec.sniff(data) == enc
        assert codec.format_indicator(codec.JSON) == 1 and codec.format_indicator("protobuf") == 0
    doc = json.loads(codec.encode(samples()[1][1], codec.JSON))
    assert doc["deviceId"] == "d" and doc["memory"]["rssBytes"] == str(1 << 40)
    assert doc["tags"] == ["a", "b"] and "requests" not in doc  # defaults left out


def test_a_one_mib_block_in_json_is_base64_and_reads_back() -> None:
    data = os.urandom(1 << 20)
    block = opb.Block(update_id="u", offset=0, data=data, total=len(data))
    text = codec.encode(block, codec.JSON)
    assert 1.33 * len(data) < len(text) < 1.34 * len(data) + 100
    assert base64.b64decode(json.loads(text)["data"]) == data
    assert codec.decode(opb.Block, text).data == data


@pytest.mark.parametrize(
    ("payload", "content", "why"),
    [
        (b'{"seq": "x"}', "application/json; type=edge_agent.fleet.v1.Health", "not a JSON"),
        (b'{"seq": 1', None, "not a JSON"),  # sniffed JSON, cut
        (b"[1, 2]", "application/json", "not a JSON"),
        (b'{"a":"\xff"}', None, "not UTF-8"),
        (b'{"seq":"1"}', "application/x-protobuf", "not a protobuf"),  # JSON under protobuf
        (fpb.Health(seq=1).SerializeToString(), "application/json", "not a JSON"),
        (b"\xff\xff\xff", None, "not a protobuf"),
        (b"\x08\x01", "application/x-protobuf; type=edge_agent.fleet.v1.Event", "names"),
        (b"\x08\x01", "text/plain", "neither protobuf nor JSON"),
    ],
)
def test_a_payload_is_never_misread(payload: bytes, content: str | None, why: str) -> None:
    ctype = codec.parse_content_type(content) if content else None
    with pytest.raises(codec.PayloadError, match=why):
        codec.decode(fpb.Health, payload, ctype)


def test_the_view_reads_json_and_counts_bad_json_as_malformed() -> None:
    view = FleetView(PREFIX)
    state = fpb.DeviceState(device_id="j1", state=fpb.DeviceState.ONLINE, session=1)
    state.timestamp_unix = time.time()
    json_ct = codec.parse_content_type(
        codec.content_type("edge_agent.fleet.v1.DeviceState", "json")
    )
    assert view.update(f"{PREFIX}/j1/state", codec.encode(state, "json"), 1.0, content=json_ct)
    assert view.update(f"{PREFIX}/j2/state", codec.encode(state, "json").replace(b"j1", b"j2"), 1.0)
    for payload in (b'{"state": "ONLINE"', b'{"session": "many"}', codec.encode(state)):
        assert not view.update(f"{PREFIX}/j3/state", payload, 1.0, content=json_ct)
    assert sorted(view.devices) == ["j1", "j2"] and view.malformed == 3, view.last_malformed


# ----------------------------------------------------------------------------- fleet decode


def cli(*argv: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_fleet_decode_reads_both_encodings_names_bad_lines_and_exits_1() -> None:
    state = fpb.DeviceState(device_id="d1", state=fpb.DeviceState.ONLINE, session=4)
    manifest = opb.Manifest(update_id="up-1", version=3)
    signed = opb.SignedManifest(manifest=manifest.SerializeToString())
    signed.signatures.add(key_id="k1", signature=b"s" * 64)
    update = fpb.Command(body=signed.SerializeToString())
    lines = [
        f"{PREFIX}/d1/state {codec.encode(state).hex()}",
        f"{PREFIX}/d1/state {codec.encode(state, 'json').hex().upper()}",  # %X
        f"{PREFIX}/d1/cmd/update {codec.encode(update, 'json').hex()}",
        "not/ours 0a00",
        f"{PREFIX}/d1/health zz",
        f"{PREFIX}/d1/health {b'{garbage'.hex()}",
        "",
        f"{PREFIX}/d1/health ",  # a cleared retained topic
    ]
    r = cli("fleet", "decode", stdin="\n".join(lines) + "\n")
    assert r.returncode == 1, r.stderr
    out = r.stdout.splitlines()
    assert len(out) == 4, r.stdout
    for line in out[:2]:
        topic, kind, doc = line.split(" ", 2)
        assert topic == f"{PREFIX}/d1/state" and kind == "edge_agent.fleet.v1.DeviceState"
        assert json.loads(doc) == {"deviceId": "d1", "state": "ONLINE", "session": "4"}
    topic, kind, doc = out[2].split(" ", 2)
    body = json.loads(doc)["body"]
    assert kind == "edge_agent.fleet.v1.Command"
    assert body["@type"] == "edge_agent.ota.v1.SignedManifest"
    assert body["manifest"] == {
        "@type": "edge_agent.ota.v1.Manifest",
        "updateId": "up-1",
        "version": "3",
    }
    assert body["signatures"][0]["keyId"] == "k1"
    assert out[3] == f"{PREFIX}/d1/health edge_agent.fleet.v1.Health null"
    err = r.stderr.splitlines()
    assert [e.split(":")[2].strip() for e in err] == ["line 4", "line 5", "line 6", "line 7"], err
    assert "not a fleet topic" in err[0] and "not hex" in err[1] and "not a JSON" in err[2]
    assert "Traceback" not in r.stderr
    # every line readable: 0; another prefix; a bad prefix is a usage error
    assert cli("fleet", "decode", stdin=lines[0] + "\n").returncode == 0
    moved = lines[0].replace(PREFIX, "site/a", 1) + "\n"
    assert cli("fleet", "decode", "--prefix", "site/a", stdin=moved).returncode == 0
    bad = cli("fleet", "decode", "--prefix", "fleet/#", stdin="")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "--prefix" in bad.stderr


# ----------------------------------------------------------------------------- real agents


@dataclass(frozen=True)
class Got:
    topic: str
    payload: bytes
    content_type: str | None
    indicator: int | None
    user_content_type: str | None


class Recorder:
    """A stock MQTT client recording every message under the prefix with its properties."""

    def __init__(self, broker: Mosquitto, protocol: int = mqtt.MQTTv5) -> None:
        self.got: list[Got] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"rec-{time.monotonic_ns()}", protocol=protocol
        )
        self.client.on_subscribe = lambda *_: self._ready.set()
        self.client.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/#", qos=1)
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        assert self._ready.wait(10)

    def _on_message(self, _c, _u, msg: mqtt.MQTTMessage) -> None:  # type: ignore[no-untyped-def]
        props = getattr(msg, "properties", None)
        users = dict(getattr(props, "UserProperty", None) or [])
        with self._lock:
            self.got.append(
                Got(
                    msg.topic,
                    bytes(msg.payload),
                    getattr(props, "ContentType", None),
                    getattr(props, "PayloadFormatIndicator", None),
                    users.get("content-type"),
                )
            )

    def by_key(self) -> dict[str, list[Got]]:
        out: dict[str, list[Got]] = {}
        with self._lock:
            for g in self.got:
                if g.payload:
                    out.setdefault(key_of(g.topic), []).append(g)
        return out

    def wait(self, pred, timeout: float = 30) -> Got:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for g in self.got:
                    if pred(g):
                        return g
            time.sleep(0.05)
        raise AssertionError(f"not seen; topics: {[g.topic for g in self.got][-20:]}")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def agent_config(trusted: Path, encoding: str, protocol: str = "5") -> str:
    return (
        '[model]\nquantization = "int8"\n'
        "[fleet]\nhealth_interval_s = 1\nhealth_min_interval_s = 0.2\n"
        f'max_command_bytes = {LIMIT}\nencoding = "{encoding}"\nprotocol = "{protocol}"\n'
        f'[updates]\ntrusted_keys_dir = "{trusted}"\ntrial_s = 1.0\n'
        "retry_s = 0.5\nprogress_interval_s = 0.2\n"
        'clock = "trusted"\n'  # this machine's clock may not say it is synchronized
    )


def start_agent(
    tmp: Path,
    models: Models,
    broker: Mosquitto,
    trusted: Path,
    device: str,
    encoding: str,
    protocol: str = "5",
) -> Daemon:
    tmp.mkdir(parents=True, exist_ok=True)
    rec = Recorder(broker)
    d = Daemon(
        tmp,
        models.base,
        agent_config(trusted, encoding, protocol),
        args=("--broker", broker.url, "--device-id", device),
    )
    try:
        rec.wait(lambda g: g.topic == Topics(PREFIX, device).state and g.payload, 60)
    except AssertionError:
        d.stop()
        raise AssertionError("no birth:\n" + d.read_log()) from None
    finally:
        rec.close()
    return d


def operator_config(tmp: Path, broker: Mosquitto, encoding: str, protocol: str = "5") -> Path:
    path = tmp / f"operator-{encoding}-{protocol}.toml"
    path.write_text(
        f'[fleet]\nbroker = "{broker.url}"\nencoding = "{encoding}"\nprotocol = "{protocol}"\n'
    )
    return path


@pytest.fixture(scope="module")
def update_models(tiny_model_dir, tmp_path_factory) -> Models:
    """The shipped model (1.0.0) and a fine-tune of it (1.1.0), as tests/system/test_updates.py
    has."""
    return make_models(tiny_model_dir, tmp_path_factory.mktemp("payload-models"))


@pytest.fixture(scope="module")
def trusted_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("payload-trusted")
    (d / "release.pub").write_text(keys.public_line(TRUSTED.public_key(), "release"))
    return d


@pytest.fixture(scope="module")
def update_bundle(update_models: Models, tmp_path_factory) -> Path:
    return bundle(update_models, tmp_path_factory.mktemp("payload-bundle"))


def example_env() -> dict[str, str]:
    missing = [t for t in ("mosquitto_sub",) if shutil.which(t) is None]
    assert not missing, "mosquitto-clients is not installed (scripts/test installs it)"
    assert (BIN / "edge-agent").exists(), f"no edge-agent console script in {BIN}"
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_doc_examples(
    broker: Mosquitto, device: str, op: Path, bundle_path: Path, encoding: str
) -> dict[str, str]:
    """Start every doc example at once (the device put in), then make each topic carry a
    message: a ping (cmd, resp), a reload (event) and an update over MQTT blocks
    (update/status, block, data; `fleet publish-update`, which must commit). Returns each
    example's output."""
    env = example_env()
    commands = [c for c in doc_examples() if "%p" not in c or encoding == codec.JSON]
    subscribed = broker.read_log().count("Received SUBSCRIBE from")
    procs = {
        c: subprocess.Popen(
            [
                "bash",
                "-o",
                "pipefail",
                "-c",
                c.replace("PORT", str(broker.port)).replace(DOC_DEVICE, device),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for c in commands
    }
    try:
        # every mosquitto_sub has subscribed: it says nothing when it has, the broker's log does
        subscribers = sum(1 for c in commands if "mosquitto_sub" in c)
        deadline = time.monotonic() + 60
        while broker.read_log().count("Received SUBSCRIBE from") < subscribed + subscribers:
            assert time.monotonic() < deadline, broker.read_log()[-3000:]
            time.sleep(0.05)
        for _ in range(3):
            for what in ("ping", "reload"):
                r = cli("fleet", "send", device, what, "--config", str(op), "--timeout", "60")
                assert r.returncode == 0, r.stdout + r.stderr
            if _ == 0:
                r = cli(
                    "fleet",
                    "publish-update",
                    str(bundle_path),
                    "--device",
                    device,
                    "--config",
                    str(op),
                    "--timeout",
                    "90",
                )
                assert r.returncode == 0, r.stdout + r.stderr
                assert "COMMITTED" in r.stdout
            deadline = time.monotonic() + 10
            while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            if all(p.poll() is not None for p in procs.values()):
                break
        out = {}
        for c, p in procs.items():
            stdout, stderr = p.communicate(timeout=5)
            assert p.returncode == 0, (c, stderr.decode(errors="replace"))
            out[c] = stdout.decode()
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def check_example_outputs(
    outputs: dict[str, str], device: str, encoding: str, models: Models, bundle_path: Path
) -> None:
    """Each decode example printed one line: its topic, the topic's type, right fields."""
    _, manifest, payload = read_offer(bundle_path)
    shas = {load_model_dir(m).variant("int8").sha256 for m in (models.base, models.new)}
    types = {t: cls.DESCRIPTOR.full_name for t, cls in codec.TOPIC_TYPES}
    seen = set()
    for command, text in outputs.items():
        print(f"$ {command}\n{text}", end="")  # shown when the test fails
        lines = text.splitlines()
        assert len(lines) == 1, (command, text)
        if "%F %C" in command:
            topic, indicator, ctype = lines[0].split(" ", 2)
            assert topic == Topics(PREFIX, device).health
            assert int(indicator) == codec.format_indicator(encoding)
            assert ctype == codec.content_type("edge_agent.fleet.v1.Health", encoding)
            continue
        if "%p" in command:
            assert json.loads(lines[0])["deviceId"] == device
            continue
        topic, kind, raw = lines[0].split(" ", 2)
        key = key_of(topic)
        assert parse(PREFIX, topic).device == device  # type: ignore[union-attr]
        assert kind == types[key], (command, lines[0])
        doc = json.loads(raw)
        seen.add(key)
        if key == "state":
            assert doc["deviceId"] == device and doc["state"] == "ONLINE"
            assert doc["modelSha256"] in shas
        elif key == "health":
            assert doc["deviceId"] == device and int(doc["seq"]) >= 1
            assert doc["model"]["sha256"] in shas and doc["agentState"]
        elif key == "event":
            assert doc["reload"]["ok"] is True and int(doc["seq"]) >= 1
        elif key == "cmd/<name>":
            assert topic.endswith("/cmd/ping") and doc == {}  # MQTT 5: the route is in properties
        elif key == "resp/<requester>":
            assert doc["command"] == "ping" and int(doc["pong"]["session"]) >= 1
        elif key == "update/status":
            assert doc["update"]["updateId"] == manifest.update_id and doc["update"]["phase"]
        elif key == "update/block":
            assert doc["updateId"] == manifest.update_id and int(doc["length"]) > 0
        elif key == "update/data":
            assert doc["updateId"] == manifest.update_id
            offset, data = int(doc.get("offset", "0")), base64.b64decode(doc["data"])
            with open(payload.path, "rb") as f:
                f.seek(payload.offset + offset)
                assert data == f.read(len(data)) and data
            assert int(doc["total"]) == payload.size
    assert seen == set(types), seen


def check_properties(
    rec: Recorder, agent_encoding: str, operator_encoding: str
) -> dict[str, list[Got]]:
    """Every message on every topic names its type and encoding in both content types and
    has the format indicator; it decodes as that type."""
    got = rec.by_key()
    assert set(got) == {t for t, _ in codec.TOPIC_TYPES}, sorted(got)
    classes = dict(codec.TOPIC_TYPES)
    for key, messages in got.items():
        enc = agent_encoding if key in AGENT_TOPICS else operator_encoding
        want = codec.content_type(classes[key].DESCRIPTOR.full_name, enc)
        for g in messages:
            assert (g.content_type, g.indicator, g.user_content_type) == (
                want,
                codec.format_indicator(enc),
                want,
            ), (g.topic, g)
            assert codec.sniff(g.payload) == enc
            codec.decode(classes[key], g.payload, codec.parse_content_type(g.content_type))
    return got


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path_factory.mktemp("payload-broker"))
    yield b
    b.stop()


@pytest.fixture(scope="module")
def json_agent(update_models, trusted_dir, broker, tmp_path_factory) -> Iterator[Daemon]:
    d = start_agent(
        tmp_path_factory.mktemp("json-agent"), update_models, broker, trusted_dir, "dev-j", "json"
    )
    yield d
    assert d.stop() == 0, d.read_log()


def test_a_json_agent_is_read_by_stock_tools_watched_sent_commands_and_updated(
    json_agent,
    update_models,
    broker,
    update_bundle,
    tmp_path,
) -> None:
    rec = Recorder(broker)
    capture = tmp_path / "capture.txt"
    env = example_env()
    with open(capture, "wb") as f:
        everything = subprocess.Popen(
            [
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                str(broker.port),
                "-V",
                "mqttv5",
                "-t",
                f"{PREFIX}/#",
                "-F",
                "%t %x",
            ],
            stdout=f,
            env=env,
        )
    try:
        op = operator_config(tmp_path, broker, "json")
        # the agent's health is on the broker (retained) before the watch reads it: the
        # birth comes first, and on a loaded machine the watch could run in between
        rec.wait(lambda g: g.topic == Topics(PREFIX, "dev-j").health and g.payload, 60)
        # watched and sent commands by the operator tools, in JSON both ways
        r = cli("fleet", "watch", "--json", "--config", str(op), "--settle", "0.5")
        assert r.returncode == 0, r.stderr
        (row,) = [x for x in json.loads(r.stdout) if x["device"] == "dev-j"]
        assert row["state"] == "online" and row["health"]["agent_state"] == "serving", row
        assert "malformed" not in r.stderr
        r = cli("fleet", "send", "dev-j", "status", "--config", str(op))
        assert r.returncode == 0 and "model " in r.stdout, r.stdout + r.stderr
        outputs = run_doc_examples(broker, "dev-j", op, update_bundle, codec.JSON)
        check_example_outputs(outputs, "dev-j", codec.JSON, update_models, update_bundle)
        assert json_agent.client().info()["version"] == "1.1.0"
        got = check_properties(rec, codec.JSON, codec.JSON)
        for messages in got.values():
            for g in messages:
                json.loads(g.payload)  # plain JSON for any tool
    finally:
        rec.close()
        everything.terminate()
        everything.wait(10)
    # `fleet decode` on the whole real capture: every line reads
    lines = capture.read_text().splitlines()
    assert len(lines) > 20
    r = cli("fleet", "decode", stdin="\n".join(lines) + "\n")
    assert r.returncode == 0 and not r.stderr, r.stderr[:2000]
    decoded = r.stdout.splitlines()
    assert len(decoded) == len(lines)
    types = {t: cls.DESCRIPTOR.full_name for t, cls in codec.TOPIC_TYPES}
    for line, raw in zip(decoded, lines, strict=True):
        topic, kind, _ = line.split(" ", 2)
        assert topic == raw.split(" ", 1)[0] and kind == types[key_of(topic)]


def test_malformed_payloads_in_each_encoding_are_answered_or_ignored(json_agent, broker) -> None:
    Code = fpb.CommandResponse
    json_ct = codec.content_type("edge_agent.fleet.v1.Command", "json")
    proto_ct = codec.content_type("edge_agent.fleet.v1.Command", "protobuf")
    valid = fpb.Command(args={"a": "b"}).SerializeToString()
    cases = [
        (b'{"args": 5}', json_ct, Code.INVALID_ARGUMENT, "not a JSON"),
        (b'{"args": {"a": "b"}', None, Code.INVALID_ARGUMENT, "not a JSON"),  # sniffed
        (valid, json_ct, Code.INVALID_ARGUMENT, "not a JSON"),  # protobuf under a JSON type
        (b'{"args": {}}', proto_ct, Code.INVALID_ARGUMENT, "not a protobuf"),
        (b"\xff\x00garbage", proto_ct, Code.INVALID_ARGUMENT, "not a protobuf"),
        (
            valid,
            "application/x-protobuf; type=edge_agent.fleet.v1.Health",
            Code.INVALID_ARGUMENT,
            "names edge_agent.fleet.v1.Health",
        ),
        (valid, "text/plain", Code.INVALID_ARGUMENT, "neither"),
        # max_command_bytes counts the command as protobuf, in either encoding
        (
            fpb.Command(body=b"x" * 5000).SerializeToString(),
            proto_ct,
            Code.RESOURCE_EXHAUSTED,
            "payload of",
        ),
        (
            codec.encode(fpb.Command(body=b"x" * 5000), "json"),
            json_ct,
            Code.RESOURCE_EXHAUSTED,
            "(as protobuf)",
        ),
        (
            codec.encode(fpb.Command(body=b"x" * 7000), "json"),
            json_ct,
            Code.RESOURCE_EXHAUSTED,
            "payload of",
        ),
        (codec.encode(fpb.Command(body=b"x" * 3500), "json"), json_ct, Code.OK, ""),  # > LIMIT
    ]
    for payload, content, code, why in cases:
        resp = raw_request(broker, "dev-j", "ping", payload, content)
        assert (resp.code, resp.command) == (code, "ping"), (payload[:40], content, resp)
        assert why in resp.message, resp.message
    assert len(cases[-1][0]) > LIMIT  # the OK one was over the limit as JSON
    # blocks nobody asked for, malformed in each encoding: ignored with one log line each
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bad-blocks", protocol=mqtt.MQTTv5)
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    try:
        for payload, ct in (
            (b"{nope", "application/json"),
            (b"\xff\xff", "application/x-protobuf"),
        ):
            props = Properties(PacketTypes.PUBLISH)
            props.ContentType = ct
            pub.publish(
                Topics(PREFIX, "dev-j").block_data, payload, qos=1, properties=props
            ).wait_for_publish(5)
    finally:
        pub.loop_stop()
        pub.disconnect()
    deadline = time.monotonic() + 60
    while json_agent.read_log().count("malformed update block ignored") < 2:
        assert time.monotonic() < deadline, json_agent.read_log()[-3000:]
        time.sleep(0.1)
    # and it keeps serving: commands and the local API
    assert raw_request(broker, "dev-j", "ping", b"{}", json_ct).code == Code.OK
    assert json_agent.client().health() == "SERVING"


def test_a_protobuf_agent_with_a_json_operator_every_topic_and_the_doc_examples(
    update_models,
    trusted_dir,
    update_bundle,
    tmp_path,
) -> None:
    broker = Mosquitto(tmp_path / "broker")
    d = None
    try:
        d = start_agent(tmp_path / "agent", update_models, broker, trusted_dir, "dev-p", "protobuf")
        rec = Recorder(broker)
        try:
            op = operator_config(tmp_path, broker, "json")  # commands and blocks in JSON
            outputs = run_doc_examples(broker, "dev-p", op, update_bundle, codec.PROTOBUF)
            check_example_outputs(outputs, "dev-p", codec.PROTOBUF, update_models, update_bundle)
            check_properties(rec, codec.PROTOBUF, codec.JSON)
            assert d.client().info()["version"] == "1.1.0"
            # the Last Will, set before connecting, carries the properties too
            d.proc.kill()
            lost = fpb.DeviceState.LOST
            will = rec.wait(
                lambda g: (
                    g.topic.endswith("/state")
                    and codec.decode(fpb.DeviceState, g.payload).state == lost
                )
            )
            ct = codec.content_type("edge_agent.fleet.v1.DeviceState", codec.PROTOBUF)
            assert (will.content_type, will.indicator, will.user_content_type) == (ct, 0, ct)
            assert codec.decode(fpb.DeviceState, will.payload).state == fpb.DeviceState.LOST
        finally:
            rec.close()
    finally:
        if d is not None:
            d.stop()
        broker.stop()


def test_mqtt_311_a_json_agent_and_a_protobuf_operator_read_each_other(
    update_models,
    trusted_dir,
    tmp_path,
) -> None:
    broker = Mosquitto(tmp_path / "broker")
    d = None
    rec = None
    try:
        d = start_agent(
            tmp_path / "agent", update_models, broker, trusted_dir, "dev-q", "json", "3.1.1"
        )
        rec = Recorder(broker, mqtt.MQTTv311)
        op = operator_config(tmp_path, broker, "protobuf", "3.1.1")
        r = cli("fleet", "send", "dev-q", "ping", "--config", str(op))
        assert r.returncode == 0 and "pong: session" in r.stdout, r.stdout + r.stderr
        r = cli("fleet", "send", "dev-q", "status", "--config", str(op), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["status"]["device_id"] == "dev-q"
        rec.wait(lambda g: g.topic == Topics(PREFIX, "dev-q").health and g.payload, 60)
        r = cli("fleet", "watch", "--json", "--config", str(op), "--settle", "0.5")
        (row,) = json.loads(r.stdout)
        assert row["device"] == "dev-q" and row["state"] == "online" and row["health"], row
        # garbage commands on 3.1.1 cannot carry a reply topic: logged, not answered
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bad-311", protocol=mqtt.MQTTv311)
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        garbage = (b"{bad json", b"\xff\xff")
        for payload in garbage:
            pub.publish(Topics(PREFIX, "dev-q").command("ping"), payload, qos=1).wait_for_publish(5)
        pub.loop_stop()
        pub.disconnect()
        r = cli("fleet", "send", "dev-q", "ping", "--config", str(op))
        assert r.returncode == 0, r.stdout + r.stderr
        got = rec.by_key()
        for key in ("state", "health", "resp/<requester>", "cmd/<name>"):
            assert got.get(key), sorted(got)
        for key, messages in got.items():
            want = codec.JSON if key in AGENT_TOPICS else codec.PROTOBUF
            for g in (m for m in messages if m.payload not in garbage):
                assert g.content_type is None and g.indicator is None  # 3.1.1: no properties
                assert codec.sniff(g.payload) == want, (key, g.payload[:40])
        assert d.read_log().count("without a response topic") >= 2
        assert d.client().health() == "SERVING"
        # the Will in JSON, sniffed (3.1.1: no properties)
        d.proc.kill()
        lost = b'"state":"LOST"'
        will = rec.wait(lambda g: g.topic.endswith("/dev-q/state") and lost in g.payload)
        assert codec.decode(fpb.DeviceState, will.payload).state == fpb.DeviceState.LOST
    finally:
        if rec is not None:
            rec.close()
        if d is not None:
            d.stop()
        broker.stop()
