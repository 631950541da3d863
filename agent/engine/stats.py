"""What the engine reports about itself: the loaded model, and its request counters.

Plain frozen values (`ModelInfo`, `EngineStats`, `Percentiles`) that status, rpc and fleet read
without importing the engine, and `Tally`, the bookkeeping behind `Engine.stats()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.engine.types import TokenEvent

if TYPE_CHECKING:  # only a field's type: importing it needs numpy
    from agent.runtime.plan import MemoryPlan

WINDOW = 512  # requests kept for the p50/p95 figures
# how a request that ran ended in an error: the model gave NaN/inf logits, constrained decoding
# could not go on, its deadline passed, anything else (the runtime failed, no KV for it)
ERROR_KINDS = ("nonfinite", "constraint", "timeout", "internal")
DEADLINE_EXCEEDED = "deadline exceeded"  # the error of a request cut at its deadline


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What is loaded and how it runs."""

    name: str
    version: str
    quantization: str
    sha256: str
    path: Path
    vocab_size: int
    context_length: int
    kv_layout: str
    signatures: tuple[str, ...]
    accelerator: str
    execution_path: str
    fallbacks: tuple[str, ...]
    memory: MemoryPlan
    prepared: str = "none"  # the runtime's copy of the file: what it changed, or why refused
    digest: str = ""  # agent.model.directory.model_digest of every file that defines the model
    batch_sizes: tuple[int, ...] = ()  # packed decode's rows per call in use (agent.engine.packing)
    batch_problem: str = ""  # why packed decode is off ("" when on)


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p95: float


NO_FIGURES = Percentiles(0.0, 0.0)  # no request measured yet


@dataclass(frozen=True, slots=True)
class EngineStats:
    queue_depth: int
    queue_capacity: int
    active: int
    max_active: int
    requests_total: int
    requests_failed: int
    requests_rejected: int
    requests_cancelled: int
    tokens_generated: int
    ttft_ms: Percentiles
    decode_tok_s: Percentiles
    heartbeat_age_s: float
    nonfinite_logits: int = 0  # requests ended because the model gave NaN/inf logits
    # speculative decoding, over every finished request: drafts verified, drafts accepted
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_tok_s: Percentiles = NO_FIGURES
    samples: int = 0  # requests behind the percentiles (the last WINDOW at most)
    # requests ended in an error, by kind (every one of ERROR_KINDS; a "timeout" is also
    # counted in requests_cancelled, the others in requests_failed)
    errors: tuple[tuple[str, int], ...] = ()


def _percentiles(values: deque[float]) -> Percentiles:
    if not values:
        return Percentiles(0.0, 0.0)
    s = sorted(values)
    return Percentiles(s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.95))])


class Tally:
    """The engine's request counters and its last `WINDOW` requests' figures. Not locked:
    every call runs under the engine's lock."""

    def __init__(self) -> None:
        self.totals = {
            "total": 0,
            "failed": 0,
            "rejected": 0,
            "cancelled": 0,
            "tokens": 0,
            "nonfinite": 0,
            "drafted": 0,
            "accepted": 0,
        }
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self._ttft: deque[float] = deque(maxlen=WINDOW)
        self._decode: deque[float] = deque(maxlen=WINDOW)
        self._prefill: deque[float] = deque(maxlen=WINDOW)
        self._samples = 0

    def finished(self, last: TokenEvent, error_kind: str = "internal") -> None:
        """A request that ran ended with `last`; `error_kind` (one of ERROR_KINDS) says why
        when it ended in an error. A cancel at the deadline counts as a "timeout"."""
        stats = last.stats
        self.totals["total"] += 1
        if last.finish_reason == "error":
            self.totals["failed"] += 1
            self.errors[error_kind if error_kind in self.errors else "internal"] += 1
        if last.finish_reason == "cancelled":
            self.totals["cancelled"] += 1
            if last.error == DEADLINE_EXCEEDED:
                self.errors["timeout"] += 1
        if stats is not None:
            self.totals["tokens"] += stats.generated_tokens
            self.totals["drafted"] += stats.drafted_tokens
            self.totals["accepted"] += stats.accepted_tokens
            if stats.generated_tokens:
                self._ttft.append(stats.ttft_ms)
            if stats.decode_tok_s:
                self._decode.append(stats.decode_tok_s)
            if stats.prefill_tok_s:
                self._prefill.append(stats.prefill_tok_s)
            if stats.generated_tokens:
                self._samples = min(WINDOW, self._samples + 1)

    def stats(
        self,
        *,
        queue_depth: int,
        queue_capacity: int,
        active: int,
        max_active: int,
        heartbeat_age_s: float,
    ) -> EngineStats:
        t = self.totals
        return EngineStats(
            queue_depth=queue_depth,
            queue_capacity=queue_capacity,
            active=active,
            max_active=max_active,
            requests_total=t["total"],
            requests_failed=t["failed"],
            requests_rejected=t["rejected"],
            requests_cancelled=t["cancelled"],
            tokens_generated=t["tokens"],
            ttft_ms=_percentiles(self._ttft),
            decode_tok_s=_percentiles(self._decode),
            heartbeat_age_s=heartbeat_age_s,
            nonfinite_logits=t["nonfinite"],
            drafted_tokens=t["drafted"],
            accepted_tokens=t["accepted"],
            prefill_tok_s=_percentiles(self._prefill),
            samples=self._samples,
            errors=tuple(self.errors.items()),
        )
