"""What logit bias and repetition penalties cost per token (issue 32 item 5): the sampler's
time per token with and without them, at the vocabulary sizes of the demo model (4096), a
SmolLM-class model (49152) and a Gemma-class one (262144).

Each case replays `--tokens` positions of random float32 logits through one `Sampler` (the
penalties' counts grow as the tokens come, as in a request), greedy and sampled (temperature
0.8, top-k 40, top-p 0.95: llama.cpp's defaults); the context for the repetition window is
512 random tokens. Medians of `--rounds`.
With the demo model present, the engine's decode tok/s with all of them on and off beside it.

Writes the `penalties` section of docs/PERFORMANCE.md (`--no-write`: print only).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from agent.engine.sampler import Sampler, SamplingParams
from benchmarks._report import bench_args, fmt, med, write_section

VOCABS = (4096, 49152, 262144)
CASES: dict[str, dict[str, Any]] = {
    "none": {},
    "presence + frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "repetition (last 64)": {"repetition_penalty": 1.1, "repeat_last_n": 64},
    "repetition (whole context)": {"repetition_penalty": 1.1, "repeat_last_n": -1},
    "logit_bias (300 ids)": {"logit_bias": "300"},
    "all of them": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "repeat_last_n": 64,
        "logit_bias": "300",
    },
}


def params(vocab: int, case: dict[str, Any], temperature: float) -> SamplingParams:
    kw = dict(case)
    if "logit_bias" in kw:
        ids = np.random.default_rng(1).choice(vocab, int(kw["logit_bias"]), replace=False)
        kw["logit_bias"] = tuple((int(t), -5.0) for t in sorted(ids))
    if temperature:  # llama.cpp's defaults
        kw.update(top_k=40, top_p=0.95)
    return SamplingParams(temperature=temperature, seed=3, **kw)


def per_token_us(vocab: int, case: dict[str, Any], temperature: float, tokens: int) -> float:
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=vocab).astype(np.float32) for _ in range(16)]
    context = rng.integers(0, vocab, 512).tolist()
    sampler = Sampler(params(vocab, case, temperature), context)
    t0 = time.perf_counter()
    for i in range(tokens):
        sampler(rows[i % len(rows)])
    return (time.perf_counter() - t0) / tokens * 1e6


def engine_rates(tokens: int, rounds: int) -> dict[str, dict[str, float]] | None:
    """Greedy decode tok/s on the demo model, penalties off and all on (None: no model)."""
    from agent.engine.engine import Engine
    from agent.engine.types import GenerateRequest
    from agent.model.directory import demo_model_dir
    from agent.profile import resolve_profile

    model = demo_model_dir()
    if not model.exists():
        return None
    profile, _ = resolve_profile("generic-x86_64", Path("/"))
    engine = Engine.load(profile, model)
    vocab = engine.tokenizer.vocab_size
    runs: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for _ in range(rounds):
            for name, case in (("off", {}), ("on", CASES["all of them"])):
                p = params(vocab, case, 0.0)
                req = GenerateRequest("import os\n", max_tokens=tokens, sampling=p)
                runs[name].append(engine.complete(req).stats.decode_tok_s)
    finally:
        engine.close()
    return {k: med(v) for k, v in runs.items()}


def main() -> None:
    args = bench_args(__doc__)
    data: dict[str, Any] = {"tokens": args.tokens, "rounds": args.rounds, "sampler_us": {}}
    lines = [
        "Sampler time per token, µs, median (min–max) of "
        f"{args.rounds} rounds of {args.tokens} tokens (`benchmarks/bench_penalties.py`):",
        "",
        "| case | "
        + " | ".join(f"greedy, vocab {v}" for v in VOCABS)
        + " | "
        + " | ".join(f"T 0.8, top-k 40, top-p 0.95, vocab {v}" for v in VOCABS)
        + " |",
        "|---|" + "---|" * (2 * len(VOCABS)),
    ]
    for name, case in CASES.items():
        cells = []
        for temperature in (0.0, 0.8):
            for vocab in VOCABS:
                xs = [
                    per_token_us(vocab, case, temperature, args.tokens) for _ in range(args.rounds)
                ]
                data["sampler_us"][f"{name} / T{temperature} / {vocab}"] = med(xs)
                cells.append(fmt(med(xs), 1))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "With none asked for, the sampler pays nothing; with any, a float32 copy of the logits",
        "and work in the ids counted (bias ids, the window's distinct tokens, the generated",
        "ones). Measured on a 2-core machine shared with other work: the ranges are wide, the",
        "minimum is the quieter figure.",
    ]
    rates = engine_rates(args.tokens, args.rounds)
    if rates is not None:
        data["engine_decode_tok_s"] = rates
        lines += [
            "",
            f"Demo model, greedy decode tok/s: {fmt(rates['off'], 0)} without, "
            f"{fmt(rates['on'], 0)} with all of them on.",
        ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("penalties", data, "## Logit bias and penalties\n\n" + body)


if __name__ == "__main__":
    main()
