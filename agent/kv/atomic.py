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


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], mtime_ns: int) -> None:
    """Replace `path` (mode 0600) with what `write` writes, with modification time `mtime_ns`.

    Raises the `OSError` of a failed step; the temp file is removed whatever fails.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
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
