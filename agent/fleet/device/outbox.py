"""Events the operator must not miss, kept on disk until the broker has acknowledged them:
bounded, in order across restarts, and recorded once per idempotency key (`Outbox`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Final

from google.protobuf.message import DecodeError

from agent.base.fsutil import atomic_write_bytes, is_temp, make_dirs
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb

log = logging.getLogger(__name__)

SUFFIX: Final = ".event"
SEQ_FILE: Final = "last_seq"
KEYS_FILE: Final = "keys"
MAX_KEYS: Final = 1024
_NAME_RE: Final = re.compile(r"(\d{12})\.event")


def event_name(seq: int) -> str:
    """The file name of the event with this seq."""
    return f"{seq:012d}{SUFFIX}"


class Outbox:
    """Undelivered events in seq order, on disk where the disk allows.

    One file per event, named by its zero-padded seq (``000000000042.event``, the serialized
    `Event`), written with `atomic_write`; the last seq given out is kept in ``last_seq`` so that
    seqs keep increasing across restarts even when every event was delivered and deleted. At most
    `max_items` events wait: beyond that the oldest is dropped (a long outage must not fill the
    disk). When the disk refuses a write the event waits in memory (counted in the same bound) and
    goes to disk with the next write that succeeds.

    An event may carry an idempotency `key`: an event whose key the outbox has already taken is not
    recorded again (`append` returns None), so a report that is re-derived after a crash — the
    updater re-reports its record's state at every start — is recorded once. The last `MAX_KEYS`
    keys are kept in ``keys`` (written after the event file, so a crash between the two leaves the
    key in the event file, where the next start finds it).

    `append` runs on the event loop, `peek` and `ack` on the MQTT network thread: one lock.
    """

    def __init__(self, directory: Path, max_items: int) -> None:
        if max_items < 1:
            raise ValueError(f"outbox max_items must be at least 1, not {max_items}")
        self.dir = directory
        self.max_items = max_items
        self._lock = threading.Lock()
        self._items: OrderedDict[int, fpb.Event] = OrderedDict()  # seq -> event, oldest first
        self._unsaved: set[int] = set()  # seqs kept in memory only
        self._last_seq = 0
        self._dropped = 0
        self._keys: OrderedDict[str, None] = OrderedDict()  # idempotency keys taken, oldest first
        self._disk_ok = True  # the last write succeeded
        # False when the directory could not be scanned: writing there could overwrite
        # undelivered events of an earlier run, so this process keeps everything in memory.
        self._use_disk = True
        try:
            make_dirs(self.dir, 0o700)
            self._scan()
        except OSError as exc:
            self._use_disk = self._disk_ok = False
            log.warning("outbox %s unusable, events kept in memory only: %s", self.dir, exc)

    @property
    def dropped(self) -> int:
        """Events dropped because more than `max_items` waited."""
        with self._lock:
            return self._dropped

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def append(self, event: fpb.Event) -> fpb.Event | None:
        """Store a copy of `event` with the next seq (and the time, if unset) and return it;
        None if its `key` was taken before (the event is already recorded, or was delivered).

        Never raises on I/O: an event the disk refuses waits in memory. Raises ValueError for
        an event without a kind (a bug in the caller: such a file would read back as corrupt).
        """
        if event.WhichOneof("kind") is None:
            raise ValueError("an outbox event needs a kind (reload or update)")
        stored = fpb.Event()
        stored.CopyFrom(event)
        if not stored.timestamp_unix:
            stored.timestamp_unix = time.time()
        with self._lock:
            if stored.key and stored.key in self._keys:
                log.debug("outbox: event %s already recorded", stored.key)
                return None
            self._last_seq += 1
            stored.seq = self._last_seq
            self._items[stored.seq] = stored
            self._unsaved.add(stored.seq)
            self._save_unsaved()
            if stored.key:
                self._take_key(stored.key)
                self._save_keys()
            while len(self._items) > self.max_items:
                log.warning(
                    "outbox full (%d events): dropped the oldest undelivered event %d",
                    self.max_items,
                    self._drop_oldest(),
                )
        return _copy(stored)

    def peek(self) -> fpb.Event | None:
        """The oldest undelivered event (a copy), or None."""
        with self._lock:
            for event in self._items.values():
                return _copy(event)
            return None

    def ack(self, seq: int) -> None:
        """The broker has the event `seq`: forget it. An unknown seq is ignored."""
        with self._lock:
            if self._items.pop(seq, None) is not None:
                self._forget(seq)

    # ------------------------------------------------------------------------------ internal

    def _save_unsaved(self) -> None:
        """Write the last seq, then every event still in memory only, oldest first."""
        if not self._use_disk:
            return
        try:
            atomic_write_bytes(self.dir / SEQ_FILE, f"{self._last_seq}\n".encode())
            for seq in sorted(self._unsaved):
                data = self._items[seq].SerializeToString()
                atomic_write_bytes(self.dir / event_name(seq), data)
                self._unsaved.discard(seq)
        except OSError as exc:
            if self._disk_ok:
                log.warning("outbox %s: cannot write, keeping events in memory: %s", self.dir, exc)
            self._disk_ok = False
            return
        if not self._disk_ok:
            log.info("outbox %s: writable again, events saved", self.dir)
        self._disk_ok = True

    def has_key(self, key: str) -> bool:
        """Whether an event with this idempotency key was taken."""
        with self._lock:
            return key in self._keys

    def _take_key(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > MAX_KEYS:
            self._keys.popitem(last=False)

    def _save_keys(self) -> None:
        """After the event file: a crash in between leaves the key in the event itself."""
        if not self._use_disk:
            return
        try:
            atomic_write_bytes(self.dir / KEYS_FILE, "".join(k + "\n" for k in self._keys).encode())
        except OSError as exc:  # the event files still hold the keys of undelivered events
            log.warning("outbox %s: cannot write %s: %s", self.dir, KEYS_FILE, exc)

    def _drop_oldest(self) -> int:
        seq, _ = self._items.popitem(last=False)
        self._forget(seq)
        self._dropped += 1
        return seq

    def _forget(self, seq: int) -> None:
        if seq in self._unsaved:
            self._unsaved.discard(seq)
            return
        try:
            os.unlink(self.dir / event_name(seq))
        except FileNotFoundError:
            pass
        except OSError as exc:  # delivered again after a restart: at least once
            log.warning("outbox: cannot delete delivered event %d: %s", seq, exc)

    def _scan(self) -> None:
        temps = corrupt = 0
        found: list[fpb.Event] = []
        for name in os.listdir(self.dir):
            path = self.dir / name
            if is_temp(name):
                temps += _remove(path)
            elif name.endswith(SUFFIX):
                event = _load(path, name)
                if event is None:
                    corrupt += _remove(path)
                else:
                    found.append(event)
        found.sort(key=lambda e: e.seq)
        for key in _read_keys(self.dir / KEYS_FILE):
            self._take_key(key)
        for event in found:
            self._items[event.seq] = event
            if event.key:
                self._take_key(event.key)
        self._last_seq = max(_read_seq(self.dir / SEQ_FILE), found[-1].seq if found else 0)
        if temps:
            log.info("outbox %s: deleted %d temp files left by a crash", self.dir, temps)
        if corrupt:
            log.warning("outbox %s: deleted %d corrupt event files", self.dir, corrupt)
        if len(self._items) > self.max_items:
            first = next(iter(self._items))
            while len(self._items) > self.max_items:
                last = self._drop_oldest()
            log.warning(
                "outbox %s: more than %d events waiting, dropped the oldest (%d to %d)",
                self.dir,
                self.max_items,
                first,
                last,
            )
        if self._items:
            log.info("outbox %s: %d undelivered events", self.dir, len(self._items))


def _load(path: Path, name: str) -> fpb.Event | None:
    """The event in `path`, or None if the file is not a whole event with the seq of its name."""
    m = _NAME_RE.fullmatch(name)
    if m is None:
        return None
    event = fpb.Event()
    try:
        event.ParseFromString(path.read_bytes())
    except (OSError, DecodeError):
        return None
    # A file cut at a field boundary parses: the kind (the last fields) is then missing.
    if event.seq != int(m.group(1)) or event.WhichOneof("kind") is None:
        return None
    return event


def _read_seq(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as exc:
        log.warning("outbox: ignoring unreadable %s: %s", path, exc)
        return 0


def _read_keys(path: Path) -> list[str]:
    try:
        return [k for k in path.read_text().splitlines() if k]
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:  # the undelivered events' own keys still count
        log.warning("outbox: ignoring unreadable %s: %s", path, exc)
        return []


def _remove(path: Path) -> int:
    with contextlib.suppress(OSError):
        path.unlink()
        return 1
    return 0


def _copy(event: fpb.Event) -> fpb.Event:
    out = fpb.Event()
    out.CopyFrom(event)
    return out
