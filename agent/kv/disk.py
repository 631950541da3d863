"""`DiskTier`: spilled sessions as checksummed files in the state directory, kept across
restarts while the model is unchanged and evicted least recently used within a byte budget.
A failure to store never raises: the caller keeps the session in host memory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.base.errors import InvalidRequest, NotFound, SessionLost, Unavailable
from agent.base.fsutil import atomic_write, is_temp, make_dirs
from agent.kv.codec import Header, encode, read_header, read_snapshot
from agent.kv.snapshot import KVSnapshot

log = logging.getLogger(__name__)

SUFFIX = ".kv"
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN}
_FULL = {errno.ENOSPC, errno.EDQUOT}


@dataclass(frozen=True, slots=True)
class Stored:
    """What `DiskTier.put` did. `evicted` files are gone even when the put was not ok."""

    ok: bool
    evicted: tuple[str, ...] = ()
    reason: str = ""  # why not, when not ok


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One saved session, as known from its header and file."""

    key: str
    tokens: int
    nbytes: int  # file size, what counts against the budget
    last_used: float  # unix time
    meta: dict[str, Any]


def check_key(key: str) -> None:
    """Raise `InvalidRequest` unless `key` is 1-128 URL-safe characters (A-Z a-z 0-9 _ -)."""
    if not _KEY_RE.fullmatch(key):
        raise InvalidRequest(f"session id {key!r} is not valid: use 1-128 of A-Z a-z 0-9 _ -")


class DiskTier:
    """Saved sessions of one model under ``root/sessions``, bounded in bytes.

    `disabled` is None when the tier works, else the reason it does not (budget 0, or the
    directory cannot be created); a disabled tier stores nothing and touches no files.

    One file per session, ``<root>/sessions/<key>.kv`` in the `agent.kv.codec` format, written with
    `agent.base.fsutil.atomic_write` (a crash leaves the old file or the new one). Files survive a
    daemon restart while the model's sha256 is unchanged; on construction the directory is scanned
    and files of another model, corrupt files and leftover temp files are deleted. Least recently
    used sessions (file mtime, touched on every read) are evicted to keep the total file size within
    `budget_bytes`.

    Failures to store never raise: `put` returns a not-ok `Stored` and the caller keeps the session
    in host memory. A file that cannot be used raises `SessionLost` from `get` and is deleted. The
    scan checks each file's header and size only (files it cannot open are left in place,
    unaccounted); the checksum is verified on `get`. Not thread-safe: one owner thread (the
    engine's).
    """

    def __init__(self, root: Path, model_sha256: str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        self.dir = root / "sessions"
        self.model_sha256 = model_sha256
        self.budget_bytes = budget_bytes
        self.disabled: str | None = None
        self._index: OrderedDict[str, DiskEntry] = OrderedDict()  # least recently used first
        # sessions whose files the scan deleted because another model wrote them: key ->
        # (owner, why), so that their clients hear "lost", not "unknown"
        self.invalidated: dict[str, tuple[str, str]] = {}
        if budget_bytes == 0:
            self.disabled = "the disk tier is off (budget 0)"
            return
        try:
            make_dirs(self.dir, 0o700)  # synced into root: a power cut must not take it
            self._scan()
        except OSError as exc:
            self.disabled = f"cannot use {self.dir}: {exc.strerror or exc}"
            log.warning("disk tier disabled: %s", self.disabled)

    @property
    def usage_bytes(self) -> int:
        """Total size of the saved files."""
        return sum(e.nbytes for e in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        """Saved session keys, least recently used first."""
        return list(self._index)

    def entries(self) -> list[DiskEntry]:
        """Saved sessions, least recently used first (from headers; no array bytes read)."""
        return list(self._index.values())

    def put(
        self,
        key: str,
        snapshot: KVSnapshot,
        meta: Mapping[str, object],
        *,
        choose: Callable[[int], Sequence[str] | None] | None = None,
    ) -> Stored:
        """Save (or replace) session `key`; evict other sessions, LRU first, to fit the budget.
        `choose(need)` instead names the files to evict for `need` bytes (the owner's fair
        eviction, `agent.kv.quota`), or None to refuse the put rather than evict others.

        Never raises for a failure to store (too big, disk full, unwritable directory, a dtype
        or `meta` that cannot be stored): returns ``Stored(ok=False, ...)``, logs a warning
        (a disabled tier logged its reason once, when built) and leaves an older file of `key`
        as it was — except on a full disk, where that older file is deleted too (the session
        has moved on from it; one log line). Raises `InvalidRequest` for a malformed key only.
        `meta` must be plain JSON (tuples read back as lists).
        """
        check_key(key)
        if self.disabled is not None:
            return Stored(False, (), self.disabled)
        if snapshot.model_sha256 != self.model_sha256:
            return self._refuse(key, "its KV was computed with another model", [])
        try:
            enc = encode(snapshot, meta)
        except ValueError as exc:
            return self._refuse(key, str(exc), [])
        if enc.nbytes > self.budget_bytes:
            why = f"it needs {enc.nbytes} bytes and the disk tier holds {self.budget_bytes}"
            return self._refuse(key, why, [])
        evicted: list[str] = []
        now = time.time_ns()  # as mtime: finer than some filesystems' own, for the LRU order
        order = None if choose is None else choose(enc.nbytes)
        if choose is not None and order is None:
            why = (
                f"its {enc.nbytes} bytes fit the disk tier only by evicting sessions of clients "
                f"within their fair share of its {self.budget_bytes}"
            )
            return self._refuse(key, why, [])
        try:
            self._make_room(enc.nbytes, key, evicted, order)
            atomic_write(self._path(key), enc.write_to, now)
        except OSError as exc:
            if exc.errno in _FULL:
                return self._drop(key, f"the disk is full ({exc.strerror})", evicted)
            return self._refuse(key, f"cannot write to {self.dir}: {exc}", evicted)
        self._index.pop(key, None)
        plain_meta = json.loads(json.dumps(dict(meta)))  # as it reads back after a restart
        self._index[key] = DiskEntry(key, len(snapshot.tokens), enc.nbytes, now / 1e9, plain_meta)
        log.debug("session %s saved to disk (%d bytes)", key, enc.nbytes)
        return Stored(True, tuple(evicted))

    def get(self, key: str) -> tuple[KVSnapshot, dict[str, Any]]:
        """Load and verify session `key` (it stays saved): its snapshot and its meta.

        Raises `NotFound` when there is no such file, `SessionLost` (and deletes the file) when
        it is truncated, corrupt, unreadable or from another model, `Unavailable` when the
        process is out of file descriptors or memory (the file is kept).
        """
        check_key(key)
        if self.disabled is not None:
            raise NotFound(f"no saved session {key}")
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                header = read_header(f, os.fstat(f.fileno()).st_size)
                same_model = header.model_sha256 == self.model_sha256
                snapshot = read_snapshot(f, header) if same_model else None
        except FileNotFoundError as exc:
            self._index.pop(key, None)
            raise NotFound(f"no saved session {key}") from exc
        except OSError as exc:
            if exc.errno in _TRANSIENT:  # the process, not the file: do not delete it
                raise Unavailable(f"cannot read saved session {key} now: {exc}") from exc
            raise self._lost(key, f"its saved KV cannot be read ({exc.strerror or exc})") from exc
        except ValueError as exc:
            raise self._lost(key, f"its saved KV is corrupted ({exc})") from exc
        if snapshot is None:
            other = header.model_sha256[:12]
            raise self._lost(key, f"its saved KV was computed with another model ({other}…)")
        now = time.time_ns()
        with contextlib.suppress(OSError):  # a read-only directory only costs the LRU order
            os.utime(path, ns=(now, now))
        old = self._index.pop(key, None) or self._entry(key, header, 0)
        self._index[key] = replace(old, last_used=now / 1e9)
        log.debug("session %s loaded from disk (%d bytes)", key, header.file_bytes)
        return snapshot, header.meta

    def delete(self, key: str) -> bool:
        """Delete session `key`'s file; False when there was none (or it cannot be deleted)."""
        check_key(key)
        if self.disabled is not None:
            return False
        self._index.pop(key, None)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("cannot delete saved session %s: %s", key, exc)
            return False
        return True

    # ------------------------------------------------------------------ internals

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _entry(self, key: str, header: Header, mtime_ns: int) -> DiskEntry:
        return DiskEntry(key, len(header.tokens), header.file_bytes, mtime_ns / 1e9, header.meta)

    def _refuse(self, key: str, why: str, evicted: list[str]) -> Stored:
        log.warning("session %s not saved to disk: %s", key, why)
        return Stored(False, tuple(evicted), why)

    def _drop(self, key: str, why: str, evicted: list[str]) -> Stored:
        """A save that failed for want of space: the older file of `key` goes too, so that the
        index and the directory agree and no stale copy of the session outlives it."""
        had = self._index.pop(key, None) is not None
        gone = _remove(self._path(key))
        what = "; its older saved copy is dropped" if had else ""
        what += "" if gone else " (and its older file cannot be deleted)"
        log.warning("session %s not saved to disk: %s%s", key, why, what)
        return Stored(False, tuple(evicted), why)

    def _lost(self, key: str, why: str) -> SessionLost:
        self._index.pop(key, None)
        err = SessionLost(key, why)
        gone = _remove(self._path(key))
        log.warning("%s%s", err, "" if gone else " (and its file cannot be deleted)")
        return err

    def _make_room(
        self, need: int, key: str, evicted: list[str], order: Sequence[str] | None = None
    ) -> None:
        """Delete files other than `key`'s (LRU first, or those `order` names) until `need`
        bytes replacing it fit the budget."""
        kept = self._index[key].nbytes if key in self._index else 0
        keys = [k for k in self._index if k != key] if order is None else order
        for old in [k for k in keys if k != key and k in self._index]:
            if self.usage_bytes - kept + need <= self.budget_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(old))
            del self._index[old]
            evicted.append(old)
        if evicted:
            how = "least recently used" if order is None else "fair share"
            log.info("evicted %d saved sessions (%s): %s", len(evicted), how, evicted)

    def _scan(self) -> None:
        found: list[DiskEntry] = []
        temps = stale = corrupt = unreadable = 0
        for path in self.dir.iterdir():
            name, key = path.name, path.name.removesuffix(SUFFIX)
            if is_temp(name):
                temps += _remove(path)
                continue
            if not (name.endswith(SUFFIX) and _KEY_RE.fullmatch(key)):
                continue  # not ours: left alone
            try:
                with open(path, "rb", buffering=0) as f:
                    st = os.fstat(f.fileno())
                    header = read_header(f, st.st_size)
            except OSError:  # permissions, a directory, EIO: not ours to judge, left in place
                unreadable += 1
            except ValueError:
                corrupt += _remove(path)
            else:
                if header.model_sha256 != self.model_sha256:
                    stale += _remove(path)
                    why = f"the model changed since it was saved ({header.model_sha256[:12]}…)"
                    self.invalidated[key] = (str(header.meta.get("owner", "")), why)
                else:
                    found.append(self._entry(key, header, st.st_mtime_ns))
        for entry in sorted(found, key=lambda e: (e.last_used, e.key)):
            self._index[entry.key] = entry
        if stale:
            log.info("invalidated %d saved sessions: model changed", stale)
        if corrupt:
            log.warning("deleted %d saved sessions: corrupt or truncated", corrupt)
        if unreadable:
            log.warning("ignored %d saved sessions that cannot be read", unreadable)
        if temps:
            log.info("deleted %d temp files left by an interrupted save", temps)
        with contextlib.suppress(OSError):
            self._make_room(0, "", [])  # the budget may have shrunk since the last run
        log.info(
            "disk tier %s: %d saved sessions, %d of %d bytes",
            self.dir,
            len(self._index),
            self.usage_bytes,
            self.budget_bytes,
        )


def _remove(path: Path) -> int:
    """1 if `path` is gone now, 0 if it cannot be deleted."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return 0
    return 1
