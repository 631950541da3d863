"""The rollout store (agent/operator/rollout/store.py): SQLite in WAL mode, a row per device, so
that a save writes what changed; what any sequence of saves leaves is read back exactly, by this
process or another; an older version's `<id>.json` is read and copied in, and left in place."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.operator.rollout import plan
from agent.operator.rollout.state import Device, Rollout, RolloutError, Status, to_json
from agent.operator.rollout.store import DB_NAME, RolloutStore
from tests.unit.operator.test_rollout_plan import T0, spec


def devices(n: int) -> tuple[Device, ...]:
    return tuple(Device(f"d{i:05d}", 0, Status.OFFERED, attempt=1) for i in range(n))


def rollout(n: int, rollout_id: str = "r1") -> Rollout:
    r = plan.create(spec(rollout_id=rollout_id), T0)
    return dataclasses.replace(r, devices=devices(n))


def changed(r: Rollout, index: int, status: Status = Status.COMMITTED) -> Rollout:
    devs = list(r.devices)
    devs[index] = dataclasses.replace(devs[index], status=status, phase="COMMITTED")
    return dataclasses.replace(r, devices=tuple(devs), updated_unix=r.updated_unix + 1)


def test_a_save_writes_the_device_that_changed_not_the_whole_rollout(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path)
    r = rollout(5000)
    store.create(r)
    wal = tmp_path / f"{DB_NAME}-wal"
    whole = wal.stat().st_size  # the create wrote every device
    assert whole > 300_000
    for i in range(20):
        before = wal.stat().st_size
        r = changed(r, i * 97)
        store.save(r)
        assert wal.stat().st_size - before <= 5 * 4096  # a few pages, not 5,000 devices
    assert RolloutStore(tmp_path).load("r1") == r
    store.close()
    assert RolloutStore(tmp_path).load("r1") == r


def test_the_database_is_in_wal_mode_and_private(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "rollouts")
    store.create(rollout(3))
    db = tmp_path / "rollouts" / DB_NAME
    assert oct(db.stat().st_mode & 0o777) == "0o600"
    with sqlite3.connect(db) as other:
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    store.close()


def test_a_save_after_another_process_wrote_writes_the_whole_rollout(tmp_path: Path) -> None:
    first, second = RolloutStore(tmp_path), RolloutStore(tmp_path)
    r = rollout(50)
    first.create(r)
    theirs = changed(second.load("r1"), 3)
    second.save(theirs)
    mine = dataclasses.replace(changed(r, 7), devices=r.devices[:40])  # also drops ten
    first.save(mine)
    assert RolloutStore(tmp_path).load("r1") == mine  # not a mix of the two
    second.save(changed(theirs, 9))  # and the other way round
    assert RolloutStore(tmp_path).load("r1") == changed(theirs, 9)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["change", "drop", "add"])),
                max_size=30), st.integers(0, 2**32))  # fmt: skip
def test_any_sequence_of_saves_reads_back_as_the_last(
    edits: list[tuple[int, str]], seed: int
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        store = RolloutStore(Path(tmp))
        r = rollout(20, rollout_id=f"r{seed}")
        store.create(r)
        for i, what in edits:
            devs = {d.device_id: d for d in r.devices}
            key = f"d{i:05d}"
            if what == "drop":
                devs.pop(key, None)
            elif what == "add" or key not in devs:
                devs[key] = Device(key, 1, Status.OFFERED, attempt=1, offered_unix=T0 + i)
            else:
                devs[key] = dataclasses.replace(devs[key], status=Status.FAILED, reason="x")
            r = dataclasses.replace(
                r, devices=tuple(sorted(devs.values(), key=lambda d: d.device_id))
            )
            store.save(r)
        assert RolloutStore(Path(tmp)).load(r.spec.rollout_id) == r
        store.close()


def test_an_older_json_rollout_is_read_copied_in_and_left_in_place(tmp_path: Path) -> None:
    r = rollout(30, rollout_id="r-old")
    old = tmp_path / "r-old.json"
    text = json.dumps(to_json(r), indent=1, sort_keys=True) + "\n"
    old.write_text(text)
    store = RolloutStore(tmp_path)
    assert store.ids() == ["r-old"] and store.exists("r-old")
    assert store.load("r-old") == r
    later = changed(r, 2)
    store.save(later)
    store.close()
    assert old.read_text() == text  # never rewritten, never deleted
    again = RolloutStore(tmp_path)
    assert again.load("r-old") == later  # the database's copy wins from now on
    assert again.ids() == ["r-old"]
    again.create(rollout(2, rollout_id="r-new"))
    assert again.ids() == ["r-new", "r-old"]
    again.close()


def test_reading_creates_nothing(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "nope")
    assert store.ids() == [] and not store.exists("r1")
    with pytest.raises(RolloutError, match="no rollout r1"):
        store.load("r1")
    assert not (tmp_path / "nope").exists()
    (tmp_path / "nope").mkdir()
    with pytest.raises(RolloutError, match="no rollout r1"):
        RolloutStore(tmp_path / "nope").load("r1")
    assert list((tmp_path / "nope").iterdir()) == []
