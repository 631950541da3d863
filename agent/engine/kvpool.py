"""The engine's runtime KV caches: made on demand, up to the number the memory plan holds.

A free cache remembers the token ids whose rows it holds (llama-server's slot reuse): a new
request without a session takes the one whose tokens share the longest prefix with its prompt
and starts its prefill after that prefix, copying nothing. Row i of a KV cache depends only on
tokens 0..i, so a shared prefix's rows are the rows a fresh prefill would write; rows after it
are overwritten (and hidden by the causal mask until they are).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from agent.runtime.runner import KVCache

log = logging.getLogger(
    "agent.engine.sessions.store"
)  # moved from sessions.py: lines keep their name

_NONE = np.zeros(0, dtype=np.int64)


def common_prefix(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> int:
    """How many leading token ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class KVPool:
    """Runtime KV caches, made on demand up to `capacity`. `doubling` (kNextPowerOfTwo) grows
    the pool by as many as it has, otherwise (kSameAsRequested) by exactly one. Free caches
    are kept oldest first with the token ids their rows hold (none when unknown) and how many
    of those were the prompt of the request that left them."""

    def __init__(self, make: Callable[[], KVCache], capacity: int, doubling: bool) -> None:
        self._make = make
        self.capacity = capacity
        self._doubling = doubling
        self._free: list[tuple[KVCache, npt.NDArray[np.int64], int]] = []
        self.made = 0

    def grow(self, count: int) -> None:
        count = min(count, self.capacity - self.made)
        self._free.extend((self._make(), _NONE, 0) for _ in range(count))
        self.made += count
        if count:
            log.info("KV pool grown by %d to %d caches", count, self.made)

    def take(self) -> KVCache | None:
        """A free cache whose rows are not wanted (it is written from row 0), or None when all
        `capacity` are in use."""
        got = self.take_for(())
        return got[0] if got is not None else None

    def take_for(self, ids: Sequence[int]) -> tuple[KVCache, int] | None:
        """A free cache for a prompt whose rows up to `ids` may be reused, and how many leading
        rows of it already hold ``ids[:n]``; None when all `capacity` are in use.

        The longest match is taken when it covers all of `ids`, or all of the prompt that
        left the cache (a conversation's next turn: what it loses is that turn's reply as
        the model wrote it, which the client resent in its own spelling), or at least as
        many rows as it loses; and when no cache is spare. Otherwise a spare one (holding
        nothing, or newly made) is taken, so that a conversation's cache is not thrown away
        for a few shared tokens (a BOS, a template's header)."""
        want = np.asarray(ids, dtype=np.int64)
        best, best_n = -1, 0
        if len(want):
            for i, (_, held, _) in enumerate(self._free):
                n = common_prefix(held, want)
                if n > best_n:
                    best, best_n = i, n
        if best >= 0:
            _, held, prompt = self._free[best]
            if best_n == len(want) or best_n >= prompt or 2 * best_n >= len(held):
                return self._pop(best), best_n
        spare = self._spare()
        if spare is not None:
            return self._pop(spare), 0
        if best >= 0:
            return self._pop(best), best_n
        if self._free:  # the least recently given: its rows are not wanted
            return self._pop(0), 0
        return None

    def give(self, kv: KVCache, tokens: Sequence[int] = (), prompt: int = 0) -> None:
        """A cache back to the free list; `tokens` are the ids whose rows it holds from row 0
        (every one of those rows written in full), or empty when that is not known; the
        first `prompt` of them were its request's prompt."""
        self._free.append((kv, np.asarray(tokens, dtype=np.int64), prompt))

    def _spare(self) -> int | None:
        """Index of a free cache holding nothing, made now if the plan allows one more."""
        for i, (_, held, _) in enumerate(self._free):
            if not len(held):
                return i
        if self.made < self.capacity:
            self.grow(max(1, self.made) if self._doubling else 1)
            return len(self._free) - 1
        return None

    def _pop(self, i: int) -> KVCache:
        return self._free.pop(i)[0]
