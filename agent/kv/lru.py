"""`ByteLRU`: an ordered map bounded in bytes (the host tier and the prefix cache use it)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Values with a byte size each; their sum never exceeds `budget_bytes`.

    `put` evicts least recently used entries to make room and returns them, so nothing leaves
    silently: every value put is present, was returned by a `put`, was popped, or was replaced
    by a later `put` under the same key. A value larger than the whole budget is refused: `put`
    returns it as the only "evicted" entry and changes nothing else (except that an older value
    under that key is dropped, since the caller meant to replace it). A budget of 0 refuses
    everything. Not thread-safe: one owner thread.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        self._budget = budget_bytes
        self._usage = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()  # least recently used first

    @property
    def budget_bytes(self) -> int:
        """The bound on `usage_bytes`."""
        return self._budget

    @property
    def usage_bytes(self) -> int:
        """Sum of the sizes of the values held."""
        return self._usage

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def keys(self) -> list[K]:
        """The keys, least recently used first."""
        return list(self._items)

    def sizes(self) -> list[tuple[K, int]]:
        """(key, size) of every entry, least recently used first."""
        return [(k, n) for k, (_, n) in self._items.items()]

    def put(self, key: K, value: V, nbytes: int) -> list[tuple[K, V]]:
        """Store `value` as most recently used; return what was evicted, least recent first."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, not {nbytes}")
        self.pop(key)
        if nbytes > self._budget:
            return [(key, value)]
        evicted: list[tuple[K, V]] = []
        while self._usage + nbytes > self._budget:
            old_key, (old_value, old_bytes) = self._items.popitem(last=False)
            self._usage -= old_bytes
            evicted.append((old_key, old_value))
        self._items[key] = (value, nbytes)
        self._usage += nbytes
        return evicted

    def get(self, key: K) -> V | None:
        """The value under `key` (now most recently used), or None."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def peek(self, key: K) -> V | None:
        """The value under `key` without touching the LRU order, or None."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def pop(self, key: K) -> V | None:
        """Remove and return the value under `key`, or None."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        self._usage -= item[1]
        return item[0]
