"""The engine's serving figures from real requests on a real tiny model: prefill, TTFT and
decode percentiles move, and each kind of error is counted under its kind where the request
really ends that way (NaN logits, a grammar the model cannot follow, a deadline)."""

from __future__ import annotations

from pathlib import Path

from agent.constraint.types import Constraint
from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.stats import ERROR_KINDS, EngineStats
from agent.engine.types import EngineLimits, GenerateRequest


def errors(s: EngineStats) -> dict[str, int]:
    return dict(s.errors)


def greedy(prompt: str, n: int, **kw: object) -> GenerateRequest:
    return GenerateRequest(prompt, max_tokens=n, sampling=SamplingParams(0.0, seed=1), **kw)  # type: ignore[arg-type]


def test_figures_move_with_requests_and_errors_count_by_kind(
    tiny_model_dir: Path, make_profile
) -> None:
    engine = Engine.load(
        make_profile(),
        tiny_model_dir,
        quantization="fp32",
        limits=EngineLimits(max_active=1, max_pending_events=1),
    )
    try:
        s = engine.stats()
        assert (s.samples, s.prefill_tok_s.p50, errors(s)) == (
            0,
            0.0,
            dict.fromkeys(ERROR_KINDS, 0),
        )
        for prompt in ("def f(x):", "class A:\n    def g(self):"):
            done = engine.complete(greedy(prompt, 8))
            assert done.finish_reason in ("length", "stop")
        s = engine.stats()
        assert s.samples == 2 and s.requests_total == 2
        assert s.prefill_tok_s.p50 > 0 and s.prefill_tok_s.p95 > 0
        assert s.decode_tok_s.p50 > 0 and s.ttft_ms.p50 > 0
        assert sum(errors(s).values()) == 0

        # a grammar that needs a character the tiny model has no piece for: it fails while
        # generating (test_constraint_safety shows the same through the daemon)
        bad = Constraint(kind="regex", text=r"[a-z]{2}\{")
        done = engine.complete(greedy("x", 12, constraint=bad))
        assert done.finish_reason == "error" and "constraint" in (done.events[-1].error or "")
        assert errors(engine.stats())["constraint"] == 1

        # a deadline: the consumer never reads, so the request waits paused until it passes
        got: list = []
        h = engine.submit(greedy("def f():", 100), got.append, timeout=0.2)
        assert h.done.wait(60)
        assert got[-1].finish_reason == "cancelled" and got[-1].error == "deadline exceeded"
        s = engine.stats()
        assert errors(s)["timeout"] == 1 and s.requests_cancelled == 1
        # a plain cancel is not a timeout
        h = engine.submit(greedy("def f():", 100), lambda e: None)
        h.cancel()
        assert h.done.wait(60)
        s = engine.stats()
        assert errors(s) == {"nonfinite": 0, "constraint": 1, "timeout": 1, "internal": 0}
        assert s.requests_failed == 1 and s.requests_cancelled == 2
    finally:
        engine.close()


def test_nan_logits_count_as_nonfinite(tiny_model_factory, make_profile, tmp_path: Path) -> None:
    from tests.unit.runtime.test_prepared_check import nan_model_dir

    d = nan_model_dir(tiny_model_factory, tmp_path)
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "x")})
    engine = Engine.load(profile, d, state_dir=tmp_path / "state")
    try:
        done = engine.complete(greedy("hello", 4))
        assert done.finish_reason == "error"
        s = engine.stats()
        assert errors(s) == {"nonfinite": 1, "constraint": 0, "timeout": 0, "internal": 0}
        assert s.samples == 0  # no token: nothing to time
    finally:
        engine.close()
