"""A GEMV run's results: medians over the uncontended rounds, the table, the PERFORMANCE.md text."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from benchmarks._report import fmt, med
from benchmarks.gemv.measure import RUNS_PER_BATCH


def _clean(results: list[dict[str, Any]], max_foreign: float) -> list[dict[str, Any]]:
    """The results measured without contention; all of them if none was."""
    quiet = [r for r in results if r["foreign_cores"] <= max_foreign]
    return quiet or results


def summarize(
    raw: dict[str, Any], models: dict[str, dict[str, Any]], threads: list[int], max_foreign: float
) -> list[dict[str, Any]]:
    """One row per (quant, threads): medians (min, max) over the uncontended rounds."""
    rows = []
    for q, meta in models.items():
        for t in threads:
            runs = _clean(raw["cells"][f"{q}/{t}"], max_foreign)
            bws = _clean(raw["bandwidth"][str(t)], max_foreign)
            gbps = med([r["gbps"] for r in runs])
            bw = med([b["gbps"] for b in bws])
            rows.append(
                {
                    "quant": q,
                    "threads": t,
                    "weight_mb": meta["weight_bytes"] / 1e6,
                    "xnnpack_packed_mb": runs[-1]["xnnpack_packed_bytes"] / 1e6,
                    "ms": med([r["ms"] for r in runs]),
                    "gbps": gbps,
                    "bandwidth_gbps": bw,
                    "ratio": gbps["median"] / bw["median"],
                    "rounds_used": len(runs),
                    "bandwidth_rounds_used": len(bws),
                    "foreign_cores": med([r["foreign_cores"] for r in runs]),
                    "finite_output": all(r["finite_output"] for r in runs),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| quant | threads | weight MB | ms/pass | GB/s | read bandwidth GB/s "
        "| GB/s ÷ bandwidth | rounds | other CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['quant']} | {r['threads']} | {r['weight_mb']:.1f} | {fmt(r['ms'], 2)} "
            f"| {fmt(r['gbps'], 2)} | {fmt(r['bandwidth_gbps'], 2)} | {r['ratio']:.2f} "
            f"| {r['rounds_used']} | {r['foreign_cores']['median']:.2f} |"
        )
    return "\n".join(lines)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    command = "python " + " ".join(["benchmarks/bench_gemv.py", *sys.argv[1:]])
    return (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} CPUs: "
        f"median (min–max) of {args.rounds} alternating rounds of {args.repeats} batches of "
        f"{RUNS_PER_BATCH} passes each, a round's figures retried while other processes used "
        f"more than {args.max_foreign} cores; the read bandwidth measured in the same rounds. "
        f"Command: `{command}`.\n\n" + table(rows)
    )
