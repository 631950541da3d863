"""Quantization choice: the order ``auto`` tries for a memory budget and a backend, and the
variant picked from what a model directory offers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

from agent.base.errors import ConfigError
from agent.base.tomltable import GiB
from agent.base.tomltable import size_text as _size_text
from agent.profile.schema import AUTO, DeviceProfile

log = logging.getLogger(__name__)

# Quantizations from the smallest weight footprint to the largest. int4 block sizes differ only
# in how many scales they store (one per 128 / 64 / 32 weights); "mixed" is int8 with embeddings
# and attention output kept in float, so it is larger than int8.
FOOTPRINT_ORDER: Final = (
    "int4_block128",
    "int4_block64",
    "int4_block32",
    "int8",
    "mixed",
    "int8_weight_only",  # int8 on disk, dequantized to float when it loads
    "fp16",  # half the file of fp32, dequantized to float when it loads
    "fp32",
)
# tflite-runtime 2.14 cannot run int4 blockwise graphs (EMBEDDING_LOOKUP type error, FACTS.md),
# and its dynamic-range int8 kernels compute zeros (measured): it runs weight-only int8 or fp32.
LEGACY_ORDER: Final = ("int8_weight_only", "fp32")


def quantization_preference(max_num_bytes: int, backend: str = "ai-edge-litert") -> tuple[str, ...]:
    """The order in which ``auto`` tries quantizations for a memory budget.

    Under 2 GiB int4 (block32, then 64, then 128), from 2 GiB up to and including 4 GiB int8,
    above 4 GiB mixed. After the preferred ones come the smaller-footprint ones (largest first),
    then the larger ones (smallest first). tflite-runtime runs only weight-only int8 and fp32
    (int4 fails to load, dynamic-range int8 computes zeros), so it gets exactly those.
    """
    if backend == "tflite-runtime":
        return LEGACY_ORDER
    if max_num_bytes < 2 * GiB:
        preferred: tuple[str, ...] = ("int4_block32", "int4_block64", "int4_block128")
    elif max_num_bytes <= 4 * GiB:
        preferred = ("int8",)
    else:
        preferred = ("mixed",)
    first = FOOTPRINT_ORDER.index(preferred[0])
    smaller = tuple(reversed(FOOTPRINT_ORDER[:first]))
    larger = FOOTPRINT_ORDER[first + 1 :]
    return preferred + tuple(q for q in smaller + larger if q not in preferred)


def choose_quantization(profile: DeviceProfile, available: Sequence[str]) -> str:
    """Pick the model variant to load from the quantizations a model directory offers."""
    wanted = profile.model.quantization
    key = "model.quantization"
    offered = ", ".join(available) if available else "(none: the model directory has no variants)"
    if wanted != AUTO:
        if wanted in available:
            return wanted
        raise ConfigError(str(profile.source), key, wanted, f"one of the available: {offered}")
    order = quantization_preference(profile.runtime.max_num_bytes, profile.runtime.backend)
    for quant in order:
        if quant in available:
            log.info(
                "profile %s: budget %s, auto quantization -> %s (order %s)",
                profile.name,
                _size_text(profile.runtime.max_num_bytes),
                quant,
                ",".join(order),
            )
            return quant
    raise ConfigError(
        str(profile.source),
        key,
        wanted,
        f"a profile whose backend {profile.runtime.backend!r} can run one of: {offered}",
    )
