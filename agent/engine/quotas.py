"""Per-client quotas: what one client key may hold of the engine's shared bounds.

Three quotas, each a hard bound per client key (the anonymous owner "" is one client like any
other): live sessions, the KV bytes its sessions hold (what they take, or will take, in the
host and disk tiers: their used rows), and requests waiting in the queue. By default each is
half of the shared bound it divides, so that no single client can ever take everything; fair
eviction (`agent.kv.quota`) and round-robin admission (`agent.engine.scheduler`) share the rest
between any number of clients. A client over a quota is refused with `QuotaExceeded`
(RESOURCE_EXHAUSTED / 429) naming it; no other client notices.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from agent.base.errors import QuotaExceeded
from agent.engine.sessions.session import Session
from agent.engine.stats import ModelInfo
from agent.engine.types import EngineLimits
from agent.profile import KVConfig

log = logging.getLogger(__name__)

SHARE = 2  # the derived defaults: one client may hold 1/SHARE of each shared bound


@dataclass(frozen=True, slots=True)
class ClientQuotas:
    """The per-client bounds of one engine, resolved. `session_bytes` None: no byte quota
    (no host or disk tier to share)."""

    sessions: int
    session_bytes: int | None
    waiting: int
    row_bytes: int  # KV bytes of one token's row (the byte quota's unit of growth)

    @classmethod
    def resolve(
        cls,
        *,
        sessions: int | None,
        session_bytes: int | None,
        waiting: int | None,
        max_sessions: int,
        queue_capacity: int,
        max_active: int,
        tier_bytes: int,
        kv_per_session: int,
        context_length: int,
    ) -> ClientQuotas:
        """Explicit values as given; None: half of the shared bound (at least one session, one
        whole session's KV, and as many waiting requests as could run at once: a burst that
        the engine thread has not admitted yet is not refused while slots are free)."""
        if session_bytes is None and tier_bytes > 0:
            session_bytes = max(kv_per_session, tier_bytes // SHARE)
        return cls(
            sessions=max(1, max_sessions // SHARE) if sessions is None else sessions,
            session_bytes=session_bytes,
            waiting=min(queue_capacity, max(1, queue_capacity // SHARE, max_active))
            if waiting is None
            else waiting,
            row_bytes=-(-kv_per_session // max(1, context_length)),
        )

    @classmethod
    def of(cls, limits: EngineLimits, kv: KVConfig, disk: bool, info: ModelInfo) -> ClientQuotas:
        """An engine's quotas: its limits' explicit values, the rest derived from its bounds
        (the host tier, and the disk tier when it has a state directory)."""
        return cls.resolve(
            sessions=limits.sessions_per_client,
            session_bytes=limits.session_bytes_per_client,
            waiting=limits.waiting_per_client,
            max_sessions=limits.max_sessions,
            queue_capacity=limits.queue_capacity,
            max_active=limits.max_active,
            tier_bytes=kv.host_max_bytes + (kv.disk_max_bytes if disk else 0),
            kv_per_session=info.memory.kv_per_session,
            context_length=info.context_length,
        )

    def held_bytes(self, s: Session) -> int:
        """What a session's KV takes below the bound tier, or will when it moves there."""
        return s.kv_bytes if s.tier in ("host", "disk") else s.kv_len * self.row_bytes

    def check_new_session(self, sessions: Iterable[Session], owner: str, adds: int = 0) -> None:
        """Before `owner` creates (or forks, `adds` bytes) a session."""
        mine = [s for s in sessions if s.owner == owner]
        if len(mine) >= self.sessions:
            raise _refused(
                owner,
                QuotaExceeded(
                    "sessions_per_client",
                    self.sessions,
                    f"{len(mine)} sessions",
                    "delete one of its sessions first",
                ),
            )
        self._check_bytes(owner, mine, adds)

    def check_turn(self, sessions: Iterable[Session], owner: str) -> None:
        """Before a turn of one of `owner`'s sessions: its sessions' bytes are within quota (the
        turn may take it past by that turn's own rows; the next call is refused then)."""
        self._check_bytes(owner, [s for s in sessions if s.owner == owner], 0)

    def _check_bytes(self, owner: str, mine: list[Session], adds: int) -> None:
        if self.session_bytes is None:
            return
        held = sum(self.held_bytes(s) for s in mine)
        if held + adds > self.session_bytes or (adds == 0 and held >= self.session_bytes):
            extra = f" (+{adds} for the copy)" if adds else ""
            raise _refused(
                owner,
                QuotaExceeded(
                    "session_bytes_per_client",
                    self.session_bytes,
                    f"{held} bytes of session KV{extra}",
                    "delete some of its sessions first",
                ),
            )


def _refused(owner: str, exc: QuotaExceeded) -> QuotaExceeded:
    """One line per refusal (the owner is the key's hash, never the key)."""
    log.warning("client %s refused: %s", owner or "(anonymous)", exc)
    return exc
