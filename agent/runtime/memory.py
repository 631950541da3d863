"""Giving freed memory back to the system after the load's one-off steps (the rewrite of the
model, the first packing of its weights, the check of its KV windows), so that a board's
steady-state RSS is what serving needs, not what loading once needed."""

from __future__ import annotations

import contextlib
import ctypes
import gc


def give_back_memory() -> None:
    """Return freed heap to the system: the rewrite's object graph of a SmolLM-shaped int8
    model with KV windows peaks at ~140 MiB, and glibc kept ~60 MiB of such a heap (measured)
    unless asked to trim."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)
