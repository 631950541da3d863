#!/usr/bin/env python3
"""Engine benchmark: decode ms/token of the engine against a bare CompiledModel loop.

For every variant of a model directory (default: the bundled demo model) on a profile
(default: detected), alternating the contenders within each round:

* bare      - a minimal CompiledModel decode loop on the same file: KV buffers bound in place,
              write token + position, run, read logits. The floor for any Python engine.
* engine    - `Engine.generate` (sampling, detokenization, stop checks, stats included).
* interp    - the Interpreter fallback path (KV views, copy back the new rows).

Also prefill throughput and time to first token for 64- and 448-token prompts, and the
memory plan against the measured RSS growth. Writes JSON to docs/bench/engine.json and the
tables into docs/PERFORMANCE.md between markers.

    python benchmarks/bench.py [--model DIR] [--profile NAME] [--rounds 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.engine.engine import Engine  # noqa: E402
from agent.engine.sampler import SamplingParams  # noqa: E402
from agent.engine.types import GenerateRequest  # noqa: E402
from agent.model.directory import demo_model_dir, load_model_dir  # noqa: E402
from agent.profile import resolve_profile  # noqa: E402
from benchmarks._report import bench_args, fmt, med, section_name, write_section  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def bare_decode_ms(runner: Any, tokens: int, start: int) -> float:
    """A minimal decode loop on the runner's own CompiledModel and buffers."""
    kv = runner.new_kv()
    io = runner._io["decode"]
    model = runner._model
    inputs = {"tokens": io.tokens, "input_pos": io.input_pos, **kv.buffers}
    outputs = {"logits": io.logits, **kv.buffers}
    tok = np.zeros((1, 1), dtype=np.int32)
    pos = np.zeros((1,), dtype=np.int32)
    t0 = time.perf_counter()
    for i in range(tokens):
        tok[0, 0] = 3 + i % 50
        pos[0] = start + i
        io.tokens.write(tok)
        io.input_pos.write(pos)
        model.run_by_name("decode", inputs, outputs)  # the logits land in io.logits_array
    return (time.perf_counter() - t0) * 1e3 / tokens


def engine_decode(
    engine: Engine, tokens: int, seed: int, greedy: bool = False, stream: bool = False
) -> float:
    """Engine ms/token over one generation: greedy or the dev profile's sampling; collected
    by `complete` (no consumer thread) or streamed through `generate` to this thread."""
    sampling = SamplingParams(0.0) if greedy else SamplingParams(0.8, 40, 0.95, seed)
    req = GenerateRequest(prompt="import os\n", max_tokens=tokens, sampling=sampling)
    if stream:
        stats = [e.stats for e in engine.generate(req) if e.stats is not None][-1]
    else:
        stats = engine.complete(req).stats
    return 1e3 / stats.decode_tok_s


def prompt_of(engine: Engine, n: int) -> str:
    src = (ROOT / "agent" / "engine" / "engine.py").read_text()
    ids = engine.tokenizer.encode(src)[: n - 1]
    return engine.tokenizer.decode(ids)


def prefill(engine: Engine, prompt: str) -> tuple[float, float, int]:
    c = engine.complete(GenerateRequest(prompt=prompt, max_tokens=1, sampling=SamplingParams(0.0)))
    return c.stats.ttft_ms, c.stats.prefill_tok_s, c.stats.prompt_tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile, _ = resolve_profile(args.profile)
    model_dir = Path(args.model) if args.model else demo_model_dir()
    meta = load_model_dir(model_dir)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
        "python": platform.python_version(),
        "profile": profile.name,
        "threads": profile.runtime.num_threads,
        "model": f"{meta.name} {meta.version}",
        "rounds": args.rounds,
        "tokens": args.tokens,
        "variants": {},
    }
    for variant in meta.variants:
        q = variant.quantization
        before = rss_mib()
        engine = Engine.load(profile, model_dir, quantization=q)
        loaded_rss = rss_mib() - before
        interp = Engine.load(profile, model_dir, quantization=q, prefer_interpreter=True)
        bare, eng, greedy, streamed, itp = [], [], [], [], []
        ttft64, ttft448, pf64, pf448 = [], [], [], []
        p64, p448 = prompt_of(engine, 64), prompt_of(engine, 448)
        # warm-up (first runs pay one-off XNNPACK packing and page faults)
        engine_decode(engine, 16, 0)
        bare_decode_ms(engine.loaded.runner, 16, 4)
        for r in range(args.rounds):
            bare.append(bare_decode_ms(engine.loaded.runner, args.tokens, 4))
            eng.append(engine_decode(engine, args.tokens, r))
            greedy.append(engine_decode(engine, args.tokens, r, greedy=True))
            streamed.append(engine_decode(engine, args.tokens, r, greedy=True, stream=True))
            itp.append(engine_decode(interp, args.tokens, r))
            t, p, _ = prefill(engine, p64)
            ttft64.append(t)
            pf64.append(p)
            t, p, _ = prefill(engine, p448)
            ttft448.append(t)
            pf448.append(p)
        row: dict[str, Any] = {
            "file_mib": variant.size / 2**20,
            "bare_ms": med(bare),
            "engine_ms": med(eng),
            "engine_greedy_ms": med(greedy),
            "engine_streamed_greedy_ms": med(streamed),
            "engine_streamed_overhead_pct": 100
            * (statistics.median(streamed) / statistics.median(bare) - 1),
            "engine_greedy_overhead_pct": 100
            * (statistics.median(greedy) / statistics.median(bare) - 1),
            "interpreter_ms": med(itp),
            "engine_overhead_pct": 100 * (statistics.median(eng) / statistics.median(bare) - 1),
            "ttft64_ms": med(ttft64),
            "ttft448_ms": med(ttft448),
            "prefill64_tok_s": med(pf64),
            "prefill448_tok_s": med(pf448),
            "memory_plan_mib": engine.info.memory.total / 2**20,
            "rss_growth_mib": loaded_rss,
            "accelerator": engine.info.accelerator,
        }
        results["variants"][q] = row
        print(
            f"{q:14} bare {row['bare_ms']['median']:.3f} ms/tok  greedy "
            f"{row['engine_greedy_ms']['median']:.3f} "
            f"({row['engine_greedy_overhead_pct']:+.1f}%)  streamed "
            f"{row['engine_streamed_greedy_ms']['median']:.3f}  top-k "
            f"{row['engine_ms']['median']:.3f} ({row['engine_overhead_pct']:+.1f}%)  interp "
            f"{row['interpreter_ms']['median']:.3f}  ttft64 {row['ttft64_ms']['median']:.1f} ms  "
            f"ttft448 {row['ttft448_ms']['median']:.1f} ms",
            flush=True,
        )
        engine.close()
        interp.close()
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def table(res: dict[str, Any]) -> str:
    def f(d: dict[str, float], digits: int = 3) -> str:
        return fmt(d, digits)

    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {res['machine']}, Python {res['python']}, "
        f"profile `{res['profile']}` ({res['threads']} threads), model {res['model']}; "
        f"median (min–max) of {res['rounds']} alternating rounds, {res['tokens']} decoded "
        "tokens each.",
        "",
        "| variant | file MiB | bare loop ms/token | engine greedy ms/token (overhead) | "
        "streamed to a consumer thread, greedy (overhead) | "
        "engine top-k 40 ms/token (overhead) | Interpreter path ms/token | TTFT 64 tok (ms) | "
        "TTFT 448 tok (ms) | prefill 448 tok/s | memory plan MiB | RSS growth MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q, r in res["variants"].items():
        lines.append(
            f"| {q} | {r['file_mib']:.2f} | {f(r['bare_ms'])} | {f(r['engine_greedy_ms'])} "
            f"({r['engine_greedy_overhead_pct']:+.1f}%) | {f(r['engine_streamed_greedy_ms'])} "
            f"({r['engine_streamed_overhead_pct']:+.1f}%) | {f(r['engine_ms'])} "
            f"({r['engine_overhead_pct']:+.1f}%) | {f(r['interpreter_ms'])} | "
            f"{f(r['ttft64_ms'], 1)} | {f(r['ttft448_ms'], 1)} | "
            f"{r['prefill448_tok_s']['median']:.0f} | {r['memory_plan_mib']:.1f} | "
            f"{r['rss_growth_mib']:.1f} |"
        )
    lines += [
        "",
        f"Peak RSS of the benchmark process: {res['peak_rss_mib']:.0f} MiB.",
    ]
    return "\n".join(lines)


def main() -> None:
    args = bench_args(__doc__)
    res = run(args)
    if not args.no_write:
        name = section_name("engine", args)
        write_section(name, res, table(res))
        print(f"wrote docs/PERFORMANCE.md and docs/bench/{name}.json")


if __name__ == "__main__":
    main()
