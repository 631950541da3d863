"""`edge-agent fleet publish-update` as an operator runs it (a real process, a real mosquitto on
loopback): a bad bundle is one line and exit 2 before anything is sent; every status a device
reports is printed once, with its reason code; `--json` prints one object per line.

The devices are MQTT clients that answer the `update` command the way agent/fleet/device/agent.py
does
(the accepted or rejected UpdateStatus in the response, and the same status again as an Event on
update/status, as the updater reports every transition), then report the phases of an update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from paho.mqtt.enums import CallbackAPIVersion

from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions, publish_properties, response_route
from agent.fleet.topics import Topics, parse
from agent.ota.artifact.bundle import write_bundle
from agent.ota.artifact.signing import sign
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.broker import Mosquitto
from tests.support.paths import ROOT

PREFIX = "fleet/v1"
U = pb.UpdateStatus
Code = pb.CommandResponse


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path_factory.mktemp("publish-broker"))
    yield b
    b.stop()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text("")
    return path


class UpdateDevice:
    """Answers `update` with `first` (RECEIVED: OK, else INVALID_ARGUMENT), publishes the same
    status on update/status, then each of `later`; `sent` is every distinct status, in order."""

    def __init__(self, broker: Mosquitto, device: str, first: U, later: list[U]) -> None:
        self.topics = Topics(PREFIX, device)
        self.first, self.later = first, later
        self.sent: list[U] = []
        self.commands: list[str] = []
        ready = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=device, protocol=5)
        self.client.on_subscribe = lambda *_: ready.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker.port)
        self.client.subscribe(self.topics.commands, qos=1)
        self.client.loop_start()
        assert ready.wait(10)
        self.opts = MqttOptions(broker=parse_broker("test", "broker", broker.url))

    def _on_message(self, _c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        name = parse(PREFIX, msg.topic).name  # type: ignore[union-attr]
        self.commands.append(name)
        cmd = pb.Command.FromString(msg.payload)
        topic, corr = response_route(msg)
        update_id = opb.Manifest.FromString(opb.SignedManifest.FromString(cmd.body).manifest)
        statuses = [self.first, *self.later]
        for st in statuses:
            st.update_id = update_id.update_id
        ok = self.first.phase == U.RECEIVED
        resp = Code(code=Code.OK if ok else Code.INVALID_ARGUMENT, command=name)
        resp.message = self.first.message
        resp.update.CopyFrom(self.first)
        props = publish_properties(
            self.opts, "edge_agent.fleet.v1.CommandResponse", correlation=corr or None
        )
        self.client.publish(topic, resp.SerializeToString(), qos=1, properties=props)
        ev_props = publish_properties(self.opts, "edge_agent.fleet.v1.Event")
        for st in statuses:  # the first one again, as the updater's report of the transition
            event = pb.Event(update=st)
            self.client.publish(
                self.topics.update_status, event.SerializeToString(), qos=1, properties=ev_props
            )
            self.sent.append(st)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _status(phase: int, message: str = "", reason: str = "", got: int = 0, total: int = 0) -> U:
    return U(
        phase=phase,  # type: ignore[arg-type]
        message=message,
        reason_code=reason,
        from_version="1.0.0",
        to_version="1.0.1",
        timestamp_unix=time.time(),
        downloaded_bytes=got,
        total_bytes=total,
    )


def _committing() -> tuple[U, list[U]]:
    return _status(U.RECEIVED, "manifest verified"), [
        _status(U.DOWNLOADING, "4096 of 8192 bytes", got=4096, total=8192),
        _status(U.DOWNLOADING, "8192 of 8192 bytes", got=8192, total=8192),
        _status(U.VERIFIED, "payload sha256 ok"),
        _status(U.STAGED, "model directory rebuilt"),
        _status(U.ACTIVATING, "loading beside the serving model"),
        _status(U.TRIAL, "serving the new model"),
        _status(U.COMMITTED, "trial passed"),
    ]


def _rejecting() -> tuple[U, list[U]]:
    msg = "version 2 is not newer than the installed version 3"
    return _status(U.REJECTED, msg, reason="rollback"), []


def _bundle(path: Path, manifest_bytes: bytes | None = None) -> Path:
    """A signed bundle (the devices here do not check it); with `manifest_bytes`, a bundle whose
    SignedManifest carries those bytes as its manifest."""
    payload = path.with_name("payload.bin")
    payload.write_bytes(b"\x01" * 8192)
    m = opb.Manifest(
        format_version=1,
        update_id="u-publish-1",
        model_name="tiny",
        version=2,
        payload_size=8192,
        payload_format="ea-delta-1",
        payload_url="https://updates.example/u-publish-1.bin",
        issued_unix=time.time(),
        expires_unix=time.time() + 3600,
    )
    signed = sign(m, [Ed25519PrivateKey.generate()])
    if manifest_bytes is not None:
        signed.manifest = manifest_bytes
    write_bundle(signed, payload, path)
    return path


def edge_agent(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "agent", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _publish(broker: Mosquitto, config: Path, bundle: Path, *extra: str) -> list[str]:
    return [
        "fleet",
        "publish-update",
        str(bundle),
        "--broker",
        broker.url,
        "--config",
        str(config),
        "--timeout",
        "30",
        *extra,
    ]


@pytest.mark.parametrize(
    ("name", "manifest_bytes"),
    [("garbled manifest", b"\xff\xff\xff\xff"), ("truncated manifest", b"\x0a\x40tiny")],
)
def test_a_bundle_whose_manifest_does_not_parse_is_one_line_and_exit_2(
    name: str, manifest_bytes: bytes, broker: Mosquitto, config: Path, tmp_path: Path
) -> None:
    bundle = _bundle(tmp_path / "bad.tar", manifest_bytes)
    dev = UpdateDevice(broker, "dev-bad", *_committing())
    try:
        done = edge_agent(*_publish(broker, config, bundle, "--device", "dev-bad"))
    finally:
        dev.close()
    assert done.returncode == 2, (name, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert str(bundle) in done.stderr and "manifest" in done.stderr
    assert dev.commands == []  # refused before anything was sent


def test_not_a_bundle_is_exit_2(broker: Mosquitto, config: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar" * 100)
    for path in (junk, tmp_path / "missing.tar"):
        done = edge_agent(*_publish(broker, config, path, "--all"))
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1 and str(path) in done.stderr


def test_each_status_is_printed_once_with_its_reason_code(
    broker: Mosquitto, config: Path, tmp_path: Path
) -> None:
    bundle = _bundle(tmp_path / "ok.tar")
    good = UpdateDevice(broker, "dev-good", *_committing())
    old = UpdateDevice(broker, "dev-old", *_rejecting())
    try:
        done = edge_agent(
            *_publish(broker, config, bundle, "--device", "dev-good", "--device", "dev-old")
        )
    finally:
        good.close()
        old.close()
    assert done.returncode == 1, done.stderr  # one device did not commit
    lines = done.stdout.strip().split("\n")
    for dev in (good, old):
        device = dev.topics.device
        mine = [line for line in lines if line.startswith(f"{device}: ")]
        distinct = list({st.SerializeToString(): st for st in dev.sent}.values())
        phases = [line.split()[1] for line in mine]
        assert phases == [U.Phase.Name(st.phase) for st in distinct], done.stdout
    (rejected,) = [line for line in lines if line.startswith("dev-old: ")]
    assert rejected == (
        "dev-old: REJECTED (rollback) version 2 is not newer than the installed version 3"
    )
    assert "dev-good: DOWNLOADING 4096/8192 B 4096 of 8192 bytes" in lines
    assert lines[-1] == "1 of 2 devices committed the update"


def test_json_is_one_object_per_status(broker: Mosquitto, config: Path, tmp_path: Path) -> None:
    bundle = _bundle(tmp_path / "ok.tar")
    good = UpdateDevice(broker, "dev-jgood", *_committing())
    old = UpdateDevice(broker, "dev-jold", *_rejecting())
    try:
        done = edge_agent(
            *_publish(
                broker, config, bundle, "--device", "dev-jgood", "--device", "dev-jold", "--json"
            )
        )
    finally:
        good.close()
        old.close()
    assert done.returncode == 1, done.stderr
    docs = [json.loads(line) for line in done.stdout.strip().split("\n")]
    *statuses, summary = docs
    for dev in (good, old):
        device = dev.topics.device
        mine = [d for d in statuses if d["device"] == device]
        distinct = list({st.SerializeToString(): st for st in dev.sent}.values())
        assert [d["phase"] for d in mine] == [U.Phase.Name(st.phase) for st in distinct]
        for d, st in zip(mine, distinct, strict=True):
            assert d["update_id"] == "u-publish-1"
            assert d["reason_code"] == st.reason_code and d["message"] == st.message
            assert int(d["downloaded_bytes"]) == st.downloaded_bytes
    assert summary == {
        "summary": {
            "devices": 2,
            "committed": ["dev-jgood"],
            "last": {"dev-jgood": "COMMITTED", "dev-jold": "REJECTED"},
        }
    }


def test_send_update_shows_the_reason_code(broker: Mosquitto, config: Path, tmp_path: Path) -> None:
    """`fleet send DEVICE update --body-file manifest.pb` (the manifest from a bundle) prints
    the refusal's reason code as publish-update does."""
    import tarfile

    bundle = _bundle(tmp_path / "ok.tar")
    with tarfile.open(bundle) as tar:
        member = tar.extractfile("manifest.pb")
        assert member is not None
        (tmp_path / "manifest.pb").write_bytes(member.read())
    old = UpdateDevice(broker, "dev-send-old", *_rejecting())
    try:
        done = edge_agent(
            "fleet", "send", "dev-send-old", "update", "--body-file", str(tmp_path / "manifest.pb"),
            "--broker", broker.url, "--config", str(config), "--timeout", "10",
        )  # fmt: skip
    finally:
        old.close()
    assert done.returncode == 1, done.stderr  # the device answered INVALID_ARGUMENT
    lines = done.stdout.strip().split("\n")
    assert lines[0].startswith("dev-send-old update: INVALID_ARGUMENT")
    assert lines[1] == "  update u-publish-1: REJECTED (rollback) 1.0.0 -> 1.0.1"
