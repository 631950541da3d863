"""Crash-safe file replacement: temp file beside the target, fsync, rename, fsync the directory.

After a crash the target holds either its old or its new content, never a mix. A crash
mid-write can leave a temp file (``.<name>.<random>.tmp``); `is_temp` recognises those so
that a startup scan can delete them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

TEMP_SUFFIX = ".tmp"


def is_temp(name: str) -> bool:
    """True for the name of a temp file that `atomic_write` left behind."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], None],
    mtime_ns: int | None = None,
    mode: int = 0o600,
) -> None:
    """Replace `path` (`mode`, 0600 by default) with what `write` writes; with modification
    time `mtime_ns` when given.

    Raises the `OSError` of a failed step; the temp file is removed whatever fails.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        if mode != 0o600:  # mkstemp's
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # Durability of the rename is best effort: some filesystems refuse fsync on a directory.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """`atomic_write` of a bytes value."""

    def write(f: IO[bytes]) -> None:
        f.write(data)

    atomic_write(path, write, mode=mode)
