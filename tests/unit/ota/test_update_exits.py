"""No failed update holds a device hostage (docs/UPDATES.md): a payload shorter than declared is
given up after `updates.max_download_attempts` attempts without progress (counted across
restarts); the operator's signed cancel stops the update in progress, and nothing else can; a
malformed trusted key is a configuration error with its own code, shown in health; an update
id is used once. A real daemon, a real mosquitto, a real HTTP server on loopback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from agent.fleet.topics import Topics
from agent.operator.client import send
from agent.ota.artifact.bundle import read_bundle
from agent.ota.artifact.cancel import sign_cancel
from agent.ota.store import Store
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.daemon_harness import Daemon
from tests.support.httpserver import PayloadServer, Served
from tests.system import test_updates
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import STRANGER, TRUSTED, Models, _signed, bundle, config, statuses

# the update tests' module fixtures: the tiny model and its fine-tune, the trusted key, mosquitto
models, trusted, broker = test_updates.models, test_updates.trusted, test_updates.broker

Phase = fpb.UpdateStatus
INVALID = fpb.CommandResponse.INVALID_ARGUMENT


def _daemon(tmp: Path, models: Models, broker, trusted: Path, device: str, **updates) -> Daemon:  # type: ignore[no-untyped-def]
    """A daemon whose [updates] table has `updates` on top of the update tests' settings,
    returned once it is online."""
    text = config(trusted)
    for key, value in updates.items():
        lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key} =")]
        text = "\n".join(lines) + f"\n{key} = {value}\n"
    return test_updates.start(tmp, models, broker, trusted, device, text=text)  # type: ignore[no-any-return]


def _short_server(models: Models, tmp: Path, version: int, short: int):  # type: ignore[no-untyped-def]
    served = Served(tmp / f"payload-{version}.bin", short=short)
    http = PayloadServer(served)
    path = bundle(models, tmp, payload_url=http.url, version=version)
    read_bundle(path)[1].extract(served.path)
    return served, http, path


def _wait(pred, timeout: float = 60, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _final(watch: Observer, device: str, update: Path | None = None) -> fpb.UpdateStatus | None:
    """The last final status of `device` (of the bundle `update`'s id, if given)."""
    final = (Phase.COMMITTED, Phase.ROLLED_BACK, Phase.REJECTED)
    uid = opb.Manifest.FromString(read_bundle(update)[0].manifest).update_id if update else None
    done = [s for s in statuses(watch, device) if s.phase in final]
    done = [s for s in done if uid is None or s.update_id == uid]
    return done[-1] if done else None


def test_a_short_payload_is_given_up_after_the_attempts_even_across_a_restart(
    models, trusted, broker, tmp_path
):
    served, http, path = _short_server(models, tmp_path, 2, short=100)
    device = "dev-short"
    watch = Observer(broker, "ota-short")
    d = _daemon(tmp_path, models, broker, trusted, device, max_download_attempts=3, retry_s=3)
    store = Store(tmp_path / "state")
    try:
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        # two attempts end short; the count is in the record when the daemon is stopped
        _wait(lambda: (r := store.record()) is not None and r.failed_attempts == 2, what="2")
        assert d.stop() == 0, d.read_log()
        assert len(served.requests) == 2, served.requests
        d = _daemon(tmp_path, models, broker, trusted, device, max_download_attempts=3, retry_s=3)
        _wait(lambda: _final(watch, device) is not None, what="no final status")
        final = _final(watch, device)
        assert final is not None and final.phase == Phase.REJECTED, final
        assert final.reason_code == "payload", final
        assert "3 download attempts" in final.message, final
        assert "max_download_attempts" in final.message, final
        assert len(served.requests) == 3, served.requests  # one more after the restart
        assert d.client().info()["version"] == "1.0.0"
        assert not list((tmp_path / "state" / "ota" / "payload").glob("*.part"))
        # the id is used up: the fixed payload under the same id is refused, and says why
        served.short = 0
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
        assert resp.update.reason_code == "replay", resp.update
        assert "new one" in resp.update.message and "update make" in resp.update.message
        # a re-issue with a new id is not blocked by anything the failed one left
        again = bundle(models, tmp_path, payload_url=http.url, version=2)
        read_bundle(again)[1].extract(served.path)
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(again), 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        _wait(lambda: _final(watch, device, again) is not None, what="no final status")
        assert _final(watch, device, again).phase == Phase.COMMITTED  # type: ignore[union-attr]
        assert d.client().info()["version"] == "1.1.0"
    finally:
        d.stop()
        http.close()
        watch.close()


def test_an_mqtt_block_download_nobody_serves_is_given_up(models, trusted, broker, tmp_path):
    """No URL and no `publish-update` answering block requests: every attempt fails the same
    way (no block within the timeout); the device does not wait for the manifest's expiry."""
    path = bundle(models, tmp_path, version=2)  # blocks over MQTT; only the manifest is sent
    device = "dev-noblocks"
    watch = Observer(broker, "ota-noblocks")
    d = _daemon(tmp_path, models, broker, trusted, device, max_download_attempts=2)
    try:
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        _wait(lambda: _final(watch, device) is not None, timeout=90, what="no final status")
        final = _final(watch, device)
        assert final is not None and final.phase == Phase.REJECTED, final
        assert final.reason_code == "payload" and "2 download attempts" in final.message, final
        assert "no block at offset 0" in final.message, final
        assert d.client().info()["version"] == "1.0.0"
    finally:
        d.stop()
        watch.close()


def test_a_signed_cancel_stops_a_stuck_download_and_nothing_else_does(
    models, trusted, broker, tmp_path
):
    served, http, path = _short_server(models, tmp_path, 2, short=100)
    device = "dev-cancel"
    watch = Observer(broker, "ota-cancel")
    d = _daemon(tmp_path, models, broker, trusted, device, max_download_attempts=10000)
    signed = read_bundle(path)[0]
    update_id = opb.Manifest.FromString(signed.manifest).update_id

    def cancel(body: bytes) -> fpb.CommandResponse:
        return send(options(broker), PREFIX, device, "cancel", {}, body, 60)

    try:
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        _wait(lambda: len(served.requests) >= 2, what="the download is not retrying")
        # refused, and the update goes on: not by a trusted key; a manifest's signature over
        # the manifest's bytes presented as a cancel; expired; another update's id
        forged = sign_cancel(update_id, [STRANGER]).SerializeToString()
        transplanted = opb.SignedCancel(cancel=signed.manifest, signatures=signed.signatures)
        old = sign_cancel(update_id, [TRUSTED], expires_in_s=60, now=time.time() - 3600)
        other = sign_cancel("some-other-update", [TRUSTED])
        refusals = {
            "unknown_key": forged,
            "bad_signature": transplanted.SerializeToString(),
            "expired": old.SerializeToString(),
            "not_in_progress": other.SerializeToString(),
            "malformed": b"\xff\xff not a SignedCancel",
        }
        for code, body in refusals.items():
            r = cancel(body)
            assert r.code == INVALID and f"({code})" in r.message, (code, r)
        assert _final(watch, device) is None, statuses(watch, device)[-1]
        assert Store(tmp_path / "state").record().state == opb.UpdateRecord.DOWNLOADING  # type: ignore[union-attr]
        # the operator's cancel, through the command line: answered once the update has ended
        key = tmp_path / "release.key"
        key.write_bytes(TRUSTED.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
        argv = ["fleet", "cancel-update", update_id, "--key", str(key), "--device", device]
        cli = subprocess.run(
            [sys.executable, "-m", "agent", *argv, "--reason", "bad build", "--broker", broker.url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, (cli.stdout, cli.stderr)
        assert f"update {update_id}: REJECTED (cancelled)" in cli.stdout, cli.stdout
        assert "bad build" in cli.stdout, cli.stdout
        _wait(lambda: _final(watch, device) is not None, what="the cancel is not reported")
        final = _final(watch, device)
        assert final is not None and final.reason_code == "cancelled", final
        assert final.update_id == update_id
        attempts = len(served.requests)
        time.sleep(1.5)  # retry_s is 0.5: no download attempt after the cancel
        assert len(served.requests) == attempts
        assert not list((tmp_path / "state" / "ota" / "payload").glob("*.part"))
        # a cancel valid in every other way (as a replayed one) finds nothing to stop now, and
        # the cancelled manifest cannot come back
        good = sign_cancel(update_id, [TRUSTED], reason="again").SerializeToString()
        r = cancel(good)
        assert r.code == INVALID and "(not_in_progress)" in r.message, r
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
        assert resp.update.reason_code == "replay", resp.update
        # not busy: the next update is accepted
        served.short = 0
        again = bundle(models, tmp_path, payload_url=http.url, version=3)
        read_bundle(again)[1].extract(served.path)
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(again), 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        _wait(lambda: _final(watch, device, again) is not None, what="no final status")
        assert _final(watch, device, again).phase == Phase.COMMITTED  # type: ignore[union-attr]
    finally:
        d.stop()
        http.close()
        watch.close()


def test_a_malformed_trusted_key_is_a_configuration_error_shown_in_health(
    models, trusted, broker, tmp_path
):
    keys_dir = tmp_path / "keys"
    shutil.copytree(trusted, keys_dir)
    (keys_dir / "broken.pub").write_text("ed25519 this-is-not-base64!! release-2027\n")
    device = "dev-badkey"
    watch = Observer(broker, "ota-badkey")
    d = _daemon(tmp_path, models, broker, keys_dir, device)
    health_topic = Topics(PREFIX, device).health

    def health_update() -> fpb.UpdateStatus | None:
        with watch._cv:
            hs = [fpb.Health.FromString(s.payload) for s in watch.seen if s.topic == health_topic]
        return hs[-1].last_update if hs and hs[-1].HasField("last_update") else None

    try:
        # at start, before any update: health names the file
        _wait(lambda: health_update() is not None, timeout=30, what="health shows no problem")
        shown = health_update()
        assert shown is not None and shown.reason_code == "trusted_keys", shown
        assert str(keys_dir / "broken.pub") in shown.message, shown
        # a properly signed update is refused as the device's configuration, not a bad signature
        path = bundle(models, tmp_path, version=2)
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
        assert resp.update.phase == Phase.REJECTED, resp
        assert resp.update.reason_code == "trusted_keys", resp.update
        assert str(keys_dir / "broken.pub") in resp.update.message, resp.update
        assert d.client().info()["version"] == "1.0.0"
    finally:
        d.stop()
        watch.close()
