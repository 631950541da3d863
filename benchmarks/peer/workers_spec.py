"""The speculation sections' contenders (`bench_peer.py --worker <engine> --task spec|verify`):
decode of each prompt with and without speculation, LiteRT-LM on the same prompts, and the
cost of a verify call against a decode step."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.peer.measure import peak_rss_mib, prompt_text, stream_timing

VERIFY_CALLS = 40  # timed calls per signature (after 5 untimed ones)
SAMPLED = "@sampled"  # a key ending so: its prompt sampled (temperature 0.8, top-k 40, seed 0)


def _sampling(key: str) -> tuple[str, Any]:
    """A spec key's prompt key and sampling parameters."""
    from agent.engine.sampler import SamplingParams

    if key.endswith(SAMPLED):
        return key[: -len(SAMPLED)], SamplingParams(0.8, top_k=40, seed=0)
    return key, SamplingParams(0.0)


def spec_edge(a: argparse.Namespace) -> dict[str, Any]:
    """Greedy decode of every prompt in `a.keys`, speculation `a.speculation`."""
    from agent.engine.engine import Engine
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest
    from agent.profile import load_profile

    engine = Engine.load(load_profile(Path(a.profile)), Path(a.model), quantization=a.quant)
    out: dict[str, Any] = {"engine": "edge", "speculation": a.speculation, "prompts": {}}

    greedy = SamplingParams(0.0)

    def run(
        prompt: str, tokens: int, sampling: Any = greedy
    ) -> tuple[float, float, int, list[int], Any]:
        req = GenerateRequest(
            prompt, max_tokens=tokens, sampling=sampling, speculation=a.speculation
        )
        return stream_timing(engine.generate(req))

    run(prompt_text(64), 8)  # warm-up: page faults, XNNPACK's first runs
    run(prompt_text(a.keys.split(",")[0]), 16)  # and the verify signatures' first runs
    for key in a.keys.split(","):
        prompt, sampling = _sampling(key)
        ttft, rate, n, ids, last = run(prompt_text(prompt), a.tokens, sampling)
        st = last.stats
        out["prompts"][key] = {
            "decode_tok_s": rate,
            "ttft_ms": ttft,
            "decoded": n,
            "ids": ids,
            "prompt_tokens": st.prompt_tokens,
            "drafted": getattr(st, "drafted_tokens", 0),
            "accepted": getattr(st, "accepted_tokens", 0),
            "verify_calls": getattr(st, "verify_calls", 0),
        }
    engine.close()
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def spec_litertlm(a: argparse.Namespace) -> dict[str, Any]:
    """LiteRT-LM's decode of the same prompts (its own greedy default: top-k 1)."""
    import litert_lm

    from benchmarks.peer.spec import CACHE

    cache = CACHE / "litertlm-cache"
    cache.mkdir(parents=True, exist_ok=True)
    engine = litert_lm.Engine(
        a.bundle,
        backend=litert_lm.Backend.CPU(thread_count=a.threads),
        cache_dir=str(cache),
        enable_benchmark=True,
    )
    out: dict[str, Any] = {"engine": "litertlm", "prompts": {}}

    def run(prompt: str, tokens: int) -> tuple[float, int]:
        s = engine.create_session(apply_prompt_template=False, max_output_tokens=tokens)
        s.run_prefill([prompt])
        first = last = 0.0
        for _chunk in s.run_decode_async():
            last = time.perf_counter()
            first = first or last
        n = s.get_benchmark_info().last_decode_token_count
        s.close()
        return ((n - 1) / (last - first) if n > 1 and last > first else 0.0), n

    run(prompt_text(64), 8)
    for key in a.keys.split(","):
        if key.endswith(SAMPLED):  # its sampler is not ours: no paired figure to give
            continue
        rate, n = run(prompt_text(key), a.tokens)
        out["prompts"][key] = {"decode_tok_s": rate, "decoded": n}
    engine.close()
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def verify_cost(a: argparse.Namespace) -> dict[str, Any]:
    """Median seconds of a decode step and of each verify signature's call after a prompt of
    64 tokens (the 256-row KV window) and of 448 (the 512-row one), through the runner (no
    engine around it)."""
    from agent.engine.engine import Engine
    from agent.profile import load_profile

    engine = Engine.load(load_profile(Path(a.profile)), Path(a.model), quantization=a.quant)
    runner: Any = engine.loaded.runner
    vocab = runner.layout.vocab_size
    prompt = [(7919 * i + 11) % vocab for i in range(448 + 16)]
    lengths = tuple(getattr(runner, "verify_lengths", ()))

    def timed(call: Any) -> float:
        for _ in range(5):
            call()
        xs = []
        for _ in range(VERIFY_CALLS):
            t0 = time.perf_counter()
            call()
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs)

    out: dict[str, Any] = {"engine": "edge", "allowed": bool(lengths), "contexts": {}}
    for ctx in (64, 448):
        kv = runner.new_kv()
        runner.reserve(kv, ctx + 32, 0)
        runner.prefill(kv, prompt[:ctx], 0)
        point: dict[str, Any] = {
            "decode_ms": 1e3 * timed(lambda kv=kv, ctx=ctx: runner.decode(kv, 5, ctx))
        }
        point["verify_ms"] = {
            str(n): 1e3 * timed(lambda n=n, kv=kv, ctx=ctx: runner.verify(kv, prompt[:n], ctx))
            for n in lengths
        }
        point["kv_rows"] = kv.nbytes // runner.layout.kv.bytes_per_token
        out["contexts"][str(ctx)] = point
    engine.close()
    return out
