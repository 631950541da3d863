"""Where rollouts live on the operator's machine: one SQLite database per rollouts directory
(`rollouts.db`, WAL mode, synchronous=FULL) with a row per rollout and a row per device, so that
saving before an offer writes the devices that changed, not the whole rollout; each rollout's
lock (`<id>.lock`, an exclusive `flock` held by the process running it, with that process's pid
written in), and operator requests for the running process (`<id>.pause`, `<id>.abort`,
`<id>.retry`) that it takes within a second (docs/ROLLOUTS.md).

synchronous=FULL: a commit is on disk before `save` returns, so a device marked offered stays
marked through a power cut (NORMAL in WAL mode may lose the last commits, and with them the mark
that keeps an update from being sent twice). A rollout written as `<id>.json` by an older
version is copied into the database when first read; the file stays where it is. Devices come
back sorted by id, as every Rollout holds them.

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
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from agent.base.errors import HostError
from agent.base.fsutil import atomic_write_bytes, ensure_last_level, sync_dir
from agent.operator.rollout.state import (
    Device,
    Rollout,
    RolloutError,
    check_rollout_id,
    device_to_json,
    from_json,
    gates_doc,
    head_to_json,
)

log = logging.getLogger(__name__)

REQUESTS: Final = ("abort", "retry", "pause")  # the order they are carried out in
DIR_MODE: Final = 0o700
DB_NAME: Final = "rollouts.db"
BUSY_TIMEOUT_S: Final = 30.0  # a writer waits this long for another's transaction
SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS rollout (id TEXT PRIMARY KEY, gen INTEGER NOT NULL, "
    "body TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS device (rollout_id TEXT NOT NULL, device_id TEXT NOT NULL, "
    "body TEXT NOT NULL, PRIMARY KEY (rollout_id, device_id)) WITHOUT ROWID",
    # added with rollout gates: a store made before has no such table until it is opened here,
    # and a rollout with no row has no gates (state.gates_doc)
    "CREATE TABLE IF NOT EXISTS gate (rollout_id TEXT PRIMARY KEY, body TEXT NOT NULL) "
    "WITHOUT ROWID",
)


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
    """The rollouts directory and its database (opened on first use; `close` or the end of the
    process closes it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.db_path = directory / DB_NAME
        self._db: sqlite3.Connection | None = None
        # what this store last read or wrote of each rollout, and the row's generation then:
        # `save` writes the devices that differ from it (all of them if another wrote since)
        self._saved: dict[str, tuple[int, Rollout]] = {}

    def path(self, rollout_id: str) -> Path:
        """Where a rollout of an older version lived (read once, then kept in the database)."""
        return self.directory / f"{check_rollout_id(rollout_id)}.json"

    def ensure(self) -> None:
        """Create the directory's last level if needed (mode 0700); RolloutError if unusable."""
        try:
            ensure_last_level(self.directory, "rollouts directory", DIR_MODE)
        except HostError as exc:
            raise RolloutError(str(exc)) from exc

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        self.ensure()
        try:
            fd = os.open(self.db_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            pass
        except OSError as exc:
            raise RolloutError(f"cannot create {self.db_path}: {exc.strerror}") from exc
        else:  # a new, empty database: its name is on disk before anything is written to it
            os.close(fd)
            sync_dir(self.directory)
        try:
            db = sqlite3.connect(
                self.db_path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                check_same_thread=False,
            )  # fmt: skip
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                for statement in SCHEMA:
                    db.execute(statement)
            except BaseException:
                db.close()
                raise
        except sqlite3.Error as exc:
            raise RolloutError(f"cannot open {self.db_path}: {exc}") from exc
        self._db = db
        return db

    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction: a write one takes the database's write lock at its start; a read
        one sees one snapshot (a status read mid-save sees the save whole or not at all)."""
        db = self._conn()
        try:
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise RolloutError(f"{self.db_path}: {exc}") from exc

    def _has_db(self) -> bool:
        """Whether the database exists (reading never creates it, nor the directory)."""
        return self._db is not None or self.db_path.exists()

    def exists(self, rollout_id: str) -> bool:
        row = None
        if self._has_db():
            with self._transaction(write=False) as db:
                row = db.execute("SELECT 1 FROM rollout WHERE id = ?", (rollout_id,)).fetchone()
        return row is not None or self.path(rollout_id).exists()

    def create(self, r: Rollout) -> None:
        """Write a new rollout; RolloutError if one of that id exists."""
        rid = r.spec.rollout_id
        if self.exists(rid):
            raise RolloutError(
                f"rollout {rid} exists (in {self.db_path}); give another --id, or resume it"
            )
        with self._transaction(write=True) as db:
            if db.execute("SELECT 1 FROM rollout WHERE id = ?", (rid,)).fetchone():
                raise RolloutError(f"rollout {rid} exists (in {self.db_path}); give another --id")
            self._write_all(db, r, 0)

    def save(self, r: Rollout) -> None:
        """Write the rollout in one transaction, on disk when this returns: its head, and the
        devices that changed since this store last read or wrote it."""
        rid = r.spec.rollout_id
        head = json.dumps(head_to_json(r), sort_keys=True)
        with self._transaction(write=True) as db:
            gen, before = self._saved.get(rid, (-1, None))
            done = db.execute(
                "UPDATE rollout SET gen = gen + 1, body = ? WHERE id = ? AND gen = ?",
                (head, rid, gen),
            ).rowcount
            if done != 1 or before is None:  # first save here, or another process wrote since
                row = db.execute("SELECT gen FROM rollout WHERE id = ?", (rid,)).fetchone()
                self._write_all(db, r, 0 if row is None else int(row[0]) + 1)
                return
            if _gated(before) != _gated(r):
                self._write_gates(db, r)
            if before.devices is not r.devices:
                old = {d.device_id: d for d in before.devices}
                changed = [d for d in r.devices if _differs(old.pop(d.device_id, None), d)]
                db.executemany(
                    "INSERT OR REPLACE INTO device VALUES (?, ?, ?)",
                    [(rid, d.device_id, _device_row(d)) for d in changed],
                )
                db.executemany(
                    "DELETE FROM device WHERE rollout_id = ? AND device_id = ?",
                    [(rid, gone) for gone in old],
                )
            self._saved[rid] = (gen + 1, r)

    def _write_all(self, db: sqlite3.Connection, r: Rollout, gen: int) -> None:
        rid = r.spec.rollout_id
        head = json.dumps(head_to_json(r), sort_keys=True)
        db.execute("INSERT OR REPLACE INTO rollout VALUES (?, ?, ?)", (rid, gen, head))
        db.execute("DELETE FROM device WHERE rollout_id = ?", (rid,))
        db.executemany(
            "INSERT INTO device VALUES (?, ?, ?)",
            [(rid, d.device_id, _device_row(d)) for d in r.devices],
        )
        self._write_gates(db, r)
        self._saved[rid] = (gen, r)

    def _write_gates(self, db: sqlite3.Connection, r: Rollout) -> None:
        body = json.dumps(gates_doc(r), sort_keys=True)
        db.execute("INSERT OR REPLACE INTO gate VALUES (?, ?)", (r.spec.rollout_id, body))

    def load(self, rollout_id: str) -> Rollout:
        check_rollout_id(rollout_id)
        row, rows, gated = None, [], None
        if self._has_db():
            with self._transaction(write=False) as db:
                query = "SELECT gen, body FROM rollout WHERE id = ?"
                row = db.execute(query, (rollout_id,)).fetchone()
                rows = [] if row is None else db.execute(
                    "SELECT body FROM device WHERE rollout_id = ? ORDER BY device_id",
                    (rollout_id,),
                ).fetchall()  # fmt: skip
                query = "SELECT body FROM gate WHERE rollout_id = ?"
                gated = db.execute(query, (rollout_id,)).fetchone()
        if row is None:
            return self._migrate(rollout_id)
        source = f"{self.db_path} (rollout {rollout_id})"
        try:
            doc = {**json.loads(row[1]), "devices": [json.loads(b) for (b,) in rows]}
            doc.update(json.loads(gated[0]) if gated else {})
        except ValueError as exc:
            raise RolloutError(f"{source}: not JSON ({exc})") from exc
        r = from_json(doc, source)
        self._saved[rollout_id] = (int(row[0]), r)
        return r

    def _migrate(self, rollout_id: str) -> Rollout:
        """Read `<id>.json` (an older version's) into the database; the file is left as is."""
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
        r = from_json(doc, str(path))
        if r.spec.rollout_id != rollout_id:
            raise RolloutError(f"{path}: holds rollout {r.spec.rollout_id!r}, not {rollout_id}")
        with self._transaction(write=True) as db:
            if db.execute("SELECT 1 FROM rollout WHERE id = ?", (rollout_id,)).fetchone():
                pass  # another process copied it first: read theirs
            else:
                self._write_all(db, r, 0)
                log.info("rollout %s: copied from %s into %s", rollout_id, path, self.db_path)
                return r
        return self.load(rollout_id)

    def ids(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        stored: set[str] = set()
        if self._has_db():
            with self._transaction(write=False) as db:
                stored = {rid for (rid,) in db.execute("SELECT id FROM rollout")}
        old = {p.stem for p in self.directory.glob("*.json") if not p.name.startswith(".")}
        return sorted(stored | old)

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
        """A request was carried out (its file, which `request` made, goes, for good: a retry
        that came back after a power cut would be carried out twice)."""
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{rollout_id}.{what}").unlink()
            sync_dir(self.directory)


def _device_row(d: Device) -> str:
    return json.dumps(device_to_json(d), sort_keys=True)


def _gated(r: Rollout) -> tuple[object, ...]:
    return (r.spec.gates, r.checks, r.overrides)


def _differs(old: Device | None, new: Device) -> bool:
    return old is None or (old is not new and old != new)
