"""Admission and token-level fairness: who runs the next unit of work.

Pure policy, no threads and no model: the engine thread asks `next()` for the request whose
turn it is, runs one unit of it (one prefill chunk or one decoded token), and tells the
scheduler when a request is done. Requests take turns round-robin, so a long generation
cannot starve the others and a long prompt's prefill chunks interleave with other requests'
decode steps.

Admission is fair per client first: a free slot goes to the waiting client whose last
admission is the oldest (a client with none first), and that client's oldest request. One
client with fifty requests waiting delays another client's single request by at most one of
its own, not fifty. Each client may keep at most `per_client` requests waiting.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Generic, TypeVar

from agent.base.errors import Overloaded, QuotaExceeded

T = TypeVar("T")


def _anyone(item: object) -> str:
    return ""


class Scheduler(Generic[T]):
    """A bounded waiting queue in front of at most `max_running` running requests; `client`
    names the client an item belongs to (one client for all by default)."""

    def __init__(
        self,
        max_running: int,
        queue_capacity: int,
        *,
        client: Callable[[T], str] = _anyone,
        per_client: int | None = None,
    ) -> None:
        if max_running < 1 or queue_capacity < 0:
            raise ValueError("max_running must be >= 1 and queue_capacity >= 0")
        self.max_running = max_running
        self.queue_capacity = queue_capacity
        self.per_client = queue_capacity if per_client is None else per_client
        self.waiting: deque[T] = deque()  # in submission order
        self.running: list[T] = []
        self._cursor = 0
        self._client = client
        self._admissions = 0
        self._queued: Counter[str] = Counter()  # client -> its requests in `waiting`
        # client -> number of its last admission; only clients with a request waiting or running
        self._last: dict[str, int] = {}

    def submit(self, item: T) -> None:
        """Queue a request; raises Overloaded when the queue is full, QuotaExceeded when its
        client already has `per_client` requests waiting."""
        if len(self.waiting) >= self.queue_capacity:
            raise Overloaded(
                f"request queue is full ({self.queue_capacity} waiting, "
                f"{len(self.running)} running); try again later"
            )
        who = self._client(item)
        mine = self._queued[who]
        if mine >= self.per_client:
            raise QuotaExceeded(
                "waiting_per_client",
                self.per_client,
                f"{mine} requests waiting",
                "wait for one of them to start",
            )
        self.waiting.append(item)
        self._queued[who] += 1

    def admit(self) -> list[T]:
        """Move waiting requests into free running slots, round-robin over clients; returns
        the admitted ones."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            i = self._pick()
            item = self.waiting[i]
            del self.waiting[i]
            who = self._client(item)
            self._unqueue(who)
            self._last[who] = self._admissions
            self._admissions += 1
            self.running.append(item)
            admitted.append(item)
        return admitted

    def next(self, ready: Callable[[T], bool]) -> T | None:
        """The next running request, round-robin, that `ready` accepts (None if none does)."""
        n = len(self.running)
        for i in range(n):
            item = self.running[(self._cursor + i) % n]
            if ready(item):
                self._cursor = (self._cursor + i + 1) % n
                return item
        return None

    def follow(self, ready: Callable[[T], bool], joins: Callable[[T], bool], limit: int) -> list[T]:
        """Up to `limit` requests whose turns come right after the one `next` returned, in
        round-robin order, that `joins` accepts: they share its step (packed decode) and so
        take their turns now. A request `ready` rejects is passed over, as `next` passes it;
        the first that does not join ends the run (its turn comes next, as before)."""
        n = len(self.running)
        taken: list[T] = []
        moved = 0
        for i in range(n - 1):  # the current request sits just before the cursor
            if len(taken) >= limit:
                break
            item = self.running[(self._cursor + i) % n]
            if not ready(item):
                continue
            if not joins(item):
                break
            taken.append(item)
            moved = i + 1
        if n:
            self._cursor = (self._cursor + moved) % n
        return taken

    def finish(self, item: T) -> None:
        """A running request is done: free its slot."""
        i = self.running.index(item)
        self.running.pop(i)
        if i < self._cursor:
            self._cursor -= 1
        if self.running:
            self._cursor %= len(self.running)
        else:
            self._cursor = 0
        self._forget(self._client(item))

    def drop_waiting(self, keep: Callable[[T], bool]) -> list[T]:
        """Remove waiting requests that `keep` rejects (e.g. cancelled ones); returns them."""
        dropped = [w for w in self.waiting if not keep(w)]
        if dropped:
            self.waiting = deque(w for w in self.waiting if keep(w))
            for w in dropped:
                self._unqueue(self._client(w))
            for who in {self._client(w) for w in dropped}:
                self._forget(who)
        return dropped

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _pick(self) -> int:
        """Index in `waiting` of the first request of the client admitted least recently."""
        if len(self._queued) == 1:
            return 0  # one client waiting: its oldest
        best, best_key = 0, (0, 0)
        seen: set[str] = set()
        for i, item in enumerate(self.waiting):
            who = self._client(item)
            if who in seen:
                continue
            seen.add(who)
            key = (self._last.get(who, -1), i)
            if not i or key < best_key:
                best, best_key = i, key
            if len(seen) == len(self._queued):
                break  # every waiting client's first request seen
        return best

    def _unqueue(self, who: str) -> None:
        self._queued[who] -= 1
        if not self._queued[who]:
            del self._queued[who]

    def _forget(self, who: str) -> None:
        """A client with nothing waiting or running starts afresh (keeps `_last` bounded)."""
        if (
            who in self._last
            and who not in self._queued
            and not any(self._client(x) == who for x in self.running)
        ):
            del self._last[who]
