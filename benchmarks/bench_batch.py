"""Batched decode at the runner level (issue 37 item 1): what one ``decode_batch_<B>`` call
costs against B single-row ``decode`` calls, no engine in between.

For each `.tflite` given (exported with ``scripts/build_model.py --batch 2 --batch 4``): the bare
CompiledModel path (XNNPACK, no KV windows, 2 threads), the first-load check of its batch
signatures (`RunnerBase.check_batch`, timed), then rounds of: one session decoding alone,
B sessions decoding one after another (today's turn-taking), and the same B sessions in one
batch call; ms per step, medians of rounds. Aggregate speedup = B tokens per batch step against
one token per single step.

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


def _steps(fn: Any, steps: int) -> float:
    t = time.perf_counter()
    for i in range(steps):
        fn(i)
    return (time.perf_counter() - t) / steps * 1e3


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
    single: list[float] = []
    by_rows: dict[int, tuple[list[float], list[float]]] = {b: ([], []) for b in sizes}
    pos = start
    for _ in range(rounds):
        single.append(_steps(lambda i: runner.decode(kvs[0], 5, pos + i), steps))
        for b in sizes:

            def turns(i: int, b: int = b) -> None:
                for kv in kvs[:b]:
                    runner.decode(kv, 5, pos + i)

            def batched(i: int, b: int = b) -> None:
                runner.decode_batch(kvs[:b], [5] * b, [pos + i] * b)

            by_rows[b][0].append(_steps(turns, steps))
            by_rows[b][1].append(_steps(batched, steps))
        # the same rows again each round: positions stay in place, the timing does not depend
        # on them (attention runs over the whole KV length)
    out["single_ms"] = med(single)
    for b, (turn, batch) in by_rows.items():
        out["rows"][b] = {"turns_ms": med(turn), "batch_ms": med(batch)}
    runner.close()
    return out


def table(results: list[dict[str, Any]], threads: int) -> str:
    lines = [
        "## Batched decode (issue 37 item 1)",
        "",
        "Runner level, no engine: one `decode_batch_<B>` call against B single-row `decode`",
        f"calls, CompiledModel on XNNPACK, {threads} threads, each row over its own KV cache",
        f"({START} rows filled, or half the KV). Aggregate speedup: B tokens per batch step",
        "over one token per single-row step (the issue's goal: >= 1.6x at B=2, >= 2.5x at",
        "B=4). ms per step,",
        "median (min-max) of rounds. Command:",
        "`PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_batch.py FILE.tflite`",
        "",
        "| model file | KV | B | 1 row: decode | B rows in turn | B rows batched | aggregate "
        "(of minima) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["problem"] is not None:
            lines.append(f"| {r['file']} | {r['kv']} | - | check failed: {r['problem']} | | | |")
            continue
        for b, row in r["rows"].items():
            speed = b * r["single_ms"]["median"] / row["batch_ms"]["median"]
            best = b * r["single_ms"]["min"] / row["batch_ms"]["min"]
            lines.append(
                f"| {r['file']} | {r['kv']} | {b} | {fmt(r['single_ms'], 2)} | "
                f"{fmt(row['turns_ms'], 2)} | {fmt(row['batch_ms'], 2)} | "
                f"{speed:.2f}x ({best:.2f}x) |"
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
