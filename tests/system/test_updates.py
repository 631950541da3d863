"""Signed delta updates end to end: a real daemon, a real mosquitto, a real HTTP server on
loopback, real Ed25519 keys, real model files (docs/UPDATES.md)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.fleet.topics import Topics
from agent.model.directory import load_model_dir
from agent.operator.client import send
from agent.operator.link import FleetError
from agent.operator.publish import publish_update
from agent.ota.artifact import keys
from agent.ota.artifact.bundle import make_bundle, read_bundle
from agent.ota.artifact.signing import sign
from agent.ota.fetch import CHUNK
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.broker import Mosquitto
from tests.support.daemon_harness import Daemon
from tests.support.httpserver import PayloadServer, Served
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.unit.ota.test_bundle import _write_meta as write_meta

Phase = fpb.UpdateStatus
TRUSTED = Ed25519PrivateKey.generate()
STRANGER = Ed25519PrivateKey.generate()


@dataclass(frozen=True)
class Models:
    base: Path  # what the daemon ships with (int8 only, version 1.0.0)
    new: Path  # a fine-tune of it (version 1.1.0)


def _copy_variant(src: Path, dst: Path, version: str) -> None:
    meta = load_model_dir(src)
    dst.mkdir()
    shutil.copy(src / "model_int8.tflite", dst / "model_int8.tflite")
    shutil.copy(meta.tokenizer_path, dst / "tokenizer.model")
    write_meta(dst, meta, version)


def int8_weight_spans(data: bytes | bytearray) -> set[tuple[int, int]]:
    """(offset, length) in the file of every int8 weight buffer over 1 KiB (inline or outside
    the flatbuffer)."""
    from ai_edge_litert import schema_py_generated as schema

    fb = schema.Model.GetRootAs(bytes(data), 0)
    spans = set()
    for g in range(fb.SubgraphsLength()):
        sg = fb.Subgraphs(g)
        for t in range(sg.TensorsLength()):
            tensor = sg.Tensors(t)
            if tensor.Type() != schema.TensorType.INT8 or tensor.Buffer() <= 0:
                continue
            b = fb.Buffers(tensor.Buffer())
            vec = b._tab.Offset(4)
            if vec and b._tab.VectorLen(vec) > 1024:
                spans.add((b._tab.Vector(vec), b._tab.VectorLen(vec)))
            elif b.Size() > 1024:
                spans.add((b.Offset(), b.Size()))
    return spans


def _fine_tune(path: Path, fraction: float = 0.1) -> None:
    """Nudge the weights of some int8 tensors by ±1, as a fine-tune and requantize would."""
    data = bytearray(path.read_bytes())
    spans = int8_weight_spans(data)
    assert spans, "no int8 weight buffers"
    rng = np.random.default_rng(7)
    for start, length in sorted(spans)[: max(1, int(len(spans) * fraction))]:
        arr = np.frombuffer(data, dtype=np.int8, count=length, offset=start).astype(np.int16)
        arr = np.clip(arr + rng.integers(-1, 2, size=length), -127, 127)
        data[start : start + length] = arr.astype(np.int8).tobytes()
    path.write_bytes(bytes(data))


def make_models(tiny_model_dir: Path, root: Path) -> Models:
    """The shipped model (1.0.0) under `root`/base and a fine-tune of it (1.1.0) under /new."""
    base, new = root / "base", root / "new"
    _copy_variant(tiny_model_dir, base, "1.0.0")
    _copy_variant(tiny_model_dir, new, "1.1.0")
    _fine_tune(new / "model_int8.tflite")
    write_meta(new, load_model_dir(tiny_model_dir), "1.1.0")
    return Models(base, new)


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory) -> Models:
    return make_models(tiny_model_dir, tmp_path_factory.mktemp("ota-models"))


@pytest.fixture(scope="module")
def big_models(tiny_model_dir, tmp_path_factory) -> Models:
    """An update that touches every int8 tensor: a payload of several blocks and chunks."""
    root = tmp_path_factory.mktemp("ota-big")
    base, new = root / "base", root / "new"
    _copy_variant(tiny_model_dir, base, "1.0.0")
    _copy_variant(tiny_model_dir, new, "1.2.0")
    _fine_tune(new / "model_int8.tflite", fraction=1.0)
    write_meta(new, load_model_dir(tiny_model_dir), "1.2.0")
    return Models(base, new)


@pytest.fixture(scope="module")
def trusted(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("trusted")
    (d / "release.pub").write_text(keys.public_line(TRUSTED.public_key(), "release"))
    return d


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path_factory.mktemp("ota-broker"))
    yield b
    b.stop()


def config(trusted: Path, trial_s: float = 1.0) -> str:
    return (
        '[model]\nquantization = "int8"\n'
        "[fleet]\nhealth_interval_s = 1\nhealth_min_interval_s = 0.2\n"
        f'[updates]\ntrusted_keys_dir = "{trusted}"\ntrial_s = {trial_s}\n'
        "retry_s = 0.5\nprogress_interval_s = 0.2\n"
        'clock = "trusted"\n'  # this machine's clock may not say it is synchronized
    )


def start(tmp: Path, models: Models, broker: Mosquitto, trusted: Path, device: str, **env):  # type: ignore[no-untyped-def]
    """A daemon for `device`, returned once its birth is on the broker: commands sent before
    a device ever subscribed are not delivered (no session exists for it yet). `text`: its
    whole agent.toml (default: `config(trusted, trial_s)`)."""
    wait_online = env.pop("wait_online", True)
    text = env.pop("text", None) or config(trusted, env.pop("trial_s", 1.0))
    seen = Observer(broker, f"birth-{device}-{time.monotonic_ns()}")
    d = Daemon(
        tmp,
        models.base,
        text,
        env={k: str(v) for k, v in env.items()},
        args=("--broker", broker.url, "--device-id", device),
    )
    try:
        if wait_online:
            seen.state(device, fpb.DeviceState.ONLINE)
    finally:
        seen.close()
    return d


def bundle(models: Models, tmp: Path, **kw) -> Path:  # type: ignore[no-untyped-def]
    out = tmp / f"update-{kw.get('version', 1)}-{time.monotonic_ns()}.tar"
    make_bundle(
        models.base, models.new, [kw.pop("key", TRUSTED)], out, version=kw.pop("version", 1), **kw
    )
    return out


def over_http(models: Models, tmp: Path, version: int, **served_kw):  # type: ignore[no-untyped-def]
    """A bundle whose manifest points at a real HTTP server on loopback serving its payload:
    (the server's Served record, the server, the bundle path)."""
    served = Served(tmp / "payload.bin", **served_kw)
    http = PayloadServer(served)
    path = bundle(models, tmp, payload_url=http.url, version=version)
    read_bundle(path)[1].extract(served.path)
    return served, http, path


def statuses(watch: Observer, device: str) -> list[fpb.UpdateStatus]:
    topic = Topics(PREFIX, device).update_status
    with watch._cv:
        return [fpb.Event.FromString(s.payload).update for s in watch.seen if s.topic == topic]


def wait_final(watch: Observer, device: str, timeout: float = 60) -> fpb.UpdateStatus:
    final = (Phase.COMMITTED, Phase.ROLLED_BACK, Phase.REJECTED, Phase.FAILED)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [s for s in statuses(watch, device) if s.phase in final]
        if done:
            return done[-1]
        time.sleep(0.1)
    raise AssertionError(
        f"no final status; saw {[Phase.Phase.Name(s.phase) for s in statuses(watch, device)]}"
    )


def phases(watch: Observer, device: str) -> list[str]:
    names = [Phase.Phase.Name(s.phase) for s in statuses(watch, device)]
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]  # progress repeats


def assert_rolled_back_files_gone(state: Path, models: Models, caches: bool = True) -> None:
    """After a rollback to the shipped model: no model directory the update built is left in
    the store, and the weight cache holds only the shipped model's prepared files."""
    store = state / "models"
    assert not store.exists() or sorted(p.name for p in store.iterdir()) == []
    if not caches:
        return
    cache = state / "cache" / "xnnpack"
    base_only = {load_model_dir(models.base).variant("int8").sha256}
    deadline = time.monotonic() + 10  # the caches go once the failed model is closed
    while {f.name.split(".", 1)[0] for f in cache.iterdir()} != base_only:
        assert time.monotonic() < deadline, sorted(f.name for f in cache.iterdir())
        time.sleep(0.05)


# ----------------------------------------------------------------------------- happy paths


def test_delta_over_http_commits_while_a_stream_keeps_working(models, trusted, broker, tmp_path):
    # the first GET breaks after 2,000 bytes: the download must resume
    served, http, path = over_http(models, tmp_path, 1, cut_after=2000)
    watch = Observer(broker, "ota-watch-http")
    d = start(tmp_path, models, broker, trusted, "dev-ota-http")
    failures: list[BaseException] = []
    stop = threading.Event()

    def stream() -> None:
        c = d.client()
        while not stop.is_set():
            try:
                r = c.generate(_req())
                assert r.finish_reason in ("length", "stop")
            except BaseException as exc:  # any failed request fails the test
                failures.append(exc)

    worker = threading.Thread(target=stream)
    try:
        assert d.client().info()["version"] == "1.0.0"
        worker.start()
        result = publish_update(options(broker), PREFIX, path, ["dev-ota-http"], timeout_s=90)
        final = result["dev-ota-http"].status
        assert final is not None and final.phase == Phase.COMMITTED, final
        assert wait_final(watch, "dev-ota-http").phase == Phase.COMMITTED
        assert phases(watch, "dev-ota-http") == [
            "RECEIVED",
            "DOWNLOADING",
            "VERIFIED",
            "STAGED",
            "ACTIVATING",
            "TRIAL",
            "COMMITTED",
        ]
        assert served.requests[0] == "" and served.requests[1] == "bytes=2000-"  # resumed
        assert d.client().info()["version"] == "1.1.0"
        h = _latest_health(watch, "dev-ota-http")
        assert h.model.version == "1.1.0" and h.last_update.phase == Phase.COMMITTED
    finally:
        stop.set()
        worker.join(60)
        assert d.stop() == 0, d.read_log()
        http.close()
        watch.close()
    assert not failures, failures[:3]


def test_delta_over_mqtt_blocks(models, trusted, broker, tmp_path):
    path = bundle(models, tmp_path)  # no URL: the payload comes in blocks over MQTT
    watch = Observer(broker, "ota-watch-mqtt")
    d = start(tmp_path, models, broker, trusted, "dev-ota-mqtt")
    try:
        result = publish_update(options(broker), PREFIX, path, ["dev-ota-mqtt"], timeout_s=90)
        p = result["dev-ota-mqtt"]
        assert p.status is not None and p.status.phase == Phase.COMMITTED, p.status
        assert p.blocks_served >= 1
        assert d.client().info()["version"] == "1.1.0"
        # the old model's prepared copy and packed weights, kept while it served beside the
        # new one, are removed once the update is committed
        cache = tmp_path / "state" / "cache" / "xnnpack"
        new_only = {load_model_dir(models.new).variant("int8").sha256}
        deadline = time.monotonic() + 10  # the report can arrive before the files are gone
        while {f.name.split(".", 1)[0] for f in cache.iterdir()} != new_only:
            assert time.monotonic() < deadline, sorted(f.name for f in cache.iterdir())
            time.sleep(0.05)
        # a restart serves the committed model; the shipped one is only the fallback
        assert d.stop() == 0
        d = start(tmp_path, models, broker, trusted, "dev-ota-mqtt")
        assert d.client().info()["version"] == "1.1.0"
    finally:
        assert d.stop() == 0, d.read_log()
        watch.close()


def _req():  # type: ignore[no-untyped-def]
    from tests.system.test_daemon import req

    return req(n=16)


def _latest_health(watch: Observer, device: str) -> fpb.Health:
    topic = Topics(PREFIX, device).health
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with watch._cv:
            hs = [fpb.Health.FromString(s.payload) for s in watch.seen if s.topic == topic]
        if hs and hs[-1].last_update.phase == Phase.COMMITTED:
            return hs[-1]
        time.sleep(0.2)
    return hs[-1]


# ----------------------------------------------------------------------------- attacks


@pytest.fixture(scope="module")
def victim(models, trusted, broker, tmp_path_factory) -> Iterator[Daemon]:
    d = start(tmp_path_factory.mktemp("victim"), models, broker, trusted, "dev-victim")
    yield d
    assert d.stop() == 0, d.read_log()


def _resign(path: Path, edit) -> bytes:  # type: ignore[no-untyped-def]
    signed, _ = read_bundle(path)
    m = opb.Manifest.FromString(signed.manifest)
    edit(m)
    return sign(m, [TRUSTED]).SerializeToString()


def _signed(path: Path) -> bytes:
    return read_bundle(path)[0].SerializeToString()


ATTACKS = {
    "bad_signature": lambda b: _flip_signature(_signed(b)),
    "unknown_key": lambda b: _signed(b),  # made with the stranger's key below
    "expired": lambda b: _resign(b, _expire),
    "base_mismatch": lambda b: _resign(b, lambda m: setattr(m, "base_model_sha256", "ab" * 32)),
    "incompatible": lambda b: _resign(b, lambda m: m.compatible_profiles.append("raspberry-pi-5")),
    "agent_too_old": lambda b: _resign(b, lambda m: setattr(m, "min_agent_version", "99.0.0")),
}


def _expire(m: opb.Manifest) -> None:
    m.issued_unix, m.expires_unix = time.time() - 7200, time.time() - 3600


def _flip_signature(data: bytes) -> bytes:
    signed = opb.SignedManifest.FromString(data)
    sig = bytearray(signed.signatures[0].signature)
    sig[0] ^= 1
    signed.signatures[0].signature = bytes(sig)
    return signed.SerializeToString()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_rejected_manifests_leave_the_model_serving(attack, victim, models, broker, tmp_path):
    key = STRANGER if attack == "unknown_key" else TRUSTED
    body = ATTACKS[attack](bundle(models, tmp_path, key=key, version=5))
    resp = send(options(broker), PREFIX, "dev-victim", "update", {}, body, 30)
    assert resp.update.phase == Phase.REJECTED, resp
    assert resp.update.reason_code in _codes(attack), resp.update
    assert resp.update.message
    c = victim.client()
    assert c.info()["version"] == "1.0.0" and c.health() == "SERVING"


def _codes(attack: str) -> set[str]:
    return {"bad_signature": {"bad_signature"}, "unknown_key": {"unknown_key"}}.get(
        attack, {attack}
    )


def test_payload_larger_than_declared_and_wrong_rebuild_are_rejected(
    victim, models, broker, tmp_path
):
    watch = Observer(broker, "ota-watch-attacks")
    served = Served(tmp_path / "payload.bin", extra=1 << 20)  # endless data
    http = PayloadServer(served)
    try:
        path = bundle(models, tmp_path, payload_url=http.url, version=7)
        read_bundle(path)[1].extract(served.path)
        resp = send(options(broker), PREFIX, "dev-victim", "update", {}, _signed(path), 30)
        assert resp.update.phase == Phase.RECEIVED
        final = wait_final(watch, "dev-victim")
        assert final.phase == Phase.REJECTED and "declared" in final.message, final
        assert victim.client().info()["version"] == "1.0.0"
        # a manifest whose file list lies about the rebuilt file: staged, checked, rejected
        served.extra = 0
        n = len(statuses(watch, "dev-victim"))
        path = bundle(models, tmp_path, payload_url=http.url, version=8)
        read_bundle(path)[1].extract(served.path)
        body = _resign(path, _lie_about_the_tokenizer)
        resp = send(options(broker), PREFIX, "dev-victim", "update", {}, body, 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        deadline = time.monotonic() + 60
        while len([s for s in statuses(watch, "dev-victim")[n:] if s.phase == Phase.REJECTED]) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        final = [s for s in statuses(watch, "dev-victim")[n:] if s.phase == Phase.REJECTED][-1]
        assert final.reason_code in ("target_hash", "payload"), final
        assert victim.client().info()["version"] == "1.0.0"
    finally:
        http.close()
        watch.close()


def _lie_about_the_tokenizer(m: opb.Manifest) -> None:
    (f,) = [f for f in m.files if f.name == "tokenizer.model"]
    f.sha256 = "cd" * 32


def test_replay_after_success_is_rejected(models, trusted, broker, tmp_path):
    path = bundle(models, tmp_path, version=3)
    d = start(tmp_path, models, broker, trusted, "dev-replay")
    try:
        # through the operator's command line this time
        argv = ["fleet", "publish-update", str(path), "--device", "dev-replay"]
        cli = subprocess.run(
            [sys.executable, "-m", "agent", *argv, "--broker", broker.url, "--timeout", "90"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        assert "dev-replay: COMMITTED" in cli.stdout
        assert "1 of 1 devices committed" in cli.stdout
        resp = send(options(broker), PREFIX, "dev-replay", "update", {}, _signed(path), 30)
        assert resp.update.phase == Phase.REJECTED
        assert resp.update.reason_code == "replay", resp.update
        # an older version, properly signed and fresh: a rollback attack
        older = bundle(models, tmp_path, version=2)
        resp = send(options(broker), PREFIX, "dev-replay", "update", {}, _signed(older), 30)
        assert resp.update.reason_code == "rollback", resp.update
        assert d.client().info()["version"] == "1.1.0"
    finally:
        assert d.stop() == 0, d.read_log()


def test_a_model_that_fails_its_canary_never_serves(models, trusted, broker, tmp_path):
    _served, http, path = over_http(models, tmp_path, 6)
    watch = Observer(broker, "ota-canary")
    d = start(tmp_path, models, broker, trusted, "dev-canary")

    def expect_wrong_tokens(m: opb.Manifest) -> None:
        m.canary.prompt = "def f(x):"
        m.canary.expected_tokens.extend([3, 3, 3, 3])  # not what the new model says

    try:
        body = _resign(path, expect_wrong_tokens)
        resp = send(options(broker), PREFIX, "dev-canary", "update", {}, body, 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        final = wait_final(watch, "dev-canary")
        assert final.phase == Phase.ROLLED_BACK and "canary" in final.message, final
        assert d.client().info()["version"] == "1.0.0"
        assert_rolled_back_files_gone(tmp_path / "state", models)
        assert d.client().generate(_req()).finish_reason in ("length", "stop")
    finally:
        assert d.stop() == 0, d.read_log()
        http.close()
        watch.close()


def test_a_failing_health_check_in_the_trial_rolls_back(models, trusted, broker, tmp_path):
    _served, http, path = over_http(models, tmp_path, 9)
    watch = Observer(broker, "ota-trial-health")
    d = start(tmp_path, models, broker, trusted, "dev-trial", trial_s=30.0)
    d.config.write_text(d.config.read_text() + "[watchdog]\nengine_stall_s = 1\n")
    try:
        d.signal(signal.SIGHUP)  # the shorter stall limit applies from now on
        resp = send(options(broker), PREFIX, "dev-trial", "update", {}, _signed(path), 30)
        assert resp.update.phase == Phase.RECEIVED
        deadline = time.monotonic() + 60
        while Phase.TRIAL not in [s.phase for s in statuses(watch, "dev-trial")]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert d.client().info()["version"] == "1.1.0"
        d.signal(signal.SIGUSR2)  # fault injection: the new engine's thread stops answering
        final = wait_final(watch, "dev-trial")
        assert final.phase == Phase.ROLLED_BACK and "health check" in final.message, final
        assert d.client().info()["version"] == "1.0.0"
        # (the stalled engine still holds its prepared files: only the directory is checked)
        assert_rolled_back_files_gone(tmp_path / "state", models, caches=False)
        assert d.client().generate(_req()).finish_reason in ("length", "stop")
    finally:
        d.stop()
        http.close()
        watch.close()


# ----------------------------------------------------------------------------- crashes


CRASH_STATES = ["received", "downloading", "verified", "mid-staging", "staged", "activating"]


@pytest.mark.parametrize("state", CRASH_STATES)
def test_sigkill_in_each_state_serves_old_or_new_whole(state, models, trusted, broker, tmp_path):
    _served, http, path = over_http(models, tmp_path, 2)
    watch = Observer(broker, f"ota-crash-{state}")
    device = f"dev-crash-{state}"
    d = start(tmp_path, models, broker, trusted, device, EDGE_AGENT_OTA_CRASH_AT=state)
    try:
        # the answer may not make it out before the agent kills itself
        with contextlib.suppress(FleetError):
            send(options(broker), PREFIX, device, "update", {}, _signed(path), 5)
        assert d.proc.wait(60) == -signal.SIGKILL  # it died where it was told to
        d.stop()
        d = start(tmp_path, models, broker, trusted, device)
        version = d.client().info()["version"]
        assert version in ("1.0.0", "1.1.0")
        final = wait_final(watch, device)
        want = Phase.ROLLED_BACK if state == "activating" else Phase.COMMITTED
        assert final.phase == want, (final, phases(watch, device))
        assert d.client().info()["version"] == ("1.1.0" if want == Phase.COMMITTED else "1.0.0")
        assert d.client().generate(_req()).finish_reason in ("length", "stop")
        if want == Phase.ROLLED_BACK:  # "the agent restarted while activating"
            assert_rolled_back_files_gone(tmp_path / "state", models)
    finally:
        d.stop()
        http.close()
        watch.close()


def test_a_download_resumes_after_a_crash_in_the_middle(big_models, trusted, broker, tmp_path):
    served, http, path = over_http(big_models, tmp_path, 2)
    size = served.path.stat().st_size
    assert size > CHUNK, size  # more than one read: the crash comes after the first
    watch = Observer(broker, "ota-mid-download")
    device = "dev-mid-download"
    d = start(tmp_path, big_models, broker, trusted, device, EDGE_AGENT_OTA_CRASH_AT="mid-download")
    try:
        with contextlib.suppress(FleetError):
            send(options(broker), PREFIX, device, "update", {}, _signed(path), 10)
        assert d.proc.wait(60) == -signal.SIGKILL
        d.stop()
        part = next((tmp_path / "state" / "ota" / "payload").glob("*.part"))
        kept = part.stat().st_size
        assert 0 < kept < size
        d = start(tmp_path, big_models, broker, trusted, device)
        final = wait_final(watch, device)
        assert final.phase == Phase.COMMITTED, (final, phases(watch, device))
        assert served.requests[-1].startswith("bytes=")  # the restart asked for the rest
        assert int(served.requests[-1].removeprefix("bytes=").rstrip("-")) >= kept
        assert d.client().info()["version"] == "1.2.0"
    finally:
        d.stop()
        http.close()
        watch.close()


def test_a_crash_looping_trial_rolls_back(models, trusted, broker, tmp_path):
    _served, http, path = over_http(models, tmp_path, 2)
    watch = Observer(broker, "ota-crash-loop")
    crash = {"EDGE_AGENT_OTA_CRASH_AT": "trial", "trial_s": 30.0}
    d = start(tmp_path, models, broker, trusted, "dev-loop", **crash)
    try:
        with contextlib.suppress(FleetError):
            send(options(broker), PREFIX, "dev-loop", "update", {}, _signed(path), 30)
        assert d.proc.wait(60) == -signal.SIGKILL  # switched, then "crashed" in its trial
        d.stop()
        for _ in range(2):  # and again at every start while the trial continues
            d = start(tmp_path, models, broker, trusted, "dev-loop", wait_online=False, **crash)
            assert d.proc.wait(60) == -signal.SIGKILL
            d.stop()
        # the third restart in the trial: a crash loop, rolled back before the model loads
        d = start(tmp_path, models, broker, trusted, "dev-loop", **dict(crash))
        final = wait_final(watch, "dev-loop")
        assert final.phase == Phase.ROLLED_BACK and "crash loop" in final.message, final
        assert d.client().info()["version"] == "1.0.0"
        assert_rolled_back_files_gone(tmp_path / "state", models)
    finally:
        d.stop()
        http.close()
        watch.close()


def test_a_tampered_active_model_is_refused_for_the_last_good_one(
    models, trusted, broker, tmp_path
):
    path = bundle(models, tmp_path, version=4)
    watch = Observer(broker, "ota-tamper")
    d = start(tmp_path, models, broker, trusted, "dev-tamper")
    try:
        result = publish_update(options(broker), PREFIX, path, ["dev-tamper"], timeout_s=90)
        assert result["dev-tamper"].status.phase == Phase.COMMITTED
        assert d.stop() == 0
        (active,) = (tmp_path / "state" / "models").glob("4-*/model_int8.tflite")
        data = bytearray(active.read_bytes())
        data[len(data) // 2] ^= 0xFF
        active.write_bytes(bytes(data))
        n = len(statuses(watch, "dev-tamper"))
        d = start(tmp_path, models, broker, trusted, "dev-tamper")
        assert d.client().info()["version"] == "1.0.0"
        deadline = time.monotonic() + 30
        while not any(s.phase == Phase.ROLLED_BACK for s in statuses(watch, "dev-tamper")[n:]):
            assert time.monotonic() < deadline, statuses(watch, "dev-tamper")[n:]
            time.sleep(0.1)
    finally:
        d.stop()
        watch.close()
