"""The canary runs on callables, not an engine (ota never imports the engine): a made-up model
of four tokens that always predicts token 1 passes or fails it as a real one would."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from agent.ota import canary
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

VOCAB = 4


def _model(logits: npt.NDArray[np.float32]) -> canary.Model:
    def first_logits(ids: Sequence[int]) -> npt.NDArray[np.float32]:
        return logits

    def steps(n: int) -> canary.Step:
        return lambda token, pos: logits

    return canary.Model(
        vocab_size=VOCAB,
        encode=lambda text: [1] * max(2, len(text)),
        greedy=lambda prompt, n: ([1] * n, "x" * n),
        first_logits=first_logits,
        steps=steps,
    )


GOOD = np.array([0.0, 9.0, 0.0, 0.0], dtype=np.float32)


def test_a_model_that_says_what_the_manifest_expects_passes() -> None:
    model = _model(GOOD)
    assert canary.check(model, None) is None
    assert canary.expected_tokens(model, "p", 3) == [1, 1, 1]
    spec = opb.Canary(prompt="def f():", expected_tokens=[1, 1])
    assert canary.check(model, spec) is None
    problem = canary.check(model, opb.Canary(prompt="def f():", expected_tokens=[2]))
    assert problem is not None and "greedy tokens [1] != expected [2]" in problem


def test_non_finite_logits_and_a_missed_bound_fail() -> None:
    bad = _model(np.array([0.0, np.nan, 0.0, 0.0], dtype=np.float32))
    assert canary.check(bad, None) == "the first logits have 1 non-finite values"
    made = canary.reference_canary(_model(GOOD), seed="s", n=3)
    assert made.prompt == "sxxx" and made.base_mean_nll < made.max_mean_nll
    flat = _model(np.zeros(VOCAB, dtype=np.float32))  # a uniform guess scores ln V
    problem = canary.check(flat, made)
    assert problem is not None and "mean NLL" in problem and "bound" in problem
