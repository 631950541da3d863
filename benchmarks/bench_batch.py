"""Batched decode at the runner level (issue 37 item 1): what one ``decode_batch_<B>`` call
costs against B single-row ``decode`` calls, no engine in between.

For each `.tflite` given (exported with ``scripts/build_model.py --batch 2 --batch 4``): the bare
CompiledModel path (XNNPACK, no KV windows, 2 threads), the first-load check of its batch
signatures (`RunnerBase.check_batch`, timed), then steps of: one session decoding alone,
B sessions decoding one after another (today's turn-taking), and the same B sessions in one
batch call, interleaved step by step; ms per call, medians of all steps. Aggregate speedup =
B tokens per batch call against one token per single call, taken within each step.

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_batch.py [--windows] FILE...

With ``--windows`` each file is also loaded as the daemon loads it (`litert.load`: KV windows
added at load with their batch signatures, every first-load check), and the rows decode in the
smallest window: what short sessions cost.

Writes the `batch` section of docs/PERFORMANCE.md (`--no-write`: print only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.model.tflite.file import read_model_file
from agent.model.tflite.layout import discover_layout
from agent.runtime import litert
from agent.runtime.compiled import CompiledRunner
from agent.runtime.prepare.cachefiles import IN_MEMORY_WEIGHT_CACHE
from benchmarks._report import fmt, med, write_section

START = 100  # rows already in each cache (decode costs the same at any position: full-KV mask)


def _windowed(path: Path, threads: int, tmp: Path) -> tuple[Any, float, str]:
    """`path` loaded as the daemon loads it (KV windows added at load, their batch signatures
    cloned, every first-load check run), with a fresh weight cache directory."""
    from dataclasses import replace

    from agent.model.directory import sha256_file
    from agent.profile import resolve_profile

    base, _ = resolve_profile("generic-x86_64")
    rt = replace(base.runtime, xnnpack_weight_cache_dir=tmp, num_threads=threads)
    t = time.perf_counter()
    runner = litert.load(path, replace(base, runtime=rt), cache_key=sha256_file(path)).runner
    smallest = runner.layout.all_windows()[0].length
    return runner, time.perf_counter() - t, f"window {smallest}"


def bench_file(
    path: Path, rounds: int, steps: int, threads: int, tmp: Path | None = None
) -> dict[str, Any]:
    layout = discover_layout(read_model_file(path))
    if tmp is None:
        runner = CompiledRunner(path, layout, "xnnpack", threads, IN_MEMORY_WEIGHT_CACHE, None)
        t = time.perf_counter()
        problem = runner.check_batch()
        check_s, where = time.perf_counter() - t, f"full KV {layout.context_length}"
    else:
        runner, check_s, where = _windowed(path, threads, tmp)
        problem = runner.batch_problem
    sizes = runner.batch_sizes
    out: dict[str, Any] = {
        "kv": where,
        "file": path.name,
        "size_mb": path.stat().st_size / 1e6,
        "check_s": check_s,
        "problem": problem,
        "rows": {},
    }
    if problem is not None:
        print(f"{path.name}: batch check failed: {problem}", flush=True)
        return out
    kvs = [runner.new_kv() for _ in range(max(sizes))]
    start = min(START, layout.context_length // 2)
    for b, kv in enumerate(kvs):
        runner.prefill(kv, [(7 * b + i) % 200 + 3 for i in range(start)], 0)
    # Interleaved step by step (one decode alone, then B in turn, then one batch call), so
    # that another process's load falls on all three alike; each ratio is taken within a step.
    single: list[float] = []
    by_rows: dict[int, dict[str, list[float]]] = {
        b: {"turn": [], "batch": [], "ratio": []} for b in sizes
    }
    pos = start

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    for i in range(rounds * steps):
        at = pos + i % steps  # the same rows again: decode costs the same at any position
        one = timed(lambda: runner.decode(kvs[0], 5, at))  # noqa: B023
        single.append(one)
        for b in sizes:
            rows = kvs[:b]
            turn = timed(lambda: [runner.decode(kv, 5, at) for kv in rows])  # noqa: B023
            batch = timed(lambda: runner.decode_batch(rows, [5] * len(rows), [at] * len(rows)))  # noqa: B023
            by_rows[b]["turn"].append(turn)
            by_rows[b]["batch"].append(batch)
            by_rows[b]["ratio"].append(b * one / batch)
    out["single_ms"] = med(single)
    for b, lists in by_rows.items():
        out["rows"][b] = {
            "turns_ms": med(lists["turn"]),
            "batch_ms": med(lists["batch"]),
            "speedup": med(lists["ratio"]),
        }
    runner.close()
    return out


def table(results: list[dict[str, Any]], threads: int) -> str:
    lines = [
        "## Batched decode (issue 37 item 1)",
        "",
        "Runner level, no engine: one `decode_batch_<B>` call against B single-row `decode`",
        f"calls, CompiledModel on XNNPACK, {threads} threads, each row over its own KV cache",
        f"({START} rows filled, or half the KV). Aggregate speedup: B tokens per batch call",
        "over one token per single-row call, the two timed one after the other in each step",
        "(the issue's goal: >= 1.6x at B=2, >= 2.5x at B=4). ms per call, median (min-max) of",
        "all steps. Command:",
        "`PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_batch.py FILE.tflite`",
        "",
        "| model file | KV | B | 1 row: decode | B rows in turn | B rows batched | aggregate |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["problem"] is not None:
            lines.append(f"| {r['file']} | {r['kv']} | - | check failed: {r['problem']} | | | |")
            continue
        for b, row in r["rows"].items():
            lines.append(
                f"| {r['file']} | {r['kv']} | {b} | {fmt(r['single_ms'], 2)} | "
                f"{fmt(row['turns_ms'], 2)} | {fmt(row['batch_ms'], 2)} | "
                f"{fmt(row['speedup'], 2)}x |"
            )
    lines.append("")
    checks = ", ".join(f"{r['file']} ({r['kv']}) {r['check_s']:.2f} s" for r in results)
    lines.append(
        "The first-load check of the batch signatures took (with `--windows`: the whole first "
        f"load, KV windows prepared and every check): {checks}."
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--windows",
        action="store_true",
        help="also load each file as the daemon does (KV windows added at load) and decode in "
        "the smallest window",
    )
    args = ap.parse_args()
    results = [bench_file(f, args.rounds, args.steps, args.threads) for f in args.files]
    if args.windows:
        for f in args.files:
            with tempfile.TemporaryDirectory() as tmp:
                results.append(bench_file(f, args.rounds, args.steps, args.threads, Path(tmp)))
    body = table(results, args.threads)
    print(body)
    if not args.no_write:
        write_section("batch", {"results": results}, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
