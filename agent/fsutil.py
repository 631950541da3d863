"""Small file-system rules the daemon keeps on the host: say what a path is, and create only
the last level of a directory it was given (as systemd's ``RuntimeDirectory=`` and
``StateDirectory=`` do), never a whole path a typo made up."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from agent.errors import HostError

log = logging.getLogger(__name__)


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
    log.info("created %s %s (mode %04o)", what, path, mode)
