"""Where rollouts live on the operator's machine: one JSON file per rollout (`<id>.json`,
replaced atomically: temp file, fsync, rename, fsync the directory), its lock (`<id>.lock`, an
exclusive `flock` held by the process running it, with that process's pid written in), and
operator requests for the running process (`<id>.pause`, `<id>.abort`, `<id>.retry`) that it
takes within a second (docs/ROLLOUTS.md).

Lock files are never deleted (see agent/base/statelock.py for why); request files are deleted by
the process that carries them out; nothing else here deletes a file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Final

from agent.base.errors import HostError
from agent.base.fsutil import atomic_write_bytes, ensure_last_level
from agent.operator.rollout.state import Rollout, RolloutError, check_rollout_id, from_json, to_json

log = logging.getLogger(__name__)

REQUESTS: Final = ("abort", "retry", "pause")  # the order they are carried out in
DIR_MODE: Final = 0o700


class RolloutBusy(RolloutError):
    """Another process runs this rollout (it holds the lock); the message names its pid."""


class RolloutLock:
    """The held lock of one rollout; released by `release` or by the process's end."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class RolloutStore:
    """The rollouts directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, rollout_id: str) -> Path:
        return self.directory / f"{check_rollout_id(rollout_id)}.json"

    def ensure(self) -> None:
        """Create the directory's last level if needed (mode 0700); RolloutError if unusable."""
        try:
            ensure_last_level(self.directory, "rollouts directory", DIR_MODE)
        except HostError as exc:
            raise RolloutError(str(exc)) from exc

    def exists(self, rollout_id: str) -> bool:
        return self.path(rollout_id).exists()

    def create(self, r: Rollout) -> None:
        """Write a new rollout; RolloutError if one of that id exists."""
        self.ensure()
        if self.exists(r.spec.rollout_id):
            raise RolloutError(
                f"rollout {r.spec.rollout_id} exists ({self.path(r.spec.rollout_id)}); give "
                "another --id, or resume it"
            )
        self.save(r)

    def save(self, r: Rollout) -> None:
        """Replace the rollout's file atomically (fsync before the rename)."""
        data = json.dumps(to_json(r), indent=1, sort_keys=True).encode() + b"\n"
        path = self.path(r.spec.rollout_id)
        try:
            atomic_write_bytes(path, data)
        except OSError as exc:
            raise RolloutError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def load(self, rollout_id: str) -> Rollout:
        path = self.path(rollout_id)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise RolloutError(f"no rollout {rollout_id} in {self.directory}") from None
        except OSError as exc:
            raise RolloutError(f"cannot read {path}: {exc.strerror or exc}") from exc
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise RolloutError(f"{path}: not JSON ({exc})") from exc
        return from_json(doc, str(path))

    def ids(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(p.stem for p in self.directory.glob("*.json") if not p.name.startswith("."))

    # ------------------------------------------------------------------ lock

    def lock(self, rollout_id: str) -> RolloutLock:
        """Take the rollout's lock without waiting; RolloutBusy naming the holder's pid."""
        self.ensure()
        path = self.directory / f"{check_rollout_id(rollout_id)}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise RolloutError(f"cannot open {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = f"pid {text}" if text.isdigit() else "a process starting up"
                raise RolloutBusy(
                    f"rollout {rollout_id} is being run by {holder} (it holds {path}); use "
                    f"`edge-agent fleet rollout pause|abort {rollout_id}` to stop it"
                ) from None
            raise RolloutError(f"cannot lock {path}: {exc}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return RolloutLock(path, fd)

    def locked(self, rollout_id: str) -> bool:
        """Whether some process holds the rollout's lock right now."""
        try:
            held = self.lock(rollout_id)
        except RolloutBusy:
            return True
        held.release()
        return False

    # ------------------------------------------------------------------ requests

    def request(self, rollout_id: str, what: str) -> Path:
        """Leave `what` (pause, abort, retry) for the process running the rollout."""
        if what not in REQUESTS:
            raise ValueError(what)
        path = self.directory / f"{check_rollout_id(rollout_id)}.{what}"
        try:
            atomic_write_bytes(path, f"{os.getpid()}\n".encode())
        except OSError as exc:
            raise RolloutError(f"cannot write {path}: {exc.strerror or exc}") from exc
        log.info("rollout %s: %s requested (%s)", rollout_id, what, path)
        return path

    def pending(self, rollout_id: str) -> list[str]:
        """The requests waiting, in the order they are carried out."""
        return [w for w in REQUESTS if (self.directory / f"{rollout_id}.{w}").exists()]

    def done(self, rollout_id: str, what: str) -> None:
        """A request was carried out (its file, which `request` made, goes)."""
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{rollout_id}.{what}").unlink()
