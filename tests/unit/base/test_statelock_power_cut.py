"""The state lock across a power cut at every boundary of a first start (tests/support/lazyfs.py):
the next boot takes the lock (no stale holder refuses it), and the state directory the lock
made still holds what was saved in it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.base.fsutil import atomic_write_bytes
from agent.base.statelock import StateLock
from tests.support.lazyfs import LazyFS, every_cut, mounted

pytestmark = pytest.mark.fuse


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path) as mount:
        yield mount


def test_the_lock_and_its_directory_survive_any_cut(lazyfs: tuple[LazyFS, Path]) -> None:
    fs, mnt = lazyfs
    state = mnt / "var-lib" / "edge-agent"

    def setup(m: Path) -> None:
        (mnt / "var-lib").mkdir()

    def operation(m: Path, done: list[Any]) -> None:
        lock = StateLock.acquire(state)
        try:
            atomic_write_bytes(state / "saved", b"state")  # anything a part persists
            done.append("saved")
        finally:
            lock.release()

    problems: list[str] = []

    def check(m: Path, done: list[Any], where: str) -> None:
        lock = StateLock.acquire(state)  # raises if the directory or the lock is unusable
        lock.release()
        if done and not (state / "saved").is_file():
            problems.append(f"{where}: the state directory lost what was saved in it")

    assert every_cut(fs, mnt, setup, operation, check) > 5
    assert problems == [], "\n".join(problems[:8])
