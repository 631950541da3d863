"""The engine's session calls: each one takes the engine's lock and asks its `SessionStore`."""

from __future__ import annotations

import logging
import threading

from agent.engine.sessions.store import SessionStore
from agent.engine.types import SessionInfo, TierStats

log = logging.getLogger("agent.engine.engine")  # moved from engine.py: its lines keep their name


class SessionCalls:
    """Mixed into `Engine`, which sets both attributes."""

    _cv: threading.Condition
    _store: SessionStore

    def create_session(self, owner: str = "", policy: str = "error") -> str:
        """A new, empty conversation (policy `error` or `truncate` for a full context), within
        the owner's quotas; when `max_sessions` are live, room is made from the owner's own idle
        sessions or those of clients over their fair share (`SessionStore.create`)."""
        with self._cv:
            sid = self._store.create(owner, policy).id
        log.info("session %s created", sid, extra={"session_id": sid})
        return sid

    def fork_session(self, session_id: str, owner: str = "") -> str:
        """A new session with the conversation so far and a copy of its KV; the parent is
        unaffected."""
        with self._cv:
            child = self._store.fork(self._store.get(session_id, owner)).id
        log.info("session %s forked from %s", child, session_id, extra={"session_id": child})
        return child

    def delete_session(self, session_id: str, owner: str = "") -> None:
        with self._cv:
            self._store.delete(self._store.get(session_id, owner))
        log.info("session %s deleted", session_id, extra={"session_id": session_id})

    def list_sessions(self, owner: str | None = None) -> list[SessionInfo]:
        """The sessions of `owner` (None: everyone's), in creation order."""
        with self._cv:
            return self._store.infos(owner)

    def session_tokens(self, session_id: str, owner: str = "") -> list[int]:
        with self._cv:
            return list(self._store.get(session_id, owner).tokens)

    def session_count(self) -> int:
        with self._cv:
            return len(self._store.sessions)

    def hand_over_sessions(self) -> None:
        """Save idle sessions to the state directory and let go of it, so that the engine that
        replaces this one (a reload) adopts them; sessions mid-turn stay here."""
        with self._cv:
            self._store.hand_over()

    def tier_stats(self) -> TierStats:
        with self._cv:
            return self._store.stats()
