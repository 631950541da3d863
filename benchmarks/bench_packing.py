"""Packed decode at the engine level (issue 37 item 1): aggregate decode tokens per second of
1, 2 and 4 concurrent requests on one engine with packing on (`EngineLimits.batch_decode`)
against the same model with it off.

Both engines are loaded side by side from the same model directory (one with batch
signatures: ``scripts/build_model.py --batch 2 --batch 4``); each round runs every concurrency
on both, one after the other, so that another process's load falls on both alike. A run
submits N greedy requests with short prompts while the engine thread is held, so they start
together, and times from the release to the last token: aggregate = all generated tokens over
that time (the short prompts' prefill included). Median (min-max) of the rounds.

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_packing.py --model DIR

Writes the `packing-<dir name>` section of docs/PERFORMANCE.md (`--no-write`: print only).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.engine.engine import Engine, EngineLimits
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest, TokenEvent
from agent.profile import resolve_profile
from benchmarks._report import bench_args, fmt, med, write_section

CONCURRENCY = (1, 2, 4)
PROMPTS = ("def main():", "import os", "class A:", "for i in")


def run(engine: Engine, n: int, tokens: int) -> tuple[float, int]:
    """Seconds from the release of n requests submitted together to the last one's end, and
    the tokens they generated."""
    done = [threading.Event() for _ in range(n)]
    counts = [0] * n
    handles: list[Any] = []
    engine.inject_stall(60)
    for i in range(n):

        def sink(event: TokenEvent, i: int = i) -> None:
            counts[i] += len(event.token_ids)
            handles[i].consumed()
            if event.finish_reason is not None:
                done[i].set()

        request = GenerateRequest(
            PROMPTS[i % len(PROMPTS)],
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
            speculation="off",
        )
        handles.append(engine.submit(request, sink))
    t = time.perf_counter()
    engine.end_stall()
    for d in done:
        if not d.wait(600):
            raise SystemExit("a request did not finish in 600 s")
    return time.perf_counter() - t, sum(counts)


def main() -> int:
    args = bench_args(__doc__)
    if not args.model:
        raise SystemExit("--model: a model directory with batch signatures")
    base, _ = resolve_profile(args.profile or "generic-x86_64")
    cache = Path(tempfile.mkdtemp(prefix="bench-packing-"))  # a fresh weight cache: no shared one
    profile = replace(base, runtime=replace(base.runtime, xnnpack_weight_cache_dir=cache))
    engines = {
        packed: Engine.load(
            profile,
            Path(args.model),
            limits=EngineLimits(max_active=max(CONCURRENCY), batch_decode=packed),
        )
        for packed in (True, False)
    }
    on = engines[True]
    if not on.packing.sizes:
        raise SystemExit(f"{args.model}: packed decode is off: {on.packing.problem}")
    rates: dict[tuple[bool, int], list[float]] = {(p, n): [] for p in engines for n in CONCURRENCY}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in CONCURRENCY:
            for packed, engine in engines.items():
                seconds, made = run(engine, n, args.tokens)
                if r:
                    rates[(packed, n)].append(made / seconds)
    for engine in engines.values():
        engine.close()
    shutil.rmtree(cache, ignore_errors=True)
    name = Path(args.model).name
    lines = [
        f"#### Packed decode on the engine: `{name}`",
        "",
        f"Aggregate decode tok/s of N concurrent greedy requests ({args.tokens} tokens each,",
        "short prompts, started together) on one engine, packing on (batch signatures",
        f"{list(on.packing.sizes)}) against off, {args.rounds} rounds interleaved; median",
        "(min-max). A shared, noisy 2-core machine (other engineers' jobs ran meanwhile):",
        "read the ratios, not the absolute figures. Command:",
        f"`PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_packing.py --model DIR"
        f" --rounds {args.rounds} --tokens {args.tokens}`",
        "",
        "| requests | packing off tok/s | packing on tok/s | on / off (medians) |",
        "|---|---|---|---|",
    ]
    for n in CONCURRENCY:
        off, on_ = med(rates[(False, n)]), med(rates[(True, n)])
        lines.append(
            f"| {n} | {fmt(off, 1)} | {fmt(on_, 1)} | {on_['median'] / off['median']:.2f}x |"
        )
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(
            f"packing-{name}", {"rates": {f"{k[0]}-{k[1]}": v for k, v in rates.items()}}, body
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
