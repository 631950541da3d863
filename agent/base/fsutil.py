"""Small file-system rules the daemon keeps on the host: say what a path is, create only
the last level of a directory it was given (as systemd's ``RuntimeDirectory=`` and
``StateDirectory=`` do), never a whole path a typo made up, and replace files crash-safely.

Crash-safe file replacement (`atomic_write`, the one every part uses): temp file beside the
target, its mode, fsync, rename, fsync the directory.
After a crash the target holds either its old or its new content, never a mix. A crash
mid-write can leave a temp file (``.<name>.<random>.tmp``); `is_temp` recognises those so
that a startup scan can delete them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from agent.base.errors import HostError

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"


def kind_of(path: Path) -> str:
    """What `path` is, without following a symbolic link at the end: "nothing" when it does not
    exist, else "a unix socket", "a regular file", "a directory", "a symbolic link to ...", ..."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "nothing"
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"a symbolic link to {target}"
    if stat.S_ISSOCK(mode):
        return "a unix socket"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "a file of another type"


def check_last_level(path: Path, what: str) -> bool:
    """Check that directory `path` exists, or that it can be made by creating its last level
    alone; returns whether it exists. Raises HostError naming `what` (e.g. "the socket's
    directory") otherwise. Changes nothing."""
    kind = kind_of(path)
    if kind == "a directory" or (kind.startswith("a symbolic link") and path.is_dir()):
        return True
    if kind != "nothing":
        raise HostError(f"{what} {path} is {kind}, not a directory")
    parent = path.parent
    if not parent.is_dir():
        raise HostError(
            f"{what} {path} does not exist and neither does its parent {parent}: edge-agent "
            "creates only the last level of a directory (as systemd's RuntimeDirectory= and "
            "StateDirectory= do); create the parent first or give another path"
        )
    return False


def ensure_last_level(path: Path, what: str, mode: int) -> None:
    """Make directory `path` with `mode` when it is missing and its parent exists (nothing else
    is created); see `check_last_level` for what is refused."""
    if check_last_level(path, what):
        return
    try:
        os.mkdir(path, mode)
    except FileExistsError:  # made meanwhile (by another start, or systemd): check what it is
        check_last_level(path, what)
        return
    except OSError as exc:
        raise HostError(f"{what} {path} cannot be created: {exc.strerror}") from exc
    os.chmod(path, mode)  # mkdir's mode goes through the umask
    sync_dir(path.parent)  # until then a power cut may take the directory and all put in it
    log.info("created %s %s (mode %04o)", what, path, mode)


def make_dirs(path: Path, mode: int = 0o777) -> None:
    """``mkdir -p`` that survives a power cut: `path` with `mode` (its missing parents with
    the default mode, as `Path.mkdir(parents=True)`), each level it creates synced into its
    parent — until then a cut may take the new directory, and all that was written into it.
    `path`'s own parent is synced even when nothing was created (a process that crashed
    between its mkdir and the sync may have left it unsynced)."""
    missing: list[Path] = []
    level = path
    while not level.is_dir() and level != level.parent:
        missing.append(level)
        level = level.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode if d == path else 0o777)
        except FileExistsError:
            if not d.is_dir():
                raise
        sync_dir(d.parent)
    if not missing:
        sync_dir(path.parent)


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

    The temp file is created exclusively (it is never someone else's file) and its mode set on
    the open file, whatever the umask, before the data is synced. Raises the `OSError` of a
    failed step (the directory's sync: `sync_dir`); the temp file is removed whatever fails.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    sync_dir(path.parent)


# a directory this process may not open, or whose filesystem does not sync directories
_NO_DIR_SYNC = frozenset({errno.EACCES, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


def sync_dir(path: Path) -> None:
    """fsync directory `path`, so that a rename in it survives a crash. A directory that cannot
    be synced (`_NO_DIR_SYNC`) is let be; any other failure (an I/O error) raises."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_SYNC:
            raise


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """`atomic_write` of a bytes value."""

    def write(f: IO[bytes]) -> None:
        f.write(data)

    atomic_write(path, write, mode=mode)
