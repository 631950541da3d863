"""The daemon's unix socket path: what may be removed before binding and after serving.

gRPC itself unlinks whatever *socket* is at the path before it binds, live or not, so these
checks come first:

* only a path that ``lstat`` says is a socket is ever unlinked; a regular file, a directory or
  a symbolic link (to anything) is refused, and left as it is;
* a socket that something answers on is live: refused, naming the listener's pid
  (``SO_PEERCRED``); only a stale one (connection refused) is removed;
* the socket's directory is created only as its last level (as ``RuntimeDirectory=`` would),
  never a whole missing path;
* a path longer than ``sun_path`` holds is refused before anything happens;
* at shutdown the socket is removed only if it is still the one this process bound (same
  device and inode), never one another process put there since.

Two daemons binding at the same moment are kept apart by an ``flock`` on the socket's
directory around check-and-bind (`bind_guard`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.base.errors import AlreadyRunning, HostError
from agent.base.fsutil import check_last_level, ensure_last_level, kind_of

log = logging.getLogger(__name__)

MAX_PATH_BYTES: Final = 107  # sockaddr_un.sun_path is 108 bytes on Linux, NUL included
SOCKET_DIR_MODE: Final = 0o755  # systemd's default RuntimeDirectoryMode=
_PROBE_TIMEOUT_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class BoundSocket:
    """The socket this process bound, as the file system knows it."""

    path: Path
    device: int
    inode: int


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid: int = struct.unpack("3i", creds)[0]
    return pid or None


def _describe(pid: int | None) -> str:
    if pid is None:
        return "a process whose pid could not be read"
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid {pid}"
    return f"pid {pid}, {name}"


def probe(path: Path) -> tuple[bool, int | None]:
    """Whether something accepts connections on socket `path`, and its pid when it does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(_PROBE_TIMEOUT_S)
        try:
            s.connect(os.fsencode(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False, None
        except (BlockingIOError, TimeoutError):  # a listener with a full backlog: it is there
            return True, None
        except OSError as exc:
            raise HostError(
                f"socket {path}: cannot tell whether a daemon listens on it ({exc.strerror}); "
                "left as it is"
            ) from exc
        return True, _peer_pid(s)


def check(path: Path) -> bool:
    """Refuse a socket path that cannot be used without harm (see the module's docstring);
    returns whether a stale socket is there to be removed. Changes nothing."""
    size = len(os.fsencode(path))
    if size > MAX_PATH_BYTES:
        raise HostError(
            f"socket path {path} is {size} bytes; a unix socket path holds at most "
            f"{MAX_PATH_BYTES} (AF_UNIX): choose a shorter one"
        )
    check_last_level(path.parent, "the socket's directory")
    kind = kind_of(path)
    if kind == "nothing":
        return False
    if kind != "a unix socket":
        raise HostError(
            f"socket path {path} is {kind}, not a unix socket; edge-agent removes only a stale "
            "socket and leaves this as it is: give --socket (or server.socket) another path"
        )
    live, pid = probe(path)
    if live:
        raise AlreadyRunning(
            f"socket {path} is in use: {_describe(pid)} answers on it; stop that daemon, or "
            "give this one another --socket"
        )
    return True


@contextlib.contextmanager
def bind_guard(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the socket's directory while it is checked, a stale socket is
    removed and the new one is bound: a second daemon starting at the same moment waits and
    then sees the first one's live socket. The directory's last level is created first."""
    ensure_last_level(path.parent, "the socket's directory", SOCKET_DIR_MODE)
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"the socket's directory {path.parent}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if check(path):
            remove_stale(path)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_stale(path: Path) -> None:
    """Unlink the stale socket `check` found (still a socket: checked again just before)."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise HostError(f"socket path {path} changed under us; left as it is")
    os.unlink(path)
    log.info("removed stale socket %s (nothing answered on it)", path)


def bound(path: Path) -> BoundSocket:
    """What the file system says about the socket this process has just bound."""
    st = os.lstat(path)
    return BoundSocket(path, st.st_dev, st.st_ino)


def remove_if_ours(ours: BoundSocket) -> None:
    """Unlink the socket at shutdown only if it is still the one this process bound."""
    try:
        st = os.lstat(ours.path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) != (ours.device, ours.inode) or not stat.S_ISSOCK(st.st_mode):
        log.warning(
            "socket %s is no longer the one this daemon bound (now %s); left as it is",
            ours.path,
            kind_of(ours.path),
        )
        return
    try:
        os.unlink(ours.path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("socket %s not removed: %s", ours.path, exc.strerror)
