"""A full disk never costs the device its model (issue 35, docs/UPDATES.md): the state directory
is a real tmpfs of its own; an update offered with too little room (for its payload, its model
directory and its new model's first load) is refused at once with `no_space`; one that meets
ENOSPC while it downloads, patches the new model directory or writes its record, or finds no
room for its first load just before it loads, is rejected `no_space`, reported, and leaves
nothing behind, while the daemon goes on serving the model it had; one that meets ENOSPC while
its new model loads is rolled back `no_space`; the same update offered again once there is room
commits. A real daemon, a real mosquitto, a real HTTP server on loopback (the update is held at
a state by the fault injection's pause point while the test fills the disk); the load's ENOSPC
in process (below)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.fleet.topics import Topics
from agent.operator.client import send
from agent.ota import space
from agent.ota.artifact.bundle import read_bundle
from agent.ota.artifact.manifest import InstallContext
from agent.ota.faults import PAUSE_ENV, RESUME_ENV
from agent.ota.reports import manifest_of
from agent.ota.store import ModelRef, Store
from agent.ota.updater import Updater
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from agent.runtime.prepare.inline import prepare_file
from tests.support.daemon_harness import Daemon
from tests.support.fleetsim import model_ref
from tests.support.tmpfs import PAGE, fill, free, tmpfs
from tests.system import test_updates
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import _req, _signed, config, over_http, statuses
from tests.unit.ota import test_update_clock
from tests.unit.ota.test_update_clock import FileHost, device

# the update tests' module fixtures: the tiny model and its fine-tune, the trusted key, mosquitto
models, trusted, broker = test_updates.models, test_updates.trusted, test_updates.broker
big_models = test_updates.big_models
payload = test_update_clock.payload

pytestmark = pytest.mark.root

Phase = fpb.UpdateStatus
R = opb.UpdateRecord
MiB = 1 << 20
MARGIN = 4 * MiB  # updates.min_free_bytes in these tests
FINAL = (Phase.COMMITTED, Phase.ROLLED_BACK, Phase.REJECTED)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "state", 256 * MiB) as path:
        yield path


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Path]:
    """The in-process device's state directory (`device`'s) on a tmpfs of its own."""
    with tmpfs(tmp_path / "state", 32 * MiB) as path:
        yield path


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Path]:
    """A weight cache directory on a filesystem of its own (the in-process test)."""
    with tmpfs(tmp_path / "cache", 16 * MiB) as path:
        yield path


def _start(tmp: Path, models, broker, trusted: Path, device: str, pause_at: str) -> Daemon:  # type: ignore[no-untyped-def]
    """A daemon on the tmpfs state directory (`tmp`/state) whose updates wait at state
    `pause_at` until `tmp`/resume exists; returned once it is online."""
    seen = Observer(broker, f"birth-{device}-{time.monotonic_ns()}")
    text = config(trusted) + f"min_free_bytes = {MARGIN}\n"
    env = {PAUSE_ENV: pause_at, RESUME_ENV: str(tmp / "resume")}
    args = ("--broker", broker.url, "--device-id", device)
    d = Daemon(tmp, models.base, text, env=env, args=args)
    try:
        seen.state(device, fpb.DeviceState.ONLINE)
    finally:
        seen.close()
    return d


def _offer(broker, device: str, path: Path) -> fpb.UpdateStatus:  # type: ignore[no-untyped-def]
    resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
    return resp.update


def _manifest(path: Path) -> opb.Manifest:
    return opb.Manifest.FromString(read_bundle(path)[0].manifest)


def _wait(pred: Callable[[], object], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _finals(watch: Observer, device: str) -> list[fpb.UpdateStatus]:
    return [s for s in statuses(watch, device) if s.phase in FINAL]


def _wait_final(watch: Observer, device: str, n: int) -> fpb.UpdateStatus:
    """The `n`th final status of `device` (1-based; a refusal at the offer is one), once the
    broker has it."""
    _wait(lambda: len(_finals(watch, device)) >= n, f"final status {n} of {device}")
    return _finals(watch, device)[n - 1]


def _health(watch: Observer, device: str, pred: Callable[[fpb.Health], bool]) -> fpb.Health:
    topic = Topics(PREFIX, device).health
    found: list[fpb.Health] = []

    def seen() -> bool:
        with watch._cv:
            hs = [fpb.Health.FromString(s.payload) for s in watch.seen if s.topic == topic]
        found[:] = [h for h in hs if pred(h)]
        return bool(found)

    _wait(seen, "a health message as expected")
    return found[-1]


def _serves(d: Daemon, version: str) -> None:
    c = d.client()
    assert c.info()["version"] == version
    assert c.generate(_req()).finish_reason in ("length", "stop")


def _left_behind(state: Path) -> list[str]:
    """What an update may write in the state directory: payloads and model directories."""
    payloads = state / "ota" / "payload"
    found = list(payloads.iterdir()) if payloads.is_dir() else []
    found += list((state / "models").iterdir()) if (state / "models").is_dir() else []
    return sorted(p.name for p in found)


def test_no_room_at_the_offer_then_enospc_mid_download_then_a_retry_with_room_commits(
    big_models, trusted, broker, state, tmp_path
):
    models = big_models  # a payload of many pages: half of it fits, the rest does not
    served, http, path = over_http(models, tmp_path, 2)
    m = _manifest(path)
    device = "dev-full-download"
    watch = Observer(broker, "full-download")
    d = _start(tmp_path, models, broker, trusted, device, pause_at="downloading")
    store = Store(state)
    try:
        # less room than the margin: health says so, and the offer is refused before anything
        filler = fill(state, leave=MARGIN // 4)
        low = _health(watch, device, lambda h: h.disk.low)
        assert low.disk.min_free_bytes == MARGIN and low.disk.free_bytes < MARGIN
        assert low.disk.path == str(state)
        assert "below updates.min_free_bytes" in d.read_log()
        st = _offer(broker, device, path)
        assert (st.phase, st.reason_code) == (Phase.REJECTED, "no_space"), st
        assert "min_free_bytes" in st.message and "offer it again" in st.message
        assert store.record() is None and served.requests == []
        # room again: accepted; the disk fills while it is held before its download
        filler.unlink()
        _health(watch, device, lambda h: not h.disk.low and h.disk.free_bytes > MARGIN)
        assert _offer(broker, device, path).phase == Phase.RECEIVED
        _wait(lambda: (r := store.record()) is not None and r.state == R.DOWNLOADING, "held")
        filler = fill(state, leave=m.payload_size // 2)
        (tmp_path / "resume").touch()
        final = _wait_final(watch, device, 2)  # the refusal at the offer was the first
        assert (final.phase, final.reason_code) == (Phase.REJECTED, "no_space"), final
        assert "No space left on device" in final.message, final
        rec = store.record()
        assert rec is not None and (rec.state, rec.reason_code) == (R.REJECTED, "no_space")
        assert _left_behind(state) == []
        _serves(d, "1.0.0")
        # still full: refused at the offer, nothing is fetched
        asked = len(served.requests)
        assert _offer(broker, device, path).reason_code == "no_space"
        assert len(served.requests) == asked
        # room again: the same update (its id is not used up) commits, every transition of
        # this attempt reported anew
        filler.unlink()
        st = _offer(broker, device, path)
        assert st.phase == Phase.RECEIVED, st
        final = _wait_final(watch, device, 4)
        assert final.phase == Phase.COMMITTED and final.update_id == m.update_id, final
        _serves(d, "1.2.0")
    finally:
        assert d.stop() == 0, d.read_log()
        http.close()
        watch.close()
    seen = [
        Phase.Phase.Name(s.phase) for s in statuses(watch, device) if s.message[-6:] != " bytes"
    ]
    assert seen.count("RECEIVED") == 2 and seen.count("COMMITTED") == 1, seen


def test_enospc_while_patching_or_writing_the_record_leaves_the_model_serving(
    models, trusted, broker, state, tmp_path
):
    _, http, path = over_http(models, tmp_path, 3)
    m = _manifest(path)
    model_bytes = max(f.size for f in m.files)
    device = "dev-full-stage"
    watch = Observer(broker, "full-stage")
    d = _start(tmp_path, models, broker, trusted, device, pause_at="verified")
    store = Store(state)
    resume = tmp_path / "resume"
    try:
        for n, leave in enumerate((model_bytes // 2, 0), start=1):
            # held once the payload is downloaded and verified, before the new model's
            # directory is built: the disk fills; with half the model's size left the patch
            # meets ENOSPC, with nothing left the record naming the directory does
            assert _offer(broker, device, path).phase == Phase.RECEIVED
            _wait(lambda: (r := store.record()) is not None and r.state == R.VERIFIED, "held")
            filler = fill(state, leave=leave)
            resume.touch()
            final = _wait_final(watch, device, n)
            assert (final.phase, final.reason_code) == (Phase.REJECTED, "no_space"), final
            # the patcher names the delta it was applying; the record's write names nothing
            patching = f"{m.update_id}.part: [Errno 28] No space left on device" in final.message
            assert patching == (n == 1), final.message
            assert _left_behind(state) == [], n
            assert not list(state.glob("models/*.staging"))
            _serves(d, "1.0.0")
            resume.unlink()
            filler.unlink()
        rec = store.record()
        assert rec is not None and rec.reason_code == "no_space" and rec.attempt == 1
    finally:
        assert d.stop() == 0, d.read_log()
        http.close()
        watch.close()


def test_no_room_for_the_new_models_first_load_is_no_space_at_the_offer_and_before_it_loads(
    models, trusted, broker, state, tmp_path
):
    """The weight cache directory (here in the state directory's filesystem) takes the new
    model's prepared copy and packed weights when it loads: the offer counts them, and so does
    the last check before the load. (The load itself would have aborted the daemon: XNNPACK
    aborts when its cache file cannot be written.)"""
    _, http, path = over_http(models, tmp_path, 4)
    m = _manifest(path)
    load = space.first_load_bytes(m)
    device = "dev-full-activate"
    watch = Observer(broker, "full-activate")
    d = _start(tmp_path, models, broker, trusted, device, pause_at="staged")
    store = Store(state)
    cache = state / "cache" / "xnnpack"
    try:
        # room for the payload and the model directory, not for the first load as well
        filler = fill(state, leave=space.needed_bytes(m) + MARGIN + load // 2)
        st = _offer(broker, device, path)
        assert (st.phase, st.reason_code) == (Phase.REJECTED, "no_space"), st
        assert "first load of the new model" in st.message, st.message
        assert store.record() is None
        filler.unlink()
        # accepted with room; held once staged, the disk fills before the new model loads
        assert _offer(broker, device, path).phase == Phase.RECEIVED
        _wait(lambda: (r := store.record()) is not None and r.state == R.STAGED, "held")
        filler = fill(state, leave=MARGIN + load // 2)
        (tmp_path / "resume").touch()
        final = _wait_final(watch, device, 2)  # the refusal at the offer was the first
        assert (final.phase, final.reason_code) == (Phase.REJECTED, "no_space"), final
        assert "first load of the new model" in final.message, final.message
        assert _left_behind(state) == []  # the staged directory is removed
        assert not [p for p in cache.iterdir() if p.name.startswith(m.target_model_sha256)]
        _serves(d, "1.0.0")
        # room again: the same update commits
        filler.unlink()
        assert _offer(broker, device, path).phase == Phase.RECEIVED
        final = _wait_final(watch, device, 3)
        assert final.phase == Phase.COMMITTED and final.update_id == m.update_id, final
        _serves(d, "1.1.0")
        rec = store.record()
        assert rec is not None and rec.attempt == 1
    finally:
        assert d.stop() == 0, d.read_log()
        http.close()
        watch.close()


# ----------------------------------------------------------------------------- in process
# ENOSPC while the new model loads: the room the checks counted is gone when its prepared copy
# is written (another writer filled the disk between the last check and the load). The real
# updater, store, signing, delta and HTTP download on loopback (tests/unit/ota/
# test_update_clock.py's seam); the daemon's part "loads" a model by writing its prepared copy
# with the real `prepare_file` into a weight cache directory on a tmpfs, which the test fills
# when the update reports ACTIVATING.


class PreparingHost(FileHost):
    """`FileHost` whose load first writes the model's prepared copy into `cache` (unless an
    earlier load made it), then calls `after_load`."""

    cache: Path
    after_load: Callable[[ModelRef], None] = staticmethod(lambda ref: None)

    def install_context(self, installed: ModelRef) -> InstallContext:
        return dataclasses.replace(super().install_context(installed), cache_dir=self.cache)

    def prepare(self, ref: ModelRef) -> None:
        copy = self.cache / f"{ref.sha256}.copy.tflite"
        if not copy.exists():
            assert prepare_file(Path(ref.model_dir) / "model_int8.tflite", copy).changed

    async def activate(self, ref: ModelRef, canary: opb.Canary | None) -> None:
        self.prepare(ref)
        await super().activate(ref, canary)
        self.after_load(ref)


def test_enospc_writing_the_prepared_copy_rolls_back_no_space_and_a_retry_commits(
    models, trusted, payload, cache, tmp_path
):
    dev = device(tmp_path, models, trusted, 0.0, synced=True)
    dev.config = dataclasses.replace(dev.config, min_free_bytes=MiB)
    fillers: list[Path] = []

    def on_report(status: fpb.UpdateStatus) -> None:
        if status.phase == Phase.ACTIVATING and not fillers:  # the checks passed; now full
            fillers.append(fill(cache, leave=0))

    async def run() -> None:
        host = await start(dev, cache, on_report)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert (final.phase, final.reason_code) == (Phase.ROLLED_BACK, space.NO_SPACE), final
        assert "No space left on device" in final.message and space.AGAIN in final.message
        assert host.serving.version == 0  # the old model serves on
        rec = dev.store.record()
        assert rec is not None and (rec.state, rec.reason_code) == (R.ROLLED_BACK, "no_space")
        assert not list((dev.root / "state" / "models").iterdir())  # the built dir is gone
        target = manifest_of(rec).target_model_sha256
        assert not [p for p in cache.iterdir() if p.name.startswith(target)]  # no partial copy
        assert space.retryable(rec)  # its id is not used up
        assert manifest_of(rec).update_id not in host.updater.installed().finished
        # room again: the same update, offered again, commits
        fillers[0].unlink()
        host.final.clear()
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, (final, host.phases())
        assert host.serving.version == 1
        rec = dev.store.record()
        assert rec is not None and rec.attempt == 1

    asyncio.run(run())


def test_enospc_writing_the_pointer_to_the_loaded_model_serves_the_old_one_again(
    models, trusted, payload, small_state, tmp_path
):
    """The new model has loaded and serves; the disk fills before the pointer names it: the
    old model serves again, the new one is removed, ROLLED_BACK `no_space`, retryable."""
    dev, cache = _small_device(tmp_path, models, trusted, small_state)
    fillers: list[Path] = []

    def fill_once(ref: ModelRef) -> None:
        if ref.version == 1 and not fillers:  # another writer, right after the load
            fillers.append(fill(small_state, leave=0))

    async def run() -> None:
        host = await start(dev, cache, lambda status: None)
        host.after_load = fill_once
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert (final.phase, final.reason_code) == (Phase.ROLLED_BACK, space.NO_SPACE), final
        assert "pointer to the new model cannot be written" in final.message, final.message
        assert host.serving.version == 0  # loaded again
        assert dev.store.installed() is None  # the pointer never named the new model
        rec = dev.store.record()  # written once the new model's directory was removed
        assert rec is not None and (rec.state, rec.reason_code) == (R.ROLLED_BACK, "no_space")
        assert not list((small_state / "models").iterdir())
        fillers[0].unlink()
        host.final.clear()
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, (final, host.phases())
        assert host.serving.version == 1 and dev.store.installed() is not None

    asyncio.run(run())


def test_enospc_once_the_new_model_serves_leaves_its_trial_to_the_next_start(
    models, trusted, payload, small_state, tmp_path
):
    """The pointer names the new model and the disk fills before the record says TRIAL: no end
    can be written, and REJECTED would misreport a device serving the new model. The update
    stops (reported as progress, the new model serving); the next start continues its trial,
    and it commits."""
    dev, cache = _small_device(tmp_path, models, trusted, small_state)
    fillers: list[Path] = []

    def one_page_left(ref: ModelRef) -> None:
        """Room for the pointer's page, none for the record's after it."""
        if ref.version != 1 or fillers:
            return
        fillers.append(fill(small_state, leave=PAGE))
        while free(small_state) > PAGE:
            fillers.append(small_state / f"page-{len(fillers)}")
            fillers[-1].write_bytes(b"\0" * PAGE)
        assert free(small_state) == PAGE

    async def run() -> None:
        host = await start(dev, cache, lambda status: None)
        host.after_load = one_page_left
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        task = host.updater._task
        assert task is not None
        await asyncio.wait_for(task, test_update_clock.WAIT_S)
        assert not host.final.is_set(), host.phases()  # no end reported
        assert "the next start continues its trial" in host.reports[-1].message
        assert host.serving.version == 1
        inst = dev.store.installed()
        assert inst is not None and inst.current.version == 1  # the pointer names it
        rec = dev.store.record()
        assert rec is not None and rec.state == R.ACTIVATING  # the TRIAL record did not fit
        # a start with the disk still full: boot cannot count the trial's restart, so the
        # new model is not loaded; the last good one serves and nothing on disk moves
        record, pointer = dev.store.record(), dev.store.installed()
        full = await start(dev, cache, lambda status: None)
        assert full.serving.version == 0, full.phases()
        assert "goes on at a start with room" in full.reports[-1].message
        refused = await full.updater.offer(payload)  # the record is not what serves: no offer
        assert (refused.phase, refused.reason_code) == (Phase.REJECTED, "no_space"), refused
        assert (dev.store.record(), dev.store.installed()) == (record, pointer)
        for f in fillers:
            f.unlink()
        again = await start(dev, cache, lambda status: None)  # a restart: the trial goes on
        final = await dev.final(again)
        assert final.phase == Phase.COMMITTED, (final, again.phases())
        rec = dev.store.record()
        assert rec is not None and rec.trial_restarts == 1

    asyncio.run(run())


def test_a_start_on_a_full_disk_in_the_trial_serves_the_old_model_until_a_start_with_room(
    models, trusted, broker, state, tmp_path
):
    """The real daemon, killed in its trial (the new model serving), started again on a full
    disk: boot cannot count the trial's restart, so it serves the last good model, writes
    nothing and says why; started with room, the trial goes on and commits."""
    _, http, path = over_http(models, tmp_path, 3)
    device = "dev-full-boot"
    watch = Observer(broker, "full-boot")
    store = Store(state)
    d = _start(tmp_path, models, broker, trusted, device, pause_at="trial")
    try:
        assert _offer(broker, device, path).phase == Phase.RECEIVED
        _wait(lambda: (r := store.record()) is not None and r.state == R.TRIAL, "in its trial")
        d.signal(signal.SIGKILL)
        d.proc.wait(30)
        record, pointer = store.record(), store.installed()
        assert pointer is not None and pointer.current.version == 3
        filler = fill(state, leave=0)
        d = _start(tmp_path, models, broker, trusted, device, pause_at="")
        _serves(d, "1.0.0")
        assert "goes on at a start with room" in d.read_log()
        assert (store.record(), store.installed()) == (record, pointer)
        assert d.stop() == 0, d.read_log()
        filler.unlink()
        d = _start(tmp_path, models, broker, trusted, device, pause_at="")
        final = _wait_final(watch, device, 1)
        assert final.phase == Phase.COMMITTED, final
        _serves(d, "1.1.0")
        rec = store.record()
        assert rec is not None and rec.trial_restarts == 1  # the full start was not one
    finally:
        assert d.stop() == 0, d.read_log()
        http.close()
        watch.close()


def _small_device(tmp_path: Path, models, trusted: Path, small_state: Path):  # type: ignore[no-untyped-def]
    """The in-process device on the small tmpfs (`small_state`), keeping 1 MiB free, and its
    weight cache directory there: (device, cache directory)."""
    dev = device(tmp_path, models, trusted, 0.0, synced=True)
    dev.config = dataclasses.replace(dev.config, min_free_bytes=MiB)
    cache = small_state / "cache"
    cache.mkdir()
    return dev, cache


async def start(dev, cache: Path, on_report) -> PreparingHost:  # type: ignore[no-untyped-def]
    """What the daemon does at a start (`Device.start`), with a `PreparingHost`."""
    up = Updater(dev.store, dev.config, model_ref(dev.models.base), clock=dev.clock)
    up.boot()
    host = PreparingHost(up, on_report)
    host.cache = cache
    host.prepare(host.serving)  # as the daemon's start does
    up.attach(host)
    await up.resume()
    return host
