"""One daemon per state directory: an exclusive ``flock`` on ``<state-dir>/agent.lock``, held
for the daemon's life and released by the kernel however the process ends (exit, crash,
``kill -9``), with the holder's pid written into the file for the one who is refused.

The lock is what tells a stale socket from a live one when the socket alone cannot (see
`agent.api.unixsocket`), and it keeps two daemons from writing one model store, outbox and
KV disk tier. The file is never deleted: a lock file that is unlinked while another process
waits on it would let two processes hold "the" lock at once.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import Final

from agent.base.errors import AlreadyRunning, HostError
from agent.base.fsutil import ensure_last_level

log = logging.getLogger(__name__)

LOCK_NAME: Final = "agent.lock"
STATE_DIR_MODE: Final = 0o700  # StateDirectoryMode= in the unit: sessions are private data


def _holder(fd: int) -> str:
    """The pid the holder wrote into the lock file, or a phrase when it wrote none yet."""
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a process that has not written its pid yet"


class StateLock:
    """The held lock; `release` (or the process's end) lets the next daemon in."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path) -> StateLock:
        """Create the state directory's last level if needed (mode 0700), take its lock and
        write this process's pid into it. Raises HostError when the directory cannot be used,
        AlreadyRunning when another process holds the lock."""
        ensure_last_level(directory, "state directory", STATE_DIR_MODE)
        path = directory / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise HostError(
                f"state directory {directory}: cannot open its lock file {LOCK_NAME}: "
                f"{exc.strerror}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunning(
                    f"another edge-agent ({holder}) is running on the state directory "
                    f"{directory} (it holds {path}); stop it, or give this one its own "
                    "--state-dir and --socket"
                ) from None
            raise HostError(f"state directory {directory}: cannot lock {path}: {exc}") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # the lock is the flock, and it is held: a full disk must not keep the model
                # from serving for want of a pid that only the refused one reads
                log.warning("state directory %s: no pid in %s: %s", directory, path, exc.strerror)
            else:
                os.close(fd)
                raise HostError(
                    f"state directory {directory}: cannot write {path}: {exc.strerror}"
                ) from exc
        log.info("state directory %s locked (pid %d)", directory, os.getpid())
        return cls(directory, fd)

    def release(self) -> None:
        """Let go of the lock (the file stays; see the module's docstring)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
