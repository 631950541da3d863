"""A full disk never costs the device its model (issue 35, docs/UPDATES.md): the state directory
is a real tmpfs of its own; an update offered with too little room is refused at once with
`no_space`; one that meets ENOSPC while it downloads, patches the new model directory or writes
its record is rejected `no_space`, reported, and leaves nothing behind, while the daemon goes on
serving the model it had; the same update offered again once there is room commits. A real
daemon, a real mosquitto, a real HTTP server on loopback (the update is held at a state by the
fault injection's pause point while the test fills the disk)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.fleet.topics import Topics
from agent.operator.client import send
from agent.ota.artifact.bundle import read_bundle
from agent.ota.faults import PAUSE_ENV, RESUME_ENV
from agent.ota.store import Store
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.daemon_harness import Daemon
from tests.support.tmpfs import fill, tmpfs
from tests.system import test_updates
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import _req, _signed, config, over_http, statuses

# the update tests' module fixtures: the tiny model and its fine-tune, the trusted key, mosquitto
models, trusted, broker = test_updates.models, test_updates.trusted, test_updates.broker
big_models = test_updates.big_models

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
