"""tests/support/lazyfs.py, the power-cut filesystem the power-cut tests stand on: what was
synced survives a cut, what was not does not, for file data and directory entries."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.base.fsutil import atomic_write_bytes, sync_dir
from tests.support.lazyfs import LazyFS, every_cut, mounted

pytestmark = pytest.mark.fuse


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path) as mount:
        yield mount


Mount = tuple[LazyFS, Path]


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def test_synced_data_survives_a_cut_and_unsynced_data_does_not(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    _write(mnt / "a", b"synced", sync=True)
    sync_dir(mnt)
    with open(mnt / "a", "r+b") as f:  # an overwrite after the sync, never synced
        f.write(b"LATER!")
    with open(mnt / "a", "ab") as f:
        f.write(b" and more")
    assert (mnt / "a").read_bytes() == b"LATER! and more"
    fs.cut()
    assert (mnt / "a").read_bytes() == b"synced"


def test_a_truncation_without_a_sync_is_undone(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    _write(mnt / "a", b"whole", sync=True)
    sync_dir(mnt)
    _write(mnt / "a", b"x", sync=False)  # O_TRUNC, then a write
    os.truncate(mnt / "a", 0)
    fs.cut()
    assert (mnt / "a").read_bytes() == b"whole"


def test_a_created_file_needs_its_directory_synced(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    _write(mnt / "unnamed", b"data", sync=True)  # data synced, the entry not
    fs.cut()
    assert not (mnt / "unnamed").exists()

    _write(mnt / "named", b"data", sync=True)
    sync_dir(mnt)
    fs.cut()
    assert (mnt / "named").read_bytes() == b"data"


def test_an_entry_synced_without_its_data_comes_back_empty(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    _write(mnt / "f", b"never synced", sync=False)
    sync_dir(mnt)
    fs.cut()
    assert (mnt / "f").read_bytes() == b""


def test_a_rename_and_an_unlink_need_their_directory_synced(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    _write(mnt / "old", b"old", sync=True)
    _write(mnt / "gone", b"gone", sync=True)
    _write(mnt / ".tmp", b"new", sync=True)
    sync_dir(mnt)
    os.replace(mnt / ".tmp", mnt / "old")
    os.unlink(mnt / "gone")
    assert (mnt / "old").read_bytes() == b"new"
    fs.cut()  # neither was synced: both undone
    assert sorted(p.name for p in mnt.iterdir()) == [".tmp", "gone", "old"]
    assert (mnt / "old").read_bytes() == b"old"
    assert (mnt / "gone").read_bytes() == b"gone"

    os.replace(mnt / ".tmp", mnt / "old")
    os.unlink(mnt / "gone")
    sync_dir(mnt)
    fs.cut()
    assert sorted(p.name for p in mnt.iterdir()) == ["old"]
    assert (mnt / "old").read_bytes() == b"new"


def test_a_new_directory_needs_its_parent_synced(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    (mnt / "d").mkdir()
    atomic_write_bytes(mnt / "d" / "f", b"in d")  # syncs d, not d's entry in the root
    fs.cut()
    assert not (mnt / "d").exists()

    (mnt / "d").mkdir()
    sync_dir(mnt)
    atomic_write_bytes(mnt / "d" / "f", b"in d")
    fs.cut()
    assert (mnt / "d" / "f").read_bytes() == b"in d"


def test_the_power_goes_off_at_a_boundary_and_comes_back_with_the_cut(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    fs.fail_after(2)
    _write(mnt / "a", b"a", sync=True)  # create, fsync: the two boundaries allowed
    with pytest.raises(OSError) as err:
        sync_dir(mnt)
    assert err.value.errno == errno.EIO
    assert fs.dead
    with pytest.raises(OSError):
        (mnt / "a").read_bytes()
    assert fs.trace == ["create /a", "fsync /a"]
    fs.cut()
    assert not fs.dead
    assert list(mnt.iterdir()) == []  # the entry was never synced


def test_every_cut_replays_an_atomic_write_at_each_boundary(lazyfs: Mount) -> None:
    fs, mnt = lazyfs
    seen: list[bytes] = []

    def setup(m: Path) -> None:
        atomic_write_bytes(m / "f", b"old")

    def operation(m: Path, done: list[object]) -> None:
        atomic_write_bytes(m / "f", b"new")
        done.append("written")

    def check(m: Path, done: list[object], where: str) -> None:
        data = (m / "f").read_bytes()
        assert data in (b"old", b"new"), where
        if done:
            assert data == b"new", where
        seen.append(data)

    points = every_cut(fs, mnt, setup, operation, check)
    # create, fsync, rename, fsync of the directory; and the end
    assert points == 5
    assert seen == [b"old", b"old", b"old", b"old", b"new"]
