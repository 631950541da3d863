"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator per request;
before any of them choose, the request's logit bias and repetition penalties
(`agent.engine.penalties`) on the raw logits, then, for structured output, a grammar's mask."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from agent.base.errors import InvalidRequest, NonFiniteLogits
from agent.engine.penalties import (
    BIAS_RANGE,
    PENALTY_RANGE,
    REPEAT_LAST_N_MAX,
    REPETITION_RANGE,
    Penalties,
)

if TYPE_CHECKING:
    from agent.profile import GenerationDefaults


class GrammarState(Protocol):
    """One request's place in a grammar (`agent.constraint.compiler.ConstraintState`)."""

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...

    def advance(self, token: int) -> None: ...


class Grammar(Protocol):
    """A compiled constraint (`agent.constraint.compiler.CompiledConstraint`)."""

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
    # added to the raw logits first (agent.engine.penalties): (token id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0  # OpenAI's, over this request's generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # llama.cpp's repeat_penalty; 1 is off
    repeat_last_n: int = 64  # its window over the context and generated tokens; -1: all, 0: off

    @classmethod
    def with_defaults(
        cls,
        defaults: GenerationDefaults,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        logit_bias: tuple[tuple[int, float], ...] = (),
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        repeat_last_n: int | None = None,
    ) -> SamplingParams:
        """A request's sampling: what it says, else the profile's defaults (both APIs);
        bias and penalties are off unless the request asks for them."""
        return cls(
            temperature=defaults.temperature if temperature is None else temperature,
            top_k=defaults.top_k if top_k is None else top_k,
            top_p=defaults.top_p if top_p is None else top_p,
            seed=seed,
            logit_bias=tuple(sorted(logit_bias)),
            presence_penalty=0.0 if presence_penalty is None else presence_penalty,
            frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            repeat_last_n=64 if repeat_last_n is None else repeat_last_n,
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
        lo, hi = BIAS_RANGE
        seen: set[int] = set()
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise InvalidRequest(
                    f"logit_bias: token id {token} is out of range [0, {vocab_size})"
                )
            if token in seen:
                raise InvalidRequest(f"logit_bias: token id {token} is given twice")
            seen.add(token)
            if not (math.isfinite(bias) and lo <= bias <= hi):
                raise InvalidRequest(
                    f"logit_bias[{token}] = {bias} is out of range [{lo:g}, {hi:g}]"
                )
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and lo <= value <= hi):
                raise InvalidRequest(f"{name} = {value} is out of range [{lo:g}, {hi:g}]")
        lo, hi = REPETITION_RANGE
        rep = self.repetition_penalty
        if not (math.isfinite(rep) and lo < rep <= hi):
            raise InvalidRequest(f"repetition_penalty = {rep} is out of range ({lo:g}, {hi:g}]")
        if not -1 <= self.repeat_last_n <= REPEAT_LAST_N_MAX:
            raise InvalidRequest(
                f"repeat_last_n = {self.repeat_last_n} is out of range [-1, {REPEAT_LAST_N_MAX}]"
                " (-1: the whole context, 0: off)"
            )


class Sampler:
    """Samples token ids from logits; one instance per request (it owns the RNG state).

    Work per token stays small next to a decode step: top-k narrows the vocabulary with an
    O(V) partition before any exponentials or sorting, and the draw is one uniform number
    against a cumulative sum.
    """

    def __init__(self, params: SamplingParams, context: Sequence[int] = ()) -> None:
        """`context`: the tokens the model sees before the first generated one (the prompt,
        or a session's conversation), for `repetition_penalty`'s window; only its last
        `repeat_last_n` are kept."""
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._constraint = params.constraint.start() if params.constraint is not None else None
        self._penalties = Penalties.of(params, context)

    def __call__(self, logits: npt.NDArray[np.float32]) -> int:
        """A token id; NonFiniteLogits if the logits hold NaN or infinity (found at no extra
        cost: argmax stops at the first NaN, and either makes the weights' sum non-finite).

        Each call is the next position of the request: bias and penalties first (on a copy),
        then under a constraint the forbidden tokens' logits are -inf (so greedy takes the
        best allowed token, and the weights of forbidden ones are 0: no bias lets one
        through), then the choice; the grammar and the penalties' counts then advance on the
        chosen token."""
        pen = self._penalties
        if pen is not None:
            logits = pen.apply(logits)
        if self._constraint is None:
            token = self._choose(logits)
        else:
            token = self._choose(self._constraint.mask(logits))
            self._constraint.advance(token)
        if pen is not None:
            pen.accept(token)
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
