"""Sampling: exact behaviour of greedy, top-k, top-p and seeds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.base.errors import InvalidRequest, NonFiniteLogits
from agent.engine.sampler import Sampler, SamplingParams

logit_arrays = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=64).map(
    lambda xs: np.array(xs, dtype=np.float32)
)


@given(logit_arrays)
def test_greedy_is_argmax(logits) -> None:
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(np.argmax(logits))


@given(logit_arrays, st.floats(0.05, 2.0), st.integers(0, 2**32))
def test_top_k_one_is_argmax_at_any_temperature(logits, temperature, seed) -> None:
    s = Sampler(SamplingParams(temperature=temperature, top_k=1, seed=seed))
    best = np.flatnonzero(logits == logits.max())
    assert s(logits) in best


@given(logit_arrays, st.integers(1, 8), st.integers(0, 2**32))
@settings(max_examples=50)
def test_top_k_only_returns_the_k_largest(logits, k, seed) -> None:
    s = Sampler(SamplingParams(temperature=1.5, top_k=k, seed=seed))
    kth = np.sort(logits)[-min(k, len(logits))]
    for _ in range(20):
        assert logits[s(logits)] >= kth


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=1))
    seen = {s(logits) for _ in range(400)}
    assert seen == {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.1, seed=1))
    assert {s(logits) for _ in range(50)} == {0}


def test_same_seed_same_tokens_other_seed_differs() -> None:
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=100).astype(np.float32) for _ in range(64)]

    def run(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(x) for x in logits]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))
    s = Sampler(SamplingParams(temperature=1.0, seed=3))
    counts = np.bincount([s(logits) for _ in range(6000)], minlength=3) / 6000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.03)


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (SamplingParams(temperature=-0.1), "temperature = -0.1"),
        (SamplingParams(temperature=2.5), "temperature = 2.5"),
        (SamplingParams(temperature=float("nan")), "temperature = nan"),
        (SamplingParams(top_k=-1), "top_k = -1"),
        (SamplingParams(top_k=101), "top_k = 101 is out of range [0, 100]"),
        (SamplingParams(top_p=0.0), "top_p = 0.0"),
        (SamplingParams(top_p=1.5), "top_p = 1.5"),
        (SamplingParams(seed=-1), "seed = -1"),
    ],
)
def test_out_of_range_parameters_are_refused(params, fragment) -> None:
    with pytest.raises(InvalidRequest, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        params.validate(vocab_size=100)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.7, top_k=5, seed=3),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    ],
)
@pytest.mark.parametrize("where", ["one", "all"])
def test_non_finite_logits_are_an_error_never_a_token(bad, params, where) -> None:
    logits = np.linspace(-3, 3, 50, dtype=np.float32)
    if where == "all":
        logits[:] = bad
    else:
        logits[17] = bad
    if bad == -np.inf and where == "one":  # one impossible token is a valid distribution
        assert Sampler(params)(logits) != 17
        return
    with pytest.raises(NonFiniteLogits):
        Sampler(params)(logits)
