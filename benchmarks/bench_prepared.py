"""What the prepared copy's correctness costs: keeping the attention composite, and the
first-load check against the original file (issue 20 §1).

For each variant of a model directory (default: the SmolLM-shaped `.cache/models/smollm-kv1024`
that `benchmarks/bench_peer.py` builds, else the demo model):

* decode ms/step on the bare CompiledModel path (no KV windows) of three files: the original
  fused export, every composite inlined (what prepared copies did up to format 3), and the
  attention composite kept (format 4), alternating, medians of rounds;
* the first load with an empty weight cache directory (prepare, pack, reopen, check), split
  into the check's two halves (the original file's reference run on the Interpreter, the
  copy's comparison), and a warm load.

Writes the `prepared` section of docs/PERFORMANCE.md (`--no-write`: print only).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.model.directory import demo_model_dir, load_model_dir
from agent.model.tflite.file import read_model_file
from agent.model.tflite.layout import discover_layout
from agent.profile import DeviceProfile, resolve_profile
from agent.runtime import litert
from agent.runtime.interpreter import InterpreterRunner
from agent.runtime.prepare import check, inline
from benchmarks._report import ROOT, bench_args, fmt, med, write_section

SMOLLM = ROOT / ".cache" / "models" / "smollm-kv1024"


def _profile(base: DeviceProfile, cache: Path | None) -> DeviceProfile:
    from dataclasses import replace

    return replace(base, runtime=replace(base.runtime, xnnpack_weight_cache_dir=cache))


def _copy(src: Path, dst: Path, kept: frozenset[str]) -> Path:
    saved = inline.KEPT_COMPOSITES
    inline.KEPT_COMPOSITES = kept
    try:
        inline.prepare_file(src, dst)
    finally:
        inline.KEPT_COMPOSITES = saved
    return dst


def decode_ms(path: Path, profile: DeviceProfile, steps: int) -> float:
    loaded = litert.load(path, profile, kv_windows=False)
    runner = loaded.runner
    kv = runner.new_kv()
    runner.prefill(kv, [5] * 31, 0)
    for pos in range(31, 41):  # warm-up
        runner.decode(kv, 7, pos)
    t = time.perf_counter()
    for pos in range(41, 41 + steps):
        runner.decode(kv, 7, pos)
    ms = (time.perf_counter() - t) / steps * 1e3
    runner.close()
    return ms


def first_load(path: Path, sha: str, profile: DeviceProfile, cache: Path) -> dict[str, float]:
    shutil.rmtree(cache, ignore_errors=True)
    t = time.perf_counter()
    loaded = litert.load(path, _profile(profile, cache), cache_key=sha)
    total = time.perf_counter() - t
    assert not loaded.prepared.startswith("refused"), loaded.prepared
    # the check's halves, timed on their own on the loaded runner
    model = read_model_file(path)
    layout = discover_layout(model)
    rt = profile.runtime
    t = time.perf_counter()
    ref = InterpreterRunner(path, layout, "xnnpack", rt.num_threads, None, rt.backend)
    want = check.reference(ref, model)
    ref.close()
    reference_s = time.perf_counter() - t
    t = time.perf_counter()
    problem = check.compare(loaded.runner, want)
    compare_s = time.perf_counter() - t
    assert problem is None, problem
    loaded.runner.close()
    t = time.perf_counter()
    warm = litert.load(path, _profile(profile, cache), cache_key=sha)
    warm_s = time.perf_counter() - t
    warm.runner.close()
    return {"first": total, "reference": reference_s, "compare": compare_s, "warm": warm_s}


def main() -> None:
    args = bench_args(__doc__)
    model_dir = (
        Path(args.model)
        if args.model
        else (SMOLLM if (SMOLLM / "metadata.json").exists() else None)
    )
    model_dir = model_dir or demo_model_dir()
    meta = load_model_dir(model_dir)
    base, _why = resolve_profile(args.profile or "generic-x86_64")
    bare = _profile(base, None)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in meta.variants:
            src = meta.path_of(variant)
            files = {
                "as exported": src,
                "all inlined (p3)": _copy(src, Path(tmp) / "all.tflite", frozenset()),
                "attention kept (p4)": _copy(
                    src, Path(tmp) / "kept.tflite", inline.KEPT_COMPOSITES
                ),
            }
            times: dict[str, list[float]] = {k: [] for k in files}
            for _ in range(args.rounds):
                for name, path in files.items():
                    times[name].append(decode_ms(path, bare, args.tokens))
            loads = [first_load(src, variant.sha256, base, Path(tmp) / "cache") for _ in range(2)]
            row = {
                "quantization": variant.quantization,
                "decode_ms": {k: med(v) for k, v in times.items()},
                "load_s": {k: med([x[k] for x in loads]) for k in loads[0]},
            }
            rows.append(row)
            print(row, flush=True)
    names = list(rows[0]["decode_ms"])
    lines = [
        "## Prepared copies: the attention composite and the first-load check (issue 20)",
        "",
        f"`python benchmarks/bench_prepared.py` on `{model_dir.name}` ({meta.name}), profile "
        f"{base.name}, {base.runtime.num_threads} threads, {args.rounds} alternating rounds of "
        f"{args.tokens} decode steps each (bare CompiledModel, no KV windows); ms per step, "
        "median (min–max):",
        "",
        "| variant | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for r in rows:
        lines.append(
            f"| {r['quantization']} | "
            + " | ".join(fmt(r["decode_ms"][n], 2) for n in names)
            + " |"
        )
    lines += [
        "",
        "First load with an empty weight cache directory (prepare, pack, reopen, check against "
        "the original file), its check's two halves timed again on their own, and a warm load; "
        "seconds, median of 2 (min–max):",
        "",
        "| variant | first load | check: original's reference run | check: compare | warm load |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ls = r["load_s"]
        lines.append(
            f"| {r['quantization']} | {fmt(ls['first'], 2)} | {fmt(ls['reference'], 2)} | "
            f"{fmt(ls['compare'], 2)} | {fmt(ls['warm'], 2)} |"
        )
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("prepared", {"model": str(model_dir.name), "rows": rows}, body)


if __name__ == "__main__":
    main()
