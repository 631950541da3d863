"""Sessions and the tiers their KV moves through: bound → host → disk.

* **bound**: the session holds a runtime KV cache of its own, bound in place; switching between
  bound sessions copies nothing.
* **host**: only its used rows, in RAM, under the profile's `kv.host_max_bytes` (LRU).
* **disk**: a checksummed file in the state directory under `kv.disk_max_bytes` (LRU); it
  survives a restart while the model's sha256 is unchanged.

A session leaves the bound tier only when its cache is needed by someone else (least recently
used first), and comes back on its next turn. Moving copies the rows bit for bit, so a session
continues exactly as one that never moved. Every method runs under the engine's lock.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from agent.base.errors import InvalidRequest, NotFound, Overloaded, SessionBusy, SessionLost
from agent.engine.kvpool import KVPool
from agent.engine.quotas import ClientQuotas
from agent.engine.sessions.session import Session
from agent.engine.types import SESSION_POLICIES, SessionInfo, TierStats
from agent.kv.disk import DiskTier
from agent.kv.lru import ByteLRU
from agent.kv.prefix import PrefixCache
from agent.kv.quota import Holding, fair_share, fair_victims
from agent.kv.snapshot import KVSnapshot
from agent.runtime.runner import KVCache, Runner

log = logging.getLogger(__name__)

LOST_REMEMBERED = 256  # lost session ids kept so that their client hears why


class SessionStore:
    """All sessions of one engine and the movement of their KV between tiers."""

    def __init__(
        self,
        runner: Runner,
        pool: KVPool,
        model_sha256: str,
        *,
        max_sessions: int,
        host_budget: int,
        disk: DiskTier | None,
        prefix: PrefixCache | None,
        quotas: ClientQuotas | None = None,
    ) -> None:
        self._runner = runner
        self._pool = pool
        self._sha = model_sha256
        self.max_sessions = max_sessions
        self.quotas = quotas or ClientQuotas(max_sessions, None, 1 << 30, 0)
        self._host: ByteLRU[str, KVSnapshot] = ByteLRU(host_budget)
        self._disk = disk
        self.prefix = prefix
        self.sessions: dict[str, Session] = {}
        self._lost: dict[str, tuple[str, str]] = {}  # id -> (owner, why)
        self._staged: dict[str, KVSnapshot] = {}  # read from disk for a turn not yet admitted
        self._n = dict.fromkeys(
            ("spills", "restores_host", "restores_disk", "lost", "hits", "misses"), 0
        )
        if disk is not None:
            self._lost.update(disk.invalidated)
            for e in disk.entries():
                m = e.meta
                self.sessions[e.key] = Session(
                    e.key,
                    str(m.get("owner", "")),
                    str(m.get("policy", "error")),
                    float(m.get("created", 0.0)),
                    float(m.get("last_used", 0.0)),
                    [int(t) for t in m.get("tokens", [])],
                    [int(t) for t in m.get("turns", [])],
                    kv_len=e.tokens,
                    tier="disk",
                    kv_bytes=e.nbytes,
                )
            if self.sessions:
                log.info("%d saved sessions found in %s", len(self.sessions), disk.dir)

    # ------------------------------------------------------------------ lifecycle

    def create(self, owner: str, policy: str, adds: int = 0) -> Session:
        """A new session of `owner`'s (`adds`: the bytes a fork copies into it). Within its
        quotas; at `max_sessions` room is made only from the owner's own idle sessions or
        those of clients over their fair share (`agent.kv.quota`), else it is refused."""
        if policy not in SESSION_POLICIES:
            raise InvalidRequest(f"session policy {policy!r} is not one of {SESSION_POLICIES}")
        self.quotas.check_new_session(self.sessions.values(), owner, adds)
        if len(self.sessions) >= self.max_sessions:
            lru = sorted(self.sessions.values(), key=lambda s: s.last_used)
            held = [Holding(s.id, s.owner, 1, not s.busy) for s in lru]
            victims = fair_victims(held, owner, 1, self.max_sessions)
            if victims is None:
                share = fair_share(self.max_sessions, held, owner)
                raise Overloaded(
                    f"all {self.max_sessions} sessions (limits.max_sessions) are held by clients "
                    f"within their fair share ({share:.1f} each) or busy; try again later"
                )
            for sid in victims:
                victim = self.sessions[sid]
                self._drop(victim, self._why_evicted(victim, owner, "the session limit"))
        now = time.time()
        s = Session(uuid.uuid4().hex, owner, policy, now, now)
        self.sessions[s.id] = s
        return s

    def get(self, session_id: str, owner: str) -> Session:
        """The caller's session; another owner's is as unknown as a missing one."""
        s = self.sessions.get(session_id)
        if s is None or s.owner != owner:
            lost = self._lost.get(session_id)
            if lost is not None and lost[0] == owner:
                raise SessionLost(session_id, lost[1])
            raise NotFound(f"unknown session {session_id!r}")
        return s

    def fork(self, parent: Session) -> Session:
        """A new session with the parent's conversation and a copy of its KV rows."""
        if parent.busy:
            raise SessionBusy(f"session {parent.id} has a request running")
        snap = self._snapshot_of(parent)
        parent.busy = True  # neither dropped for the child's room nor spilled meanwhile
        try:
            child = self.create(parent.owner, parent.policy, snap.nbytes if snap else 0)
            child.tokens, child.turns = list(parent.tokens), list(parent.turns)
            if snap is not None:
                child.kv_len = len(snap.tokens)
                kv = None
                try:
                    kv = self.take_kv()
                    self._runner.write_rows(kv, snap.arrays)
                except Exception:  # no child rather than one without its rows
                    if kv is not None:
                        self._pool.give(kv)
                    del self.sessions[child.id]
                    raise
                child.kv, child.tier, child.kv_bytes = kv, "bound", kv.nbytes
        finally:
            parent.busy = False
        return child

    def delete(self, s: Session) -> None:
        if s.busy:
            raise SessionBusy(f"session {s.id} has a request running")
        self._forget(s)
        del self.sessions[s.id]

    def infos(self, owner: str | None) -> list[SessionInfo]:
        return [s.info() for s in self.sessions.values() if owner is None or s.owner == owner]

    # ------------------------------------------------------------------ tiers

    def take_kv(self) -> KVCache:
        """A runtime cache to be written from row 0: a free one, or the one of the least
        recently used idle bound session, which moves down a tier."""
        return self.take_kv_for(())[0]

    def take_kv_for(self, ids: Sequence[int]) -> tuple[KVCache, int]:
        """A runtime cache for a request without a session, and how many of its leading rows
        already hold ``ids[:n]`` (a free cache's rows, see `KVPool.take_for`); a spilled
        session's cache holds nothing reusable."""
        got = self._pool.take_for(ids)
        if got is not None:
            return got
        bound = [s for s in self.sessions.values() if s.tier == "bound" and not s.busy]
        if not bound:
            raise Overloaded(f"all {self._pool.capacity} KV caches are in use")
        victim = min(bound, key=lambda s: s.last_used)
        self.spill(victim)
        got = self._pool.take_for(())
        assert got is not None  # the spill gave one back
        return got

    def give_kv(self, kv: KVCache, tokens: Sequence[int] = (), prompt: int = 0) -> None:
        """A request's cache back to the pool, with the ids whose rows it holds in full (empty
        when they are not known, e.g. after a runtime failure), `prompt` of them its prompt."""
        self._pool.give(kv, tokens, prompt)

    def spill(self, s: Session) -> None:
        """Bound → host (→ disk when the host tier is full or off)."""
        assert s.kv is not None
        snap = self._read(s.kv, s.tokens[: s.kv_len])
        self._pool.give(s.kv)
        s.kv = None
        self._n["spills"] += 1
        self._to_host(s, snap)

    def prepare(self, s: Session) -> None:
        """Before a turn, on the caller's thread: its client must be within its byte quota,
        and a session on disk is read and checked now, so that a bad file is the caller's
        error (SessionLost), not a failed stream. The rows wait, staged, until the turn is
        admitted (or dropped by `unstage`)."""
        self.quotas.check_turn(self.sessions.values(), s.owner)
        if s.tier == "disk" and s.id not in self._staged:
            self._staged[s.id] = self._load_disk(s)

    def unstage(self, s: Session) -> None:
        """A prepared turn that never ran: its session stays where it was."""
        self._staged.pop(s.id, None)

    def note_resume(self, hit: bool) -> None:
        """A continued turn found its history's KV (hit) or had to prefill some again."""
        self._n["hits" if hit else "misses"] += 1

    def bind(self, s: Session) -> KVCache:
        """The session's own runtime cache, restoring its rows if it was spilled."""
        if s.kv is not None:
            return s.kv
        snap = None
        if s.tier == "host":
            snap = self._host.pop(s.id)
            self._n["restores_host"] += 1
        elif s.tier == "disk":
            snap = self._staged.pop(s.id, None) or self._load_disk(s)
            assert self._disk is not None
            self._disk.delete(s.id)
            self._n["restores_disk"] += 1
        s.tier = "empty"  # in transit: no spill below can pick it
        try:
            kv = self.take_kv()
        except Exception:  # no cache for it (or another's spill failed): its rows go back
            if snap is not None:
                self._to_host(s, snap)
            raise
        if snap is not None:
            try:
                self._runner.write_rows(kv, snap.arrays)
            except Exception as exc:  # never continue on a cache without its rows
                self._pool.give(kv)
                why = f"its KV could not be restored ({type(exc).__name__}: {exc})"
                self._drop(s, why)
                raise SessionLost(s.id, why) from exc
        s.kv, s.tier, s.kv_bytes = kv, "bound", kv.nbytes
        return kv

    def persist_all(self) -> None:
        """At shutdown: every session with KV goes to disk, so that it survives the restart."""
        if self._disk is None or self._disk.disabled:
            return
        for s in list(self.sessions.values()):
            if s.tier in ("bound", "host") and not s.busy:
                snap = (
                    self._read(s.kv, s.tokens[: s.kv_len])
                    if s.kv is not None
                    else self._host.pop(s.id)
                )
                if s.kv is not None:
                    self._pool.give(s.kv)
                    s.kv = None
                if snap is not None:
                    self._to_disk(s, snap)

    def hand_over(self) -> None:
        """Before another engine takes the state directory (a reload): idle sessions are saved
        to disk for it, and this store stops touching the directory."""
        self.persist_all()
        for s in [s for s in self.sessions.values() if s.tier == "disk"]:
            del self.sessions[s.id]
        self._disk = None

    def stats(self) -> TierStats:
        by = {t: [s for s in self.sessions.values() if s.tier == t] for t in ("bound", "disk")}
        disk = self._disk
        p = self.prefix
        return TierStats(
            bound_sessions=len(by["bound"]),
            bound_bytes=sum(s.kv_bytes for s in by["bound"]),
            host_sessions=len(self._host),
            host_bytes=self._host.usage_bytes,
            host_budget=self._host.budget_bytes,
            disk_sessions=len(by["disk"]),
            disk_bytes=disk.usage_bytes if disk is not None else 0,
            disk_budget=disk.budget_bytes if disk is not None else 0,
            spills=self._n["spills"],
            restores_host=self._n["restores_host"],
            restores_disk=self._n["restores_disk"],
            lost=self._n["lost"],
            resume_hits=self._n["hits"],
            resume_misses=self._n["misses"],
            prefix_hits=p.hits if p is not None else 0,
            prefix_misses=p.misses if p is not None else 0,
            prefix_bytes=p.usage_bytes if p is not None else 0,
            prefix_entries=p.entries if p is not None else 0,
        )

    # ------------------------------------------------------------------ internals

    def _read(self, kv: KVCache, tokens: list[int]) -> KVSnapshot:
        return KVSnapshot(self._sha, tuple(tokens), self._runner.read_rows(kv, len(tokens)))

    def _snapshot_of(self, s: Session) -> KVSnapshot | None:
        if s.kv is not None:
            return self._read(s.kv, s.tokens[: s.kv_len])
        if s.tier == "host":
            return self._host.peek(s.id)
        if s.tier == "disk" and self._disk is not None:
            return self._disk.get(s.id)[0]
        return None

    def _to_host(self, s: Session, snap: KVSnapshot) -> None:
        """Into the host tier, making room fairly (the evicted move on to disk); a session
        that would need room from clients within their share goes to disk itself."""
        held = [Holding(k, self._owner(k), n) for k, n in self._host.sizes()]
        victims = fair_victims(held, s.owner, snap.nbytes, self._host.budget_bytes)
        if victims is None:
            self._to_disk(s, snap)
            return
        for sid in victims:
            old = self._host.pop(sid)
            victim = self.sessions.get(sid)
            if victim is not None and old is not None:
                self._to_disk(victim, old)
        s.tier, s.kv_bytes = "host", snap.nbytes
        for sid, old in self._host.put(s.id, snap, snap.nbytes):  # nothing: room was made
            victim = self.sessions.get(sid)
            if victim is not None:
                self._to_disk(victim, old)

    def _to_disk(self, s: Session, snap: KVSnapshot) -> None:
        if self._disk is None:
            self._drop(s, "its KV did not fit the host tier and the disk tier is off")
            return
        disk = self._disk

        def choose(need: int) -> list[str] | None:  # room from s's client or those over share
            held = [
                Holding(e.key, self._owner(e.key, e.meta), e.nbytes, not self._busy(e.key))
                for e in disk.entries()
                if e.key != s.id
            ]
            return fair_victims(held, s.owner, need, disk.budget_bytes)

        try:
            stored = disk.put(s.id, snap, s.meta(), choose=choose)
        except Exception as exc:  # put reports OSError itself; this is MemoryError and the like
            self._drop(s, f"it could not be saved ({type(exc).__name__}: {exc})")
            return
        for sid in stored.evicted:
            victim = self.sessions.get(sid)
            if victim is not None and victim is not s:
                why = self._why_evicted(victim, s.owner, "the disk tier's budget")
                self._drop(victim, why, forget=False)
        if not stored.ok:
            self._drop(s, f"it could not be saved: {stored.reason}")
            return
        s.tier, s.kv_bytes = "disk", snap.nbytes

    def _owner(self, sid: str, meta: dict[str, object] | None = None) -> str:
        s = self.sessions.get(sid)
        return s.owner if s is not None else str((meta or {}).get("owner", ""))

    def _busy(self, sid: str) -> bool:
        s = self.sessions.get(sid)
        return s is not None and s.busy

    @staticmethod
    def _why_evicted(victim: Session, owner: str, bound: str) -> str:
        if victim.owner == owner:
            return f"evicted to make room for its own client within {bound}"
        return f"evicted within {bound}: its client held more than its fair share"

    def _load_disk(self, s: Session) -> KVSnapshot:
        assert self._disk is not None
        try:
            snap, _ = self._disk.get(s.id)
        except SessionLost as exc:
            self._drop(s, exc.why)
            raise
        return snap

    def _forget(self, s: Session) -> None:
        """Release the session's KV in whatever tier holds it."""
        if s.kv is not None:
            self._pool.give(s.kv)
            s.kv = None
        self._host.pop(s.id)
        self._staged.pop(s.id, None)
        if self._disk is not None and s.id in self._disk:
            self._disk.delete(s.id)

    def _drop(self, s: Session, why: str, *, forget: bool = True) -> None:
        """A session is lost: its client hears `why` on its next call."""
        if forget:
            self._forget(s)
        self.sessions.pop(s.id, None)
        self._lost[s.id] = (s.owner, why)
        while len(self._lost) > LOST_REMEMBERED:
            del self._lost[next(iter(self._lost))]
        self._n["lost"] += 1
        log.warning("session %s lost: %s", s.id, why, extra={"session_id": s.id})


def open_disk_tier(state_dir: Path | None, model_sha256: str, budget: int) -> DiskTier | None:
    """The disk tier under `state_dir`, or None when there is no state directory or budget."""
    if state_dir is None or budget <= 0:
        return None
    tier = DiskTier(state_dir, model_sha256, budget)
    if tier.disabled:
        log.warning("disk KV tier off: %s", tier.disabled)
    return tier
