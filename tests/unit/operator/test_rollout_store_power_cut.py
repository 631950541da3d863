"""The operator's rollout store (SQLite, WAL, synchronous=FULL) across a power cut at every
fsync/rename boundary (tests/support/lazyfs.py): from the directory's first creation through a
rollout's create, the saves before each offer and after statuses, a pause request and its
carrying out. After each cut a new process's view (a fresh store) reads the rollout whole: as
the last save that returned, or the one that was under way, never older (a device marked
offered stays offered: an update is never sent twice) and never an unreadable database; a
request whose writing returned is still pending unless it was carried out."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.operator.rollout.state import Device, Rollout, RolloutError, Status
from agent.operator.rollout.store import RolloutStore
from tests.support.lazyfs import LazyFS, every_cut, mounted
from tests.unit.operator.test_rollout_store import rollout

pytestmark = pytest.mark.fuse

DEVICES = 6


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path) as mount:
        yield mount


def _offered(r: Rollout, i: int) -> Rollout:
    new = Device(f"d{i:05d}", 0, Status.OFFERED, attempt=1, offered_unix=r.updated_unix)
    return dataclasses.replace(r, devices=(*r.devices, new), updated_unix=r.updated_unix + 1)


def _committed(r: Rollout, i: int) -> Rollout:
    devs = list(r.devices)
    devs[i] = dataclasses.replace(devs[i], status=Status.COMMITTED, phase="COMMITTED")
    return dataclasses.replace(r, devices=tuple(devs), updated_unix=r.updated_unix + 1)


def _operation(where: Path, done: list[Any]) -> None:
    """A rollout as its process writes it; `done` gets ("try", r) before each write and
    ("saved", r) / ("requested", what) / ("carried out", what) when a call returned."""
    store = RolloutStore(where)
    try:
        r = rollout(0, rollout_id="r1")  # devices are added as they are offered
        done.append(("try", r))
        store.create(r)
        done.append(("saved", r))
        for i in range(DEVICES):
            r = _offered(r, i)  # saved before the offer is sent
            done.append(("try", r))
            store.save(r)
            done.append(("saved", r))
            if i % 2:
                r = _committed(r, i - 1)
                done.append(("try", r))
                store.save(r)
                done.append(("saved", r))
            if i == 2:
                store.request("r1", "pause")
                done.append(("requested", "pause"))
            if i == 4:
                store.done("r1", "pause")
                done.append(("carried out", "pause"))
    finally:
        with contextlib.suppress(sqlite3.Error, OSError):
            store.close()


def _check(where: Path, done: list[Any]) -> list[str]:
    """Open the store as a new operator process does; what is wrong."""
    saved = [r for what, r in done if what == "saved"]
    tried = [r for what, r in done if what == "try"]
    store = RolloutStore(where)
    try:
        got = store.load("r1")
    except RolloutError as exc:
        if saved or "no rollout r1" not in str(exc):
            return [f"unreadable: {exc}"]
        return []  # the create never returned and did not land: nothing was promised
    finally:
        store.close()
    wrong = []
    allowed = saved[-1:] + tried[len(saved) :]  # the last that returned, or the one under way
    if got not in allowed:
        wrong.append(
            f"read back a rollout with offered {_offers(got)}, expected one of "
            f"{[_offers(r) for r in allowed]}"
        )
    requested = ("requested", "pause") in done
    carried = ("carried out", "pause") in done
    pending = RolloutStore(where).pending("r1")
    if requested and not carried and "pause" not in pending:
        wrong.append("a pause request that was written is gone")
    if carried and pending:
        wrong.append(f"a carried-out request came back: {pending}")
    return wrong


def _offers(r: Rollout) -> list[str]:
    return [d.device_id for d in r.devices]


def test_the_rollout_reads_back_whole_after_a_cut_at_any_point(
    lazyfs: tuple[LazyFS, Path],
) -> None:
    fs, mnt = lazyfs
    where = mnt / "operator" / "rollouts"
    problems: list[str] = []

    def setup(m: Path) -> None:
        (m / "operator").mkdir()

    def check(m: Path, done: list[Any], at: str) -> None:
        problems.extend(f"{at}: {p}" for p in _check(where, done))

    points = every_cut(fs, mnt, setup, lambda m, done: _operation(where, done), check)
    assert points > 20
    assert problems == [], "\n".join(problems[:8])
