"""Shared-prefix cache: KV rows of token prefixes (system prompts, few-shot headers) by block.

A prefix is stored only in whole blocks of `block` tokens and is keyed by the chained hash of
its last block, so one lookup per block boundary finds the longest stored prefix of a prompt.
A hit is confirmed by comparing the token ids, so a hash collision can only cost a miss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from agent.kv.lru import ByteLRU
from agent.kv.snapshot import KVSnapshot


def block_hashes(tokens: Sequence[int], block: int) -> list[bytes]:
    """Chained 16-byte hashes of each FULL block of `tokens` (a trailing partial block has none).

    Hash i covers blocks 0..i: blake2b(hash[i-1] + block i as little-endian int32).
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, not {block}")
    full = len(tokens) // block
    ids = np.asarray(tokens[: full * block], dtype="<i4")
    out: list[bytes] = []
    prev = b""
    for i in range(full):
        chunk = ids[i * block : (i + 1) * block].tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        out.append(prev)
    return out


class PrefixCache:
    """Snapshots of whole-block prompt prefixes in a `ByteLRU`; counts hits and misses."""

    def __init__(self, budget_bytes: int, block: int) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, not {block}")
        self.block = block
        self.hits = 0
        self.misses = 0
        self._lru: ByteLRU[bytes, KVSnapshot] = ByteLRU(budget_bytes)

    @property
    def usage_bytes(self) -> int:
        """Bytes of KV held."""
        return self._lru.usage_bytes

    @property
    def entries(self) -> int:
        """Number of prefixes held."""
        return len(self._lru)

    def insert(self, tokens: Sequence[int], snapshot: KVSnapshot) -> bool:
        """Store `snapshot`, the KV rows of ``tokens[:n]`` with n a positive multiple of `block`.

        Returns False when the snapshot is larger than the whole budget (nothing is stored).
        Least recently used prefixes are evicted to make room.
        """
        n = len(snapshot.tokens)
        if n == 0 or n % self.block:
            raise ValueError(f"a prefix holds a positive multiple of {self.block} tokens, not {n}")
        if snapshot.tokens != tuple(tokens[:n]):
            raise ValueError("the snapshot's tokens are not a prefix of the tokens given")
        key = block_hashes(snapshot.tokens, self.block)[-1]
        evicted = self._lru.put(key, snapshot, snapshot.nbytes)
        return all(k != key for k, _ in evicted)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether exactly `tokens` (whole blocks) are stored; neither a hit nor a miss."""
        if not tokens or len(tokens) % self.block:
            return False
        found = self._lru.peek(block_hashes(tokens, self.block)[-1])
        return found is not None and found.tokens == tuple(tokens)

    def lookup(self, tokens: Sequence[int]) -> KVSnapshot | None:
        """The snapshot of the longest stored whole-block prefix of `tokens`, or None.

        A caller that still needs logits for the last prompt token passes ``tokens[:-1]``.
        """
        hashes = block_hashes(tokens, self.block)
        for i in range(len(hashes) - 1, -1, -1):
            found = self._lru.peek(hashes[i])
            n = (i + 1) * self.block
            if found is not None and found.tokens == tuple(tokens[:n]):
                self._lru.get(hashes[i])  # now most recently used
                self.hits += 1
                return found
        self.misses += 1
        return None
