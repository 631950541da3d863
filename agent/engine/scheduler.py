"""Admission and token-level fairness: who runs the next unit of work.

Pure policy, no threads and no model: the engine thread asks `next()` for the request whose
turn it is, runs one unit of it (one prefill chunk or one decoded token), and tells the
scheduler when a request is done. Requests take turns round-robin, so a long generation
cannot starve the others and a long prompt's prefill chunks interleave with other requests'
decode steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from agent.errors import Overloaded

T = TypeVar("T")


class Scheduler(Generic[T]):
    """A bounded waiting queue in front of at most `max_running` running requests."""

    def __init__(self, max_running: int, queue_capacity: int) -> None:
        if max_running < 1 or queue_capacity < 0:
            raise ValueError("max_running must be >= 1 and queue_capacity >= 0")
        self.max_running = max_running
        self.queue_capacity = queue_capacity
        self.waiting: deque[T] = deque()
        self.running: list[T] = []
        self._cursor = 0

    def submit(self, item: T) -> None:
        """Queue a request; raises Overloaded when the queue is full."""
        if len(self.waiting) >= self.queue_capacity:
            raise Overloaded(
                f"request queue is full ({self.queue_capacity} waiting, "
                f"{len(self.running)} running); try again later"
            )
        self.waiting.append(item)

    def admit(self) -> list[T]:
        """Move waiting requests into free running slots (FIFO); returns the admitted ones."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            item = self.waiting.popleft()
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

    def drop_waiting(self, keep: Callable[[T], bool]) -> list[T]:
        """Remove waiting requests that `keep` rejects (e.g. cancelled ones); returns them."""
        dropped = [w for w in self.waiting if not keep(w)]
        if dropped:
            self.waiting = deque(w for w in self.waiting if keep(w))
        return dropped

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)
