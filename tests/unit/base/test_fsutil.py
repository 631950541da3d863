"""agent.base.fsutil.atomic_write: the one crash-safe file replacement every part uses."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.base.fsutil import atomic_write, atomic_write_bytes, is_temp, sync_dir


def test_the_mode_is_the_one_asked_for_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        atomic_write_bytes(tmp_path / "a", b"x", mode=0o644)
        atomic_write_bytes(tmp_path / "b", b"y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o600
    assert (tmp_path / "a").read_bytes() == b"x"


def test_a_replacement_is_a_new_file_and_a_failure_leaves_the_old_one(tmp_path: Path) -> None:
    target = tmp_path / "f"
    atomic_write_bytes(target, b"old")
    with open(target, "rb") as reader:
        atomic_write(target, lambda f: f.write(b"new"), mtime_ns=10**18)
        assert reader.read() == b"old"  # a reader of the old file still sees it whole
    assert target.read_bytes() == b"new"
    assert target.stat().st_mtime_ns == 10**18

    def fail(f: object) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, fail)
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # no temp file left
    assert is_temp(".f.abc.tmp") and not is_temp("f")


def test_a_directory_is_synced_and_a_missing_one_raises(tmp_path: Path) -> None:
    sync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        sync_dir(tmp_path / "missing")
