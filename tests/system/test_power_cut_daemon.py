"""Power cuts under the whole daemon (issue 35 item 1): `edge-agent run` with its state
directory and shipped model on the power-cut filesystem (tests/support/lazyfs.py), a real
mosquitto, a signed update whose payload comes over HTTP on loopback.

One run records the boundaries (fsync, rename, create, ...) of a whole update as the daemon
applies it: the offer's record, the download, staging, the new model's prepared copy and
weight cache written at its load, the switch, the trial, the commit, the cleanup, with the
outbox's appends for its reports in between. Then, for each chosen cut point, on a fresh copy
of the state: start the daemon, offer the update with the power going off at that boundary (the
daemon is killed there, before it sees the failed call: a power cut stops the process and its
network too), `cut()`, and check the disk as the next boot finds it: the update record reads,
it is not behind any report the broker took (a QoS-1 report a subscriber received must not be
contradicted), the pointer names a model that verifies; then restart the daemon on the same
disk: it starts and serves greedy tokens equal to those of the whole old model or the whole
new one (from the recording run, where the disk was never cut), the one its version says.

Cut points: the first boundary of each distinct (operation, file) pair of the recording (file
names with their digests, random parts and update id folded), plus a seeded sample of the
others, `SAMPLE` of them. The daemon's other writes (health, the outbox) interleave with the
update's by timing, so the boundary at index k of a replay is not always the recording's: each
point says which boundary it was actually cut before.
"""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.fleet.topics import Topics
from agent.model.directory import load_model_dir
from agent.operator.client import send
from agent.operator.link import FleetError
from agent.ota.artifact import keys
from agent.ota.artifact.bundle import make_bundle, read_bundle
from agent.ota.store import Store
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.broker import Mosquitto
from tests.support.daemon_harness import Daemon
from tests.support.httpserver import PayloadServer, Served
from tests.support.lazyfs import LazyFS, mounted
from tests.system.test_daemon import req
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import _copy_variant, _fine_tune, write_meta

pytestmark = pytest.mark.fuse

R = opb.UpdateRecord
Phase = fpb.UpdateStatus
KEY = Ed25519PrivateKey.generate()
SAMPLE = 1  # cut points drawn at random (seeded) beyond the first of each distinct pair
SEED = 35
OLD, NEW = "1.0.0", "1.3.0"
# what changes between runs: digests, mkstemp's names, event numbers, the update id
_VARYING = re.compile(r"[0-9a-f]{16,}|\d{12}|[.]?[A-Za-z0-9_]{8}\.tmp$|u-cut")
# file classes with power-cut seam tests of their own, one class each (every operation on them):
# the outbox's files but its deletions (tests/unit/fleet/test_outbox_power_cut.py), the staged
# model's files (tests/unit/ota/test_power_cut.py), what reading a model file found
_CLASSES = (
    (re.compile(r"^(create|fsync|rename|fsyncdir) /state/fleet/events.*"), "<outbox write>"),
    (re.compile(r"^\w+ /state/models/[^/]*\.staging/.*"), "<staged file write>"),
    (re.compile(r"^\w+ /state/cache/xnnpack/.*\.parse\.json.+"), "<parse cache write>"),
    (re.compile(r"^unlink /state/cache/xnnpack/.*"), "<the old model's cache files pruned>"),
)


@dataclass(frozen=True)
class Setup:
    base: Path  # the shipped model (outside the mount; copied onto it)
    bundle: Path
    trusted: Path


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("cut-models")
    base, new = root / "base", root / "new"
    _copy_variant(tiny_model_dir, base, OLD)
    _copy_variant(tiny_model_dir, new, NEW)
    _fine_tune(new / "model_int8.tflite", fraction=1.0)  # greedy tokens that differ
    write_meta(new, load_model_dir(tiny_model_dir), NEW)
    trusted = root / "trusted"
    trusted.mkdir()
    (trusted / "release.pub").write_text(keys.public_line(KEY.public_key(), "release"))
    bundle = root / "update.tar"
    make_bundle(base, new, [KEY], bundle, version=1, update_id="u-cut")
    return Setup(base, bundle, trusted)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path_factory.mktemp("cut-broker"))
    yield b
    b.stop()


def _config(trusted: Path) -> str:
    return (
        '[model]\nquantization = "int8"\n'
        "[fleet]\nhealth_interval_s = 3600\n"
        f'[updates]\ntrusted_keys_dir = "{trusted}"\ntrial_s = 1.0\n'
        "retry_s = 0.5\nprogress_interval_s = 3600\n"
        'clock = "trusted"\n'
    )


def fold(boundary: str) -> str:
    """A boundary as (operation, file), or its file class: `rename /state/ota/.record.pb*`."""
    folded = _VARYING.sub("*", boundary)
    for pattern, name in _CLASSES:
        if pattern.match(folded):
            return name
    return folded


class Rig:
    """The mount, the payload server and the broker's observer one test shares."""

    def __init__(self, fs: LazyFS, mnt: Path, tmp: Path, s: Setup, broker: Mosquitto) -> None:
        self.fs, self.mnt, self.tmp, self.s, self.broker = fs, mnt, tmp, s, broker
        signed, payload = read_bundle(s.bundle)
        self.served = Served(tmp / "payload.bin")
        payload.extract(self.served.path)
        self.http = PayloadServer(self.served)
        m = opb.Manifest.FromString(signed.manifest)
        m.payload_url = self.http.url
        from agent.ota.artifact.signing import sign

        self.offer = sign(m, [KEY]).SerializeToString()
        self.watch = Observer(broker, f"cut-watch-{time.monotonic_ns()}")
        self.daemon: Daemon | None = None
        self.pruned = 0  # how many cache files the commit removes (the old model's)
        fs.on_power_off = self._power_off

    def _power_off(self, what: str) -> None:
        if self.daemon is not None and self.daemon.proc.poll() is None:
            self.daemon.proc.send_signal(signal.SIGKILL)

    def start(self, run: Path, device: str, online: bool = True) -> Daemon:
        run.mkdir(parents=True, exist_ok=True)
        d = Daemon(
            run,
            self.mnt / "shipped",
            _config(self.s.trusted),
            args=(
                "--broker",
                self.broker.url,
                "--device-id",
                device,
                "--state-dir",
                str(self.mnt / "state"),
            ),
        )
        self.daemon = d
        if online:  # commands sent before a device ever subscribed are not delivered
            self.watch.state(device, fpb.DeviceState.ONLINE, timeout=120)
        return d

    def statuses(self, device: str) -> list[fpb.UpdateStatus]:
        topic = Topics(PREFIX, device).update_status
        with self.watch._cv:
            seen = list(self.watch.seen)
        return [fpb.Event.FromString(s.payload).update for s in seen if s.topic == topic]

    def update(self, device: str) -> None:
        """Offer the update and return once the power is off, or once it is committed and the
        old model's cache files (`pruned` of them) are deleted: the last boundaries."""
        threading.Thread(target=self._send, args=(device,), daemon=True).start()
        deadline = time.monotonic() + 300  # a limit for an update that never ends
        while not self.fs.dead:
            phases = [s.phase for s in self.statuses(device)]
            assert self.daemon is not None
            removed = self.daemon.read_log().count("weight cache removed")
            if Phase.COMMITTED in phases and removed >= self.pruned:
                return
            bad = {Phase.ROLLED_BACK, Phase.REJECTED, Phase.FAILED} & set(phases)
            assert not bad, [Phase.Phase.Name(p) for p in phases]
            assert time.monotonic() < deadline, [Phase.Phase.Name(p) for p in phases]
            assert self.daemon is not None and self.daemon.proc.poll() is None
            time.sleep(0.05)

    def _send(self, device: str) -> None:
        with contextlib.suppress(FleetError):  # the power went off before the device answered
            send(options(self.broker), PREFIX, device, "update", {}, self.offer, 60)

    def tokens(self, d: Daemon) -> tuple[str, list[int]]:
        """The model's version and its greedy tokens, the version read on both sides."""
        c = d.client()
        while True:
            before = c.info()["version"]
            got = c.generate(req(n=16, temperature=0.0)).tokens
            if c.info()["version"] == before:
                return before, got

    def fresh(self, snapshot: Path) -> None:
        """The disk as the recording run's daemon left it before the update, made durable."""
        self.fs.fail_after(None)
        shutil.rmtree(self.mnt / "state")  # the shipped model stays: nothing writes it
        shutil.copytree(snapshot / "state", self.mnt / "state", symlinks=True)
        self.fs.sync()

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        self.fs.on_power_off = None
        self.watch.close()
        self.http.close()


def _rank(state: int) -> int:
    """Where a record state stands in an update's order; the final states above the rest."""
    return state if state <= R.TRIAL else R.COMMITTED


def test_an_update_under_the_daemon_survives_power_cuts(
    setup: Setup, broker: Mosquitto, tmp_path: Path
) -> None:
    with mounted(tmp_path / "fs") as (fs, mnt):
        rig = Rig(fs, mnt, tmp_path, setup, broker)
        try:
            _run(rig, tmp_path)
        finally:
            rig.close()


def _run(rig: Rig, tmp: Path) -> None:
    fs, mnt = rig.fs, rig.mnt
    # the recording: a first start (prepares the shipped model), then the whole update
    shutil.copytree(rig.s.base, mnt / "shipped")
    (mnt / "state").mkdir()
    fs.sync()
    d = rig.start(tmp / "rec-0", "dev-cut-rec")
    old = rig.tokens(d)
    assert d.stop() == 0, d.read_log()
    snapshot = tmp / "before-update"
    rig.pruned = len(list((mnt / "state" / "cache" / "xnnpack").iterdir()))
    shutil.copytree(mnt / "state", snapshot / "state", symlinks=True)
    rig.fresh(snapshot)
    d = rig.start(tmp / "rec-1", "dev-cut-rec1")
    fs.fail_after(None)
    rig.update("dev-cut-rec1")
    trace = list(fs.trace)
    new = rig.tokens(d)
    assert d.stop() == 0, d.read_log()
    assert old[0] == OLD and new[0] == NEW, (old, new)
    assert old[1] != new[1], "the two models' greedy tokens must differ for the check to tell"
    reference = dict([old, new])

    firsts: dict[str, int] = {}
    for k, b in enumerate(trace):
        firsts.setdefault(fold(b), k)
    rest = sorted(set(range(len(trace))) - set(firsts.values()))
    points = sorted({*firsts.values(), *random.Random(SEED).sample(rest, min(SAMPLE, len(rest)))})
    print(f"{len(trace)} boundaries, {len(firsts)} distinct, {len(points)} cut points:")
    print("\n".join(f"{k:4} {trace[k]}" for k in points))

    problems: list[str] = []
    for k in points:
        rig.fresh(snapshot)
        device = f"dev-cut-{k}"
        d = rig.start(tmp / f"cut-{k}", device)
        fs.fail_after(k)
        rig.update(device)
        where = f"cut before {fs.off_at!r} (boundary {k}, recorded {trace[k]!r})"
        if not fs.dead:
            problems.append(f"boundary {k}: the update ended before the cut ({trace[k]!r})")
            d.stop()
            continue
        d.proc.wait(60)
        d.stop()
        reported = [s.phase for s in rig.statuses(device) if s.update_id == "u-cut"]
        fs.cut()
        problems += _check_disk(mnt / "state", reported, where)
        d = rig.start(tmp / f"boot-{k}", device, online=False)
        version, got = rig.tokens(d)
        if reference.get(version) != got:
            problems.append(f"{where}: serves {version} with tokens {got}, not {reference}")
        if d.proc.poll() is not None:
            problems.append(f"{where}: the restarted daemon exited {d.proc.returncode}")
        d.proc.kill()  # the next point starts on a fresh copy: no clean stop needed
        d.stop()
    assert problems == [], "\n".join(problems)


def _check_disk(state: Path, reported: list[int], where: str) -> list[str]:
    """What the next boot finds: a record that reads and is not behind a report the broker
    took; a pointer naming a model that verifies."""
    problems = []
    store = Store(state)
    try:
        rec = store.record()
    except Exception as exc:  # any failure to read it is the finding
        return [f"{where}: the record does not read: {exc!r}"]
    last = max((p for p in reported if p <= Phase.COMMITTED), default=0)
    if last and (rec is None or _rank(rec.state) < last):
        got = "no record" if rec is None else R.State.Name(rec.state)
        problems.append(f"{where}: {Phase.Phase.Name(last)} was reported, the disk has {got}")
    if Phase.COMMITTED in reported and (rec is None or rec.state != R.COMMITTED):
        problems.append(f"{where}: COMMITTED was reported, the record is {rec}")
    try:
        inst = store.installed()
    except Exception as exc:
        return [*problems, f"{where}: the pointer does not read: {exc!r}"]
    if inst is not None and inst.current.verify() is not None:
        problems.append(f"{where}: the pointer names {inst.current}: {inst.current.verify()}")
    if Phase.COMMITTED in reported and (inst is None or inst.current.label != NEW):
        problems.append(f"{where}: COMMITTED was reported, the pointer is {inst}")
    return problems
