"""The KV disk tier across a power cut at every fsync/rename boundary (tests/support/lazyfs.py)
and on a full disk: a saved session loads back bit for bit or fails its checksum, never as
another session's or an older save's rows mixed in; a save that returned ok survives; a spill
the disk cannot hold drops that session's disk copy and leaves the index true to the disk."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.base.errors import SessionLost
from agent.kv.disk import DiskTier
from agent.kv.snapshot import KVSnapshot
from tests.support.lazyfs import LazyFS, every_cut, mounted

MODEL = hashlib.sha256(b"model").hexdigest()
MIB = 1 << 20


def _snapshot(rows: int, seed: int) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    arrays = {"kv_cache_k_0": rng.standard_normal((1, 2, rows, 8), dtype=np.float32)}
    return KVSnapshot(MODEL, tuple(range(seed, seed + rows)), arrays)


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path) as mount:
        yield mount


@pytest.mark.fuse
def test_saved_sessions_load_whole_or_fail_their_checksum_at_any_cut(
    lazyfs: tuple[LazyFS, Path],
) -> None:
    fs, mnt = lazyfs
    state = mnt / "state"
    versions: dict[str, list[KVSnapshot]] = {
        "a": [_snapshot(3, 1), _snapshot(40, 2)],
        "b": [_snapshot(5, 3)],
    }

    def setup(m: Path) -> None:
        state.mkdir()

    def operation(m: Path, done: list[Any]) -> None:
        tier = DiskTier(state, MODEL, MIB)  # the first start: makes sessions/
        for key, snap in [
            ("a", versions["a"][0]),
            ("b", versions["b"][0]),
            ("a", versions["a"][1]),
        ]:
            if tier.put(key, snap, {"owner": "u"}).ok:
                done.append((key, snap))
        tier.get("b")  # touches its mtime (the LRU order), unsynced
        if tier.delete("a"):
            done.append(("a", None))

    problems: list[str] = []

    def check(m: Path, done: list[Any], where: str) -> None:
        tier = DiskTier(state, MODEL, MIB)  # the boot's scan
        for key in [e.key for e in tier.entries()]:
            try:
                snap, _ = tier.get(key)
            except SessionLost:
                continue  # a checksum failure is fine
            if not any(snap.same_as(v) for v in versions[key]):
                problems.append(f"{where}: session {key} loads rows it was never saved with")
        last: dict[str, KVSnapshot | None] = dict(done)
        for key, saved in last.items():
            if saved is None:
                continue  # deleted: it may come back (the unlink was not synced), whole
            if key not in tier:
                problems.append(f"{where}: session {key} was saved (ok) and is gone")

    points = every_cut(fs, mnt, setup, operation, check)
    assert problems == [], "\n".join(problems[:8])
    assert points > 10


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _fill(path: Path, leave: int) -> None:
    """Write `path` until the filesystem has about `leave` bytes free."""
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            st = os.statvfs(path.parent)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                break
            f.write(b"\0" * min(64 << 10, free - leave))
            f.flush()


def test_a_spill_the_full_disk_cannot_hold_drops_that_session_only(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(small_disk, MODEL, 8 * MIB)
    keep, old = _snapshot(4, 1), _snapshot(4, 2)
    assert tier.put("keep", keep, {}).ok
    assert tier.put("spill", old, {}).ok  # an older copy of the session that spills again
    _fill(small_disk / "filler", leave=32 << 10)
    with caplog.at_level(logging.INFO, logger="agent.kv.disk"):
        stored = tier.put("spill", _snapshot(2000, 3), {})  # ~64 KB: does not fit
    assert not stored.ok
    assert "full" in stored.reason
    lines = [r for r in caplog.records if "spill" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert tier.keys() == ["keep"]  # the older copy is dropped: it is not the session now
    assert sorted(os.listdir(small_disk / "sessions")) == ["keep.kv"]  # no temp file left
    assert DiskTier(small_disk, MODEL, 8 * MIB).keys() == ["keep"]  # the index is the disk's
    snap, _ = tier.get("keep")
    assert snap.same_as(keep)
