"""The canary a new model must pass before it serves: it loads, its first logits are finite, its
greedy tokens are in the vocabulary, and it meets the manifest's expectation when there is one
(greedy tokens, a logits checksum, or a bound on its mean negative log-likelihood). ota never
imports the engine: the caller hands over a `Model` of callables. The bound: docs/UPDATES.md.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from agent.base.errors import AgentError
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

DEFAULT_PROMPT = "def main():"
DEFAULT_TOKENS = 4
REFERENCE_TOKENS = 48  # greedy tokens of the base model after the seed
NLL_MARGIN = 0.5  # the bound: this share of the way from the base model's score to ln V

Step = Callable[[int, int], npt.NDArray[np.float32]]  # (token, position) -> next logits
Greedy = Callable[[str, int], tuple[list[int], str]]  # (prompt, n) -> n greedy tokens, their text


@dataclass(frozen=True, slots=True)
class Model:
    """A loaded model as the canary runs it: the caller (the daemon, `update make`) builds these
    from its engine (`agent.daemon.canary.engine_model`). `first_logits` and `steps` drive the
    model's runner directly: check before the engine serves, or on an engine nothing else
    uses."""

    vocab_size: int
    encode: Callable[[str], Sequence[int]]  # a prompt's token ids, as the engine encodes one
    greedy: Greedy  # the engine's greedy completion (temperature 0, no stop sequences)
    first_logits: Callable[[Sequence[int]], npt.NDArray[np.float32]]  # after ids, fresh KV
    steps: Callable[[int], Step]  # a step decoding on a fresh KV reserved for n tokens


class CanaryError(AgentError):
    """A canary cannot be made from this base model (the message says what to do instead)."""


def logits_digest(logits: np.ndarray, decimals: int) -> str:
    """sha256 of float32 logits rounded to `decimals` (what a manifest's canary may pin)."""
    rounded = np.round(logits.astype(np.float64), decimals).astype(np.float32)
    return hashlib.sha256(rounded.tobytes()).hexdigest()


def expected_tokens(model: Model, prompt: str, n: int) -> list[int]:
    """The greedy tokens the canary compares with (`update make --canary-tokens` uses this)."""
    return list(model.greedy(prompt, n)[0])


def score(step: Step, ids: Sequence[int], vocab: int) -> float:
    """Mean negative log-likelihood (nats per token) of ids[1:], each given the ids before it,
    with `step` running one decode step; inf if any logits are not finite."""
    if len(ids) < 2:
        raise ValueError("scoring needs at least two tokens")
    total = 0.0
    for pos in range(len(ids) - 1):
        logits = np.asarray(step(ids[pos], pos))[:vocab].astype(np.float64)
        if not np.isfinite(logits).all():
            return math.inf
        top = float(logits.max())
        total += top + math.log(float(np.exp(logits - top).sum())) - float(logits[ids[pos + 1]])
    return total / (len(ids) - 1)


def mean_nll(model: Model, text: str) -> float:
    """`score` of `text` as the engine encodes a prompt, run on its runner directly (call before
    the engine serves, or on an engine nothing else uses)."""
    ids = model.encode(text)
    return score(model.steps(len(ids)), ids, model.vocab_size)


def nll_bound(base_nll: float, vocab: int) -> float:
    """The most a new model may score on the base model's text."""
    return base_nll + NLL_MARGIN * (math.log(vocab) - base_nll)


def reference_canary(
    base: Model, seed: str = DEFAULT_PROMPT, n: int = REFERENCE_TOKENS
) -> opb.Canary:
    """The default canary: `seed` and the base model's greedy continuation as the prompt, and
    the bound on the new model's mean NLL over it. CanaryError if the base model does not know
    its own text well enough for the bound to tell a broken model from it.

    The bound is what `update make` records by default (`reference_canary`): the prompt is a fixed
    seed followed by the *base* model's own greedy continuation, and the new model must predict that
    text about as well as the base model does: at most halfway from the base model's score to a
    uniform guess over the vocabulary (ln V). A fine-tune stays near the base model's score; a model
    whose weights are garbage but finite scores near or beyond ln V (the demo model's scores:
    docs/UPDATES.md).
    """
    text = seed + base.greedy(seed, n)[1]
    base_nll = mean_nll(base, text)
    vocab = base.vocab_size
    uniform = math.log(vocab)
    if not base_nll < NLL_MARGIN * uniform:
        raise CanaryError(
            f"the base model scores {base_nll:.2f} nats/token on its own greedy text (a uniform "
            f"guess over {vocab} tokens scores {uniform:.2f}): a canary made from it cannot tell "
            "a broken model from it; give --canary-prompt, or --no-canary"
        )
    return opb.Canary(prompt=text, max_mean_nll=nll_bound(base_nll, vocab), base_mean_nll=base_nll)


def check(model: Model, canary: opb.Canary | None) -> str | None:
    """None if `model` passes, else the reason. Call before the engine serves: the first
    step runs on its runner directly."""
    prompt = canary.prompt if canary is not None and canary.prompt else DEFAULT_PROMPT
    want = list(canary.expected_tokens) if canary is not None else []
    vocab = model.vocab_size
    ids = model.encode(prompt)
    first = np.asarray(model.first_logits(ids))[:vocab]
    if not np.isfinite(first).all():
        bad = int((~np.isfinite(first)).sum())
        return f"the first logits have {bad} non-finite values"
    if canary is not None and canary.logits_sha256:
        digest = logits_digest(first, canary.logits_decimals or 3)
        if digest != canary.logits_sha256:
            want_digest = canary.logits_sha256[:12]
            return f"first-step logits checksum {digest[:12]}… != expected {want_digest}…"
    if canary is not None and canary.max_mean_nll != 0.0:
        problem = _check_nll(model, canary)
        if problem is not None:
            return problem
    tokens = expected_tokens(model, prompt, max(len(want), DEFAULT_TOKENS))
    if any(not 0 <= t < vocab for t in tokens):
        return f"generated tokens outside the vocabulary of {vocab}: {tokens}"
    if want and tokens[: len(want)] != want:
        return f"greedy tokens {tokens[: len(want)]} != expected {want}"
    return None


def _check_nll(model: Model, canary: opb.Canary) -> str | None:
    bound = canary.max_mean_nll
    if not (math.isfinite(bound) and bound > 0):
        return f"the canary's max_mean_nll {bound!r} is not a positive number"
    got = mean_nll(model, canary.prompt)
    if got <= bound:
        return None
    if not math.isfinite(got):
        return "non-finite logits on the canary prompt"
    return (
        f"mean NLL {got:.2f} nats/token on the canary prompt, above its bound {bound:.2f} "
        f"(the base model: {canary.base_mean_nll:.2f}; a uniform guess: "
        f"{math.log(model.vocab_size):.2f})"
    )
