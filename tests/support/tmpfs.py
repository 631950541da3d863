"""A small real filesystem for the full-disk tests: a tmpfs of a given size mounted on a
directory (root only), resized in place, and a filler file that takes all but a given number of
its bytes."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = 4096


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """`path` (created) with a tmpfs of `size` bytes on it, unmounted on the way out."""
    if os.geteuid() != 0:
        pytest.fail("the full-disk tests mount a tmpfs: run them as root (marker `root`)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave: int, name: str = "filler") -> Path:
    """Write `path`/`name` until about `leave` bytes (rounded down to pages) are free."""
    filler = path / name
    block = b"\0" * (1 << 20)
    with open(filler, "ab", buffering=0) as f:
        # again while the daemon frees something meanwhile (a temp file it renamed or removed)
        for _ in range(100):
            want = free(path) - leave
            if want <= PAGE:
                break
            while want > 0:
                try:
                    want -= f.write(block[: min(len(block), want)]) or 0
                except OSError:  # the last pages: the page rounding of tmpfs
                    break
    assert free(path) <= leave + PAGE, (free(path), leave)
    return filler


@pytest.fixture
def one_mib_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of the test's own (the full-disk tests of small writers)."""
    with tmpfs(tmp_path / "fs", 1 << 20) as path:
        yield path
