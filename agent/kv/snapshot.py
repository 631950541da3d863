"""`KVSnapshot`: the used rows of one session's KV cache, held in host memory.

A snapshot is what moves between the tiers below the bound one (host, disk, prefix cache). It
knows nothing of layouts: the runtime decides which rows of which tensors it holds and how to
bind them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The used rows of one session's KV cache, off the accelerator.

    ``arrays`` maps a KV tensor name (e.g. ``kv_cache_k_0``) to an array holding only the used
    rows, in whatever dtype and shape the runtime chose. The arrays are not copied here: treat
    them as read-only once they are in a snapshot.
    """

    model_sha256: str  # hex sha256 of the model file the rows were computed with
    tokens: tuple[int, ...]  # the token ids whose KV rows these are (len == rows)
    arrays: Mapping[str, NDArray[Any]]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (the size that counts against a tier's budget)."""
        return sum(int(a.nbytes) for a in self.arrays.values())

    def same_as(self, other: KVSnapshot) -> bool:
        """True when both hold the same model, tokens, names, dtypes, shapes and bytes."""
        if (self.model_sha256, self.tokens) != (other.model_sha256, other.tokens):
            return False
        if self.arrays.keys() != other.arrays.keys():
            return False
        return all(_bit_equal(a, other.arrays[name]) for name, a in self.arrays.items())


def _bit_equal(a: NDArray[Any], b: NDArray[Any]) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # Compare bytes, not values: NaN payloads and -0.0 must survive a round trip too.
    return bool(np.array_equal(_raw(a), _raw(b)))


def _raw(a: NDArray[Any]) -> NDArray[np.uint8]:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
