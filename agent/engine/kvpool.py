"""The engine's runtime KV caches: made on demand, up to the number the memory plan holds."""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.runtime.runner import KVCache

log = logging.getLogger("agent.engine.sessions")  # moved from sessions.py: lines keep their name


class KVPool:
    """Runtime KV caches, made on demand up to `capacity`. `doubling` (kNextPowerOfTwo) grows
    the pool by as many as it has, otherwise (kSameAsRequested) by exactly one."""

    def __init__(self, make: Callable[[], KVCache], capacity: int, doubling: bool) -> None:
        self._make = make
        self.capacity = capacity
        self._doubling = doubling
        self._free: list[KVCache] = []
        self.made = 0

    def grow(self, count: int) -> None:
        count = min(count, self.capacity - self.made)
        self._free.extend(self._make() for _ in range(count))
        self.made += count
        if count:
            log.info("KV pool grown by %d to %d caches", count, self.made)

    def take(self) -> KVCache | None:
        """A free cache, or None when all `capacity` are in use."""
        if not self._free and self.made < self.capacity:
            self.grow(max(1, self.made) if self._doubling else 1)
        return self._free.pop() if self._free else None

    def give(self, kv: KVCache) -> None:
        self._free.append(kv)
