#!/usr/bin/env python3
"""The kernel ceiling of a decode step: XNNPACK's quantized FULLY_CONNECTED kernels alone.

A `.tflite` holding only the weight matrices of SmolLM-135M as our export writes them (per
layer qkv 576->960: q, k and v in one matrix; o 576->576, gate and up 576->1536, down
1536->576; 30 layers; lm head 576->49152: 151 FULLY_CONNECTED ops, as in the model's decode
graph), chained at batch 1 with the slices, one CONCATENATION and two ADDs per layer and
nothing else: no attention, no KV cache, no norms. Converted with litert-torch, quantized with
the toolchain's own `quantize_bytes` (int8 per channel, int4 block 32: the weights of our
LLMs), run through ai-edge-litert's CompiledModel on the XNNPACK CPU path exactly as
`agent.runtime.compiled.CompiledRunner` does.
Reports ms per pass and the weight bytes streamed per second, next to the measured read
bandwidth (`benchmarks/peer/roofline.py`'s `read_bandwidth`) in the same run.

Models are built once (no lock) into .cache/models/gemv/; timing holds an exclusive flock on
/tmp/bench.lock and alternates quantizations and thread counts within every round.

    python benchmarks/bench_gemv.py [--threads 2 --threads 1] [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import write_section  # noqa: E402
from benchmarks.gemv.chain import GEMV_DIR, LAYERS, QUANTS, build, model_path  # noqa: E402
from benchmarks.gemv.measure import RUNS_PER_BATCH, delegation  # noqa: E402
from benchmarks.gemv.rounds import bench_lock, run_rounds  # noqa: E402
from benchmarks.gemv.summary import report, summarize, table  # noqa: E402
from benchmarks.gemv.weights import inspect_model  # noqa: E402

RESULT = ROOT / "docs" / "bench" / "gemv.json"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, action="append", help="repeatable (default: 2 and 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help=f"batches of {RUNS_PER_BATCH} passes")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.2,
        help="retry a measurement if other processes used more CPU (cores) meanwhile",
    )
    ap.add_argument("--retries", type=int, default=6)
    ap.add_argument("--quant", action="append", choices=QUANTS, help="default: both")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--no-write", action="store_true", help=f"do not write {RESULT.name}")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    threads: list[int] = args.threads or [2, 1]
    quants: list[str] = args.quant or list(QUANTS)
    paths: dict[str, Path] = {}
    build_s: dict[str, float | None] = {}  # None: cached by an earlier run
    for q in quants:
        cached = model_path(q, GEMV_DIR, args.layers).exists()
        t0 = time.monotonic()
        paths[q] = build(q, GEMV_DIR, args.layers)
        build_s[q] = None if cached else time.monotonic() - t0
    models = {q: {**inspect_model(p), **delegation(p)} for q, p in paths.items()}
    for q, m in models.items():
        print(f"[gemv] {q}: ops {m['ops']}, weights {m['weight_kinds']}, "
              f"{m['params'] / 1e6:.1f} M params, {m['weight_bytes'] / 1e6:.1f} MB read; "
              f"XNNPACK: {m['delegate_nodes']} delegate node(s) for {m['graph_ops']} ops, "
              f"input to output in one: {m['one_partition_input_to_output']}, "
              f"CompiledModel fully accelerated: {m['compiled_model_fully_accelerated']}",
              flush=True)  # fmt: skip
    if args.build_only:
        return
    with bench_lock():
        raw = run_rounds(paths, threads, args)
    rows = summarize(raw, models, threads, args.max_foreign)
    print()
    print(table(rows))
    if not args.no_write:
        data = {
            "layers": args.layers,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "runs_per_batch": RUNS_PER_BATCH,
            "max_foreign_cores": args.max_foreign,
            "build_seconds": build_s,
            "models": {
                q: {**m, "path": str(paths[q].relative_to(ROOT))} for q, m in models.items()
            },
            "rows": rows,
            "raw": raw,
        }
        write_section("gemv", data, report(rows, args))
        print(f"wrote {RESULT.relative_to(ROOT)} and docs/PERFORMANCE.md")


if __name__ == "__main__":
    main()
