"""A second update across a power cut at every fsync/rename boundary (tests/support/lazyfs.py):
the state directory already committed one update, so the pointer names a model the store built
and keeps as the last known good, and the second update's delta starts from that directory.
After each cut the state is re-opened as the daemon's boot does (`Updater.boot`): the model it
serves is whole and is the first update's or the second's, never the shipped one (a last good
model was there all along); the record reads back at the state last saved or later; a pointer
switch that returned holds; the pointer names a model that verifies."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.config.file import UpdatesConfig
from agent.ota.store import Installed, ModelRef, Store
from agent.ota.updater import Updater
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.fleetsim import make_model_dir, model_ref
from tests.support.lazyfs import LazyFS, every_cut, mounted
from tests.unit.ota.test_power_cut import _Update

pytestmark = pytest.mark.fuse

R = opb.UpdateRecord


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path / "fs") as mount:
        yield mount


def test_a_second_update_leaves_a_whole_model_at_any_cut(
    lazyfs: tuple[LazyFS, Path], tmp_path: Path
) -> None:
    fs, mnt = lazyfs
    v0 = make_model_dir(tmp_path / "v0")  # the shipped model, outside the state directory
    v1 = make_model_dir(tmp_path / "v1", version="1.1.0", seed=1)
    v2 = make_model_dir(tmp_path / "v2", version="1.2.0", seed=2)
    first = _Update(v0, v1, tmp_path / "u1.bundle", 1, "u1")
    second = _Update(v1, v2, tmp_path / "u2.bundle", 2, "u2")
    shipped = model_ref(v0)
    state = mnt / "state"
    good: list[ModelRef] = []

    snapshot = tmp_path / "after-first"

    def setup(m_: Path) -> None:
        """The state after the first update, made once and copied back for each cut point
        (`every_cut` makes it durable)."""
        if good:
            shutil.copytree(snapshot, state, symlinks=True)
            return
        state.mkdir()
        store = Store(state)
        ref = first.apply(store, shipped, shipped, [])
        assert store.installed() == Installed(ref, ref, ("u1",))
        good[:] = [ref]
        shutil.copytree(state, snapshot, symlinks=True)

    def operation(m_: Path, done: list[Any]) -> None:
        second.apply(Store(state), good[0], shipped, done)

    problems: list[str] = []
    wanted = (first.m.target_model_sha256, second.m.target_model_sha256)

    def check(m_: Path, done: list[Any], where: str) -> None:
        store = Store(state)
        rec = store.record()
        saved = [s for what, s in done if what == "record"]
        if rec is None:
            problems.append(f"{where}: no record (the first update's was committed)")
        elif saved and (rec.signed != second.signed or rec.state < saved[-1]):
            problems.append(f"{where}: record {R.State.Name(rec.state)} after {saved[-1]}")
        switched = [sha for what, sha in done if what == "pointer"]
        inst = store.installed()
        if inst is None:
            problems.append(f"{where}: the pointer is gone")
            return
        if switched and inst.current.sha256 != switched[-1]:
            problems.append(f"{where}: the pointer switch to the new model was lost")
        served = Updater(store, UpdatesConfig(), shipped).boot()
        if served.verify() is not None or served.sha256 not in wanted:
            problems.append(f"{where}: serves {served} ({served.verify()})")
        if R.COMMITTED in saved and served.sha256 != second.m.target_model_sha256:
            problems.append(f"{where}: committed, but serves the old model")
        after = store.installed()
        if after is None or after.current.verify() is not None:
            problems.append(f"{where}: the pointer names no whole model: {after}")
        elif after.last_good is not None and after.last_good.verify() is not None:
            problems.append(f"{where}: the last good model is not whole: {after.last_good}")

    points = every_cut(fs, mnt, setup, operation, check)
    assert points > 30, points
    assert problems == [], "\n".join(problems[:10])
