#!/usr/bin/env python3
"""Time to serve a new model: the first load and a warm start of edge-agent against LiteRT-LM
on the same SmolLM-shaped files (`benchmarks/peer/spec.py` MAIN_MODEL, int8 and int4 block 32),
alternating within every round, each load in a fresh process.

* first load: empty caches (edge-agent: its weight cache directory, so the load prepares the
  copy, packs the weights and runs the first-load checks; LiteRT-LM: its cache directory);
* warm start: the same again with what the first load left.

Each worker reports three times: ``import_s`` (importing the engine: edge-agent's engine and
ai-edge-litert's CompiledModel module, which imports ml_dtypes; `litert_lm`), ``load_s`` (the
engine's constructor, as `bench_peer.py` times it: for edge-agent the sha256 check, the
tokenizer, the runtime's load), and ``start_s`` (process start to a loaded engine, measured by
the parent: interpreter start-up, imports and load). Medians of the rounds, and the paired
ratios (median of the ratio within a round).

    python benchmarks/bench_load.py [--rounds 5] [--threads 2] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import fmt, med, write_section  # noqa: E402
from benchmarks.peer.models import bench_profile, ensure_model, pack_litertlm  # noqa: E402
from benchmarks.peer.spec import CACHE, MAIN_MODEL, QUANTS  # noqa: E402

KEYS = ("import_s", "load_s", "start_s")
PARTS = ("sha256_s", "tokenizer_s", "runtime_s")  # edge-agent's load, by part


def worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=("edge", "litertlm"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--quant", required=True)
    ap.add_argument("--profile", default="")
    ap.add_argument("--bundle", default="")
    ap.add_argument("--cache", default="")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    out: dict[str, Any] = {"engine": a.engine}
    t0 = time.perf_counter()
    if a.engine == "edge":
        import ai_edge_litert.compiled_model  # noqa: F401  (the runtime imports it at load)

        from agent.engine.engine import Engine
        from agent.profile import load_profile

        out["import_s"] = time.perf_counter() - t0
        profile = load_profile(Path(a.profile))
        _time_parts(out)
        t1 = time.perf_counter()
        engine = Engine.load(profile, Path(a.model), quantization=a.quant)
        out["load_s"] = time.perf_counter() - t1
        out["prepared"] = engine.info.prepared
        out["ready_unix"] = time.time()
        engine.close()
    else:
        import litert_lm

        out["import_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        eng = litert_lm.Engine(
            a.bundle, backend=litert_lm.Backend.CPU(thread_count=a.threads), cache_dir=a.cache
        )
        out["load_s"] = time.perf_counter() - t1
        out["ready_unix"] = time.time()
        del eng
    print("RESULT " + json.dumps(out), flush=True)


def _time_parts(out: dict[str, Any]) -> None:
    """Time the parts of edge-agent's load (only measured: each call is passed through)."""
    from agent.engine import loading
    from agent.runtime import litert

    def timed(owner: Any, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                out[key] = out.get(key, 0.0) + time.perf_counter() - t

        setattr(owner, name, wrapper)

    timed(loading, "sha256_file", "sha256_s")
    timed(loading, "load_tokenizer", "tokenizer_s")
    timed(litert, "load", "runtime_s")  # loading calls it as litert.load


def spawn(engine: str, **kw: Any) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__)), "--worker", engine]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    started = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[7:])
            res["start_s"] = res.pop("ready_unix") - started
            return res
    raise RuntimeError(f"{engine} worker failed ({r.returncode}):\n{r.stderr[-4000:]}")


def run(rounds: int, threads: int) -> dict[str, Any]:
    model = ensure_model(*MAIN_MODEL)
    if model is None:
        raise SystemExit("no model: the toolchain extra (torch, litert-torch) is missing")
    out: dict[str, Any] = {"model": model.name, "threads": threads, "rounds": rounds, "cells": []}
    for q in QUANTS:
        bundle = pack_litertlm(model, q)
        runs: dict[str, list[dict[str, Any]]] = {
            f"{e}_{k}": [] for e in ("edge", "litertlm") for k in ("cold", "warm")
        }
        for r in range(rounds):
            order = ("edge", "litertlm") if r % 2 == 0 else ("litertlm", "edge")
            for e in order:
                if e == "edge":
                    profile = bench_profile(threads, q, cold=True)  # empties its cache dir
                    kw = {"model": model, "quant": q, "profile": profile, "threads": threads}
                else:
                    if bundle is None:
                        continue
                    cache = CACHE / "litertlm-load" / q
                    shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir(parents=True)
                    kw = {"model": model, "quant": q, "bundle": bundle, "cache": cache}
                    kw["threads"] = threads
                for kind in ("cold", "warm"):
                    res = spawn(e, **kw)
                    runs[f"{e}_{kind}"].append(res)
                    print(q, r, e, kind, res, flush=True)
        cell: dict[str, Any] = {"quant": q}
        for name, rows in runs.items():
            if rows:
                keys = [k for k in (*KEYS, *PARTS) if k in rows[0]]
                cell[name] = {k: med([row[k] for row in rows]) for k in keys}
                cell[name]["rounds"] = {k: [row[k] for row in rows] for k in keys}
        for kind in ("cold", "warm"):
            ours, theirs = runs[f"edge_{kind}"], runs[f"litertlm_{kind}"]
            if ours and theirs:
                cell[f"ratio_{kind}"] = {
                    k: med([a[k] / b[k] for a, b in zip(ours, theirs, strict=True)]) for k in KEYS
                }
        out["prepared"] = runs["edge_cold"][0].get("prepared")
        out["cells"].append(cell)
    return out


def _x(d: dict[str, float]) -> str:
    return f"{d['median']:.2f}x ({d['min']:.2f}–{d['max']:.2f})"


def report(res: dict[str, Any]) -> str:
    lines = [
        f"`{res['command']}` on `{res['model']}` (SmolLM-135M shape, random weights, KV 1024; "
        f"edge-agent adds KV windows at load), {res['threads']} threads, {res['rounds']} "
        f"rounds, {res['date']}, load average {res['loadavg']} at the start. Seconds, median "
        "(min–max); ratios are paired (the median of the ratio within a round).",
        "",
        "| quant | start | engine | import | load (constructor) | process start to loaded | "
        "of the load: sha256 / tokenizer / runtime |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in res["cells"]:
        for kind, label in (("cold", "first load"), ("warm", "warm start")):
            for e, name in (("edge", "edge-agent"), ("litertlm", "LiteRT-LM")):
                s = c.get(f"{e}_{kind}")
                if s:
                    parts = " / ".join(f"{s[k]['median']:.2f}" for k in PARTS if k in s) or "–"
                    lines.append(
                        f"| {c['quant']} | {label} | {name} | {fmt(s['import_s'], 2)} | "
                        f"{fmt(s['load_s'], 2)} | {fmt(s['start_s'], 2)} | {parts} |"
                    )
            ratio = c.get(f"ratio_{kind}")
            if ratio:
                lines.append(
                    f"| {c['quant']} | {label} | edge ÷ LiteRT-LM | "
                    f"{_x(ratio['import_s'])} | **{_x(ratio['load_s'])}** | "
                    f"**{_x(ratio['start_s'])}** | |"
                )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    res = run(a.rounds, a.threads)
    res.update(
        date=time.strftime("%Y-%m-%d"),
        loadavg=f"{load:.1f}",
        command="python " + " ".join(["benchmarks/bench_load.py", *sys.argv[1:]]),
    )
    print(report(res))
    if not a.no_write:
        write_section("load", json.loads(json.dumps(res, default=str)), report(res))


if __name__ == "__main__":
    main()
