"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator per request,
and, for structured output, a grammar's mask applied before any of them choose."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from agent.errors import InvalidRequest, NonFiniteLogits

if TYPE_CHECKING:
    from agent.profile import GenerationDefaults


class GrammarState(Protocol):
    """One request's place in a grammar (`agent.engine.constrain.ConstraintState`)."""

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...

    def advance(self, token: int) -> None: ...


class Grammar(Protocol):
    """A compiled constraint (`agent.engine.constrain.CompiledConstraint`)."""

    def start(self) -> GrammarState: ...


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # structured output: only tokens this grammar allows (the intake compiles it)
    constraint: Grammar | None = None

    @classmethod
    def with_defaults(
        cls,
        defaults: GenerationDefaults,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> SamplingParams:
        """A request's sampling: what it says, else the profile's defaults (both APIs)."""
        return cls(
            temperature=defaults.temperature if temperature is None else temperature,
            top_k=defaults.top_k if top_k is None else top_k,
            top_p=defaults.top_p if top_p is None else top_p,
            seed=seed,
        )

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
    """Samples token ids from logits; one instance per request (it owns the RNG state).

    Work per token stays small next to a decode step: top-k narrows the vocabulary with an
    O(V) partition before any exponentials or sorting, and the draw is one uniform number
    against a cumulative sum.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._constraint = params.constraint.start() if params.constraint is not None else None

    def __call__(self, logits: npt.NDArray[np.float32]) -> int:
        """A token id; NonFiniteLogits if the logits hold NaN or infinity (found at no extra
        cost: argmax stops at the first NaN, and either makes the weights' sum non-finite).

        Under a constraint, the forbidden tokens' logits are -inf first (so greedy takes the
        best allowed token, and the weights of forbidden ones are 0), and the grammar then
        advances on the chosen token."""
        if self._constraint is None:
            return self._choose(logits)
        token = self._choose(self._constraint.mask(logits))
        self._constraint.advance(token)
        return token

    def _choose(self, logits: npt.NDArray[np.float32]) -> int:
        p = self.params
        if p.temperature == 0.0:
            token = int(logits.argmax())  # the method: np.argmax's dispatch costs more
            if not math.isfinite(logits[token]):
                raise NonFiniteLogits(f"the model produced non-finite logits ({logits[token]})")
            return token
        vocab = logits.shape[-1]
        if 0 < p.top_k < vocab:
            ids = np.argpartition(logits, vocab - p.top_k)[vocab - p.top_k :]
        else:
            ids = np.arange(vocab)
        z = logits[ids].astype(np.float64)
        if p.top_p < 1.0:
            order = np.argsort(-z, kind="stable")  # by logit = by probability
            ids, z = ids[order], z[order]
        weights = np.exp((z - z.max()) / p.temperature)
        cumulative = np.cumsum(weights)
        if not math.isfinite(float(cumulative[-1])):
            raise NonFiniteLogits("the model produced non-finite logits (NaN or infinity)")
        if p.top_p < 1.0:
            # Smallest prefix whose mass reaches top_p (always at least one token).
            keep = int(np.searchsorted(cumulative, p.top_p * cumulative[-1])) + 1
            cumulative = cumulative[:keep]
        j = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
        return int(ids[min(j, len(cumulative) - 1)])
