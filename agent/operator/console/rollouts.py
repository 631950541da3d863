"""The console's read-only view of a rollouts directory (`agent.operator.rollout.store`): it
never writes there and never creates a file there.

SQLite creates a WAL database's `-wal` and `-shm` files when a connection opens it, a read-only
one included (and leaves them). So: with a `-wal` file present (a rollout process has the
database open, or left it so) the database is opened read-only (`mode=ro`) and reads the writer's
newest commits through it; without one, every commit is in the database file itself, and it is
opened `immutable` (no locks, no side files). A writer that starts meanwhile writes to a new WAL
first and touches the database file only at a checkpoint; a read that meets one fails with an
SQLite error, which the page shows (`RolloutError`), and the next read sees the `-wal` file.
A rollout an older version left as `<id>.json` is read from that file, not copied into the
database.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote

from agent.operator.rollout.state import Rollout, RolloutError, from_json, head_to_json
from agent.operator.rollout.store import DB_NAME, RolloutStore

MAX_LISTED: Final = 500  # the rollouts page lists the newest this many


@dataclass(frozen=True, slots=True)
class RolloutHead:
    """What the rollouts list shows of one rollout (its head row: no devices)."""

    rollout_id: str
    update_id: str
    target: str
    state: str
    reason: str
    wave: int  # 1-based
    waves: int
    created_unix: float
    updated_unix: float
    halts: int


class ReadOnlyStore(RolloutStore):
    """A `RolloutStore` that only reads (module docstring); one per page, closed after it."""

    def ensure(self) -> None:
        raise RolloutError(f"{self.directory}: the console does not create rollouts directories")

    def _conn(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        wal = self.db_path.with_name(DB_NAME + "-wal")
        mode = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
        uri = f"file:{quote(str(self.db_path))}?{mode}"
        try:
            db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise RolloutError(f"cannot open {self.db_path}: {exc}") from exc
        self._db = db
        return db

    def _migrate(self, rollout_id: str) -> Rollout:
        path = self.path(rollout_id)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise RolloutError(f"no rollout {rollout_id} in {self.directory}") from None
        except (OSError, ValueError) as exc:
            raise RolloutError(f"cannot read {path}: {exc}") from exc
        return from_json(doc, str(path))

    def heads(self) -> tuple[list[RolloutHead], int]:
        """The newest `MAX_LISTED` rollouts (by creation), and how many there are in all."""
        heads: list[RolloutHead] = []
        if self._has_db():
            with self._transaction(write=False) as db:
                for rid, body in db.execute("SELECT id, body FROM rollout"):
                    heads.append(_head(str(rid), body, f"{self.db_path} (rollout {rid})"))
        stored = {h.rollout_id for h in heads}
        for rid in self.ids():
            if rid not in stored:
                try:
                    r = self.load(rid)
                except RolloutError:
                    continue  # not a rollout (another .json file): `rollout status` says why
                heads.append(_head(rid, json.dumps(head_to_json(r)), str(self.path(rid))))
        heads.sort(key=lambda h: (-h.created_unix, h.rollout_id))
        return heads[:MAX_LISTED], len(heads)


def _head(rid: str, body: str, source: str) -> RolloutHead:
    try:
        doc = json.loads(body)
        s, t = doc["spec"], doc["spec"]["target"]
        target = (t["group"] and f"group:{t['group']}") or (
            " ".join(t["devices"]) if t["kind"] == "devices" else "all"
        )  # fmt: skip
        return RolloutHead(
            rollout_id=rid,
            update_id=str(s["update_id"]),
            target=str(target),
            state=str(doc["state"]),
            reason=str(doc["reason"]),
            wave=int(doc["wave"]) + 1,
            waves=len(doc["waves"]),
            created_unix=float(s["created_unix"]),
            updated_unix=float(doc["updated_unix"]),
            halts=len(doc["halts"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise RolloutError(f"{source}: not a rollout ({exc})") from exc
