"""Giving freed memory back to the system: after the load's one-off steps (the rewrite of the
model, the first packing of its weights, the check of its KV windows), so that a board's
steady-state RSS is what serving needs, not what loading once needed; and while serving, so
that a KV cache moved to another window does not leave its old buffers in the heap."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Final

# glibc's mallopt parameter, and the value it starts with: allocations this large or larger
# get their own mapping, which free() unmaps.
_M_MMAP_THRESHOLD: Final = -3
MMAP_THRESHOLD: Final = 128 * 1024


def give_back_memory() -> None:
    """Return freed heap to the system: the rewrite's object graph of a SmolLM-shaped int8
    model with KV windows peaks at ~140 MiB, and glibc kept ~60 MiB of such a heap (measured)
    unless asked to trim."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)


def keep_large_buffers_mapped() -> None:
    """Give every allocation of 128 KiB or more its own mapping, returned to the system when
    it is freed: a KV cache buffer, a window's zeros, a spilled session's rows.

    glibc starts with that threshold but raises it to the size of each mapped block freed (up
    to 32 MiB), after which such buffers come from the heap, and a freed KV window leaves a
    hole the next, larger window's buffers do not fit in. Measured on the SmolLM-shaped int8
    model: a 448-token prompt after short ones (the 256-row window's buffers freed, the 512-row
    window's made) peaked 12 MiB higher with the moving threshold. Decode steps allocate
    nothing this large (the logits are written into the runner's own array)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy stands
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
