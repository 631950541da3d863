"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator per request."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from agent.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the parameter, its value and the allowed range."""
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise InvalidRequest(f"temperature = {self.temperature} is out of range [0, 2]")
        if not 0 <= self.top_k <= vocab_size:
            raise InvalidRequest(f"top_k = {self.top_k} is out of range [0, {vocab_size}]")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p = {self.top_p} is out of range (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed = {self.seed} is out of range [0, 2^63)")


class Sampler:
    """Samples token ids from logits; one instance per request (it owns the RNG state)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: npt.NDArray[np.float32]) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < scaled.shape[-1]:
            # Keep the k largest; ties at the boundary all survive, as in most runtimes.
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled >= kth, scaled, -np.inf)
        scaled -= scaled.max()
        probs = np.exp(scaled)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # Smallest prefix whose mass reaches top_p (always at least one token).
            keep = int(np.searchsorted(cumulative, p.top_p) + 1)
            mask = np.zeros_like(probs)
            mask[order[:keep]] = probs[order[:keep]]
            probs = mask / mask.sum()
        return int(self._rng.choice(probs.shape[-1], p=probs))
