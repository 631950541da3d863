"""An update's persisted steps across a power cut at every fsync/rename boundary
(tests/support/lazyfs.py): the record, the download, the staged model directory, the
pointer switch and the cleanup, in the updater's order, on a state directory that has never
held an update. After each cut the state is re-opened as the daemon's boot does
(`Updater.boot`): the model it serves is whole, old or new; the record reads back at the state
last saved or later; a pointer switch that returned holds."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.config.file import UpdatesConfig
from agent.ota.artifact.bundle import make_bundle, read_bundle
from agent.ota.cleanup import Cleanup
from agent.ota.fetch import fetch_blocks
from agent.ota.reports import manifest_of
from agent.ota.staging import stage
from agent.ota.store import Installed, ModelRef, Store
from agent.ota.updater import Updater
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.fleetsim import make_model_dir, model_ref
from tests.support.lazyfs import LazyFS, every_cut, mounted

pytestmark = pytest.mark.fuse

R = opb.UpdateRecord
_KEY = Ed25519PrivateKey.generate()


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path / "fs") as mount:
        yield mount


class _Blocks:
    """The payload served in blocks, as the fleet link does."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def fetch_block(self, request: opb.BlockRequest, timeout_s: float) -> opb.Block | None:
        end = request.offset + request.length
        return opb.Block(data=self.data[request.offset : end], total=len(self.data))


class _Update:
    """One signed update from `base` to `target`: its record, manifest and payload."""

    def __init__(self, base: Path, target: Path, bundle: Path, version: int, uid: str) -> None:
        make_bundle(base, target, [_KEY], bundle, version=version, update_id=uid)
        self.signed, payload = read_bundle(bundle)
        with open(payload.path, "rb") as f:
            f.seek(payload.offset)
            self.data = f.read(payload.size)
        self.m = manifest_of(opb.UpdateRecord(signed=self.signed))
        self.version = version
        self.name = load_version(target)

    def apply(
        self, store: Store, previous: ModelRef, shipped: ModelRef, done: list[Any]
    ) -> ModelRef:
        """The updater's persisted steps, in its order, from `previous` (the serving model,
        the last good one); the new model's reference."""
        m = self.m
        rec = R(signed=self.signed, state=R.RECEIVED, previous_model_dir=previous.model_dir)
        before = store.installed() or Installed(shipped)

        def enter(s: int) -> None:
            rec.state = s  # type: ignore[assignment]
            store.save(rec)
            done.append(("record", s))

        enter(R.RECEIVED)
        enter(R.DOWNLOADING)
        part = store.payload_path(m.update_id)
        blocks = _Blocks(self.data)
        fetch_blocks(blocks, m.update_id, part, len(self.data), lambda n: None, threading.Event())
        enter(R.VERIFIED)
        asyncio.run(stage(store, rec, m))
        enter(R.STAGED)
        enter(R.ACTIVATING)
        ref = ModelRef(
            rec.staged_model_dir, m.quantization, m.target_model_sha256, self.version, self.name
        )
        store.switch(Installed(ref, previous, before.finished))
        done.append(("pointer", ref.sha256))
        enter(R.TRIAL)
        store.switch(Installed(ref, ref, (*before.finished, m.update_id)))
        enter(R.COMMITTED)
        Cleanup(store, lambda: store.installed() or Installed(shipped)).complete(rec)
        return ref


def load_version(directory: Path) -> str:
    from agent.model.directory import load_model_dir

    return load_model_dir(directory).version


def test_an_update_leaves_a_whole_model_at_any_cut(
    lazyfs: tuple[LazyFS, Path], tmp_path: Path
) -> None:
    fs, mnt = lazyfs
    old = make_model_dir(tmp_path / "v0")  # the shipped model, outside the state directory
    new = make_model_dir(tmp_path / "v1", version="1.1.0", seed=1)
    update = _Update(old, new, tmp_path / "u.bundle", 1, "u1")
    m = update.m
    shipped = model_ref(old)
    state = mnt / "state"

    def setup(m_: Path) -> None:
        state.mkdir()

    def operation(m_: Path, done: list[Any]) -> None:
        update.apply(Store(state), shipped, shipped, done)

    problems: list[str] = []

    def check(m_: Path, done: list[Any], where: str) -> None:
        store = Store(state)
        rec = store.record()
        saved = [s for what, s in done if what == "record"]
        if saved and (rec is None or rec.state < saved[-1]):
            got = "nothing" if rec is None else R.State.Name(rec.state)
            problems.append(f"{where}: record {got}, {R.State.Name(saved[-1])} was saved")
        switched = [sha for what, sha in done if what == "pointer"]
        inst = store.installed()
        if switched and (inst is None or inst.current.sha256 != switched[-1]):
            problems.append(f"{where}: the pointer switch to the new model was lost")
        served = Updater(store, UpdatesConfig(), shipped).boot()
        whole = served.verify() is None
        if not whole or served.sha256 not in (shipped.sha256, m.target_model_sha256):
            problems.append(f"{where}: serves {served} ({served.verify()})")
        if R.COMMITTED in saved and served.sha256 != m.target_model_sha256:
            problems.append(f"{where}: committed, but serves the old model")

    points = every_cut(fs, mnt, setup, operation, check)
    assert points > 30
    assert problems == [], "\n".join(problems[:10])
