#!/usr/bin/env python3
"""edge-agent against Google's LiteRT-LM and against the memory-bandwidth limit, in one run.

On the same machine and the same model files (built by the toolchain on first use, cached in
.cache/models/), alternating the contenders within every round, each in a fresh process:

* ``edge``     - edge-agent in-process (`Engine.generate`, consumer-side timing);
* ``grpc``     - edge-agent through the daemon's gRPC unix socket (client-side timing);
* ``litertlm`` - LiteRT-LM (`litert-lm-api`: its C++ engine through its Python API) on a
                 `.litertlm` bundle of the same `.tflite`, timed at the consumer of its stream.

Every contender loads once, warms up with the same request, then serves the measured requests
(a daemon's steady state); prefill tok/s is prompt tokens over time to first token.

Sections:

* ``main``: a SmolLM-135M-shaped model (30 layers, dim 576, 9 heads, 3 KV heads, FFN 1536,
  vocab 49152, KV 1024, transposed KV), random weights, int8 and int4 block 32, 2 threads and
  1: decode tok/s (64-token prompt, 128 decoded), time to first token and prefill tok/s for
  64- and 448-token prompts, peak RSS; plus the roofline (measured read bandwidth, bytes read
  per decoded token, the fraction of the ceiling each engine reaches).
* ``main-windows``: the same on the KV-1024 model exported with KV windows 256 and 512 as
  well: one file for both engines; LiteRT-LM runs its full-length signatures, edge-agent the
  smallest window that holds the request.
* ``windows``: the same shape with KV 4096 and KV windows 256 and 1024 in the one file: decode
  tok/s by used context with the windows, without them (the single-length signatures of the
  same file), and LiteRT-LM; greedy tokens compared.
* ``continue``: continuing a ~1,000-token conversation: edge-agent sessions (bound, and from
  the disk tier after a restart) against LiteRT-LM re-prefilling the history, and against a
  LiteRT-LM session kept alive in its process (976 tokens of history: LiteRT-LM cannot prefill
  closer to the end of the 1024-row cache);
* ``continue4096``: the same with exactly 1,000 tokens of history on the KV-4096 model.
* ``spec``: speculative decoding (prompt lookup) on the bundled demo model: decode tok/s with
  and without it and LiteRT-LM's, on prompts grounded in their input (a held-out stdlib file
  to continue again) and open-ended ones; acceptance, tokens per verify call, same tokens.
* ``verify-cost``: a verify call of each length against a decode step (the demo model and a
  SmolLM-shaped one with verify signatures 4/8/16), and the acceptance that breaks even.

Writes docs/bench/peer.json, a section of docs/PERFORMANCE.md and docs/bench/peer.png. What
is missing is skipped and said so: the toolchain extra (to build the models), the ``peer``
extra (litert-lm-api, litert-lm-builder), the ``bench`` extra (matplotlib, for the plot).

Sections: main, main-windows, windows, continue, continue4096, spec, verify-cost.

    python benchmarks/bench_peer.py [--rounds 3] [--tokens 128] [--threads 2 --threads 1]
                                 [--only SECTION ...]
                                 [--no-write] [--report-only]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import write_section  # noqa: E402
from benchmarks.peer.report import plot, report  # noqa: E402
from benchmarks.peer.section_continue import run_continue  # noqa: E402
from benchmarks.peer.section_main import run_main  # noqa: E402
from benchmarks.peer.section_spec import run_spec, run_verify_cost  # noqa: E402
from benchmarks.peer.section_windows import run_windows  # noqa: E402
from benchmarks.peer.spec import HISTORY_4096, MAIN_WINDOWS_MODEL, SECTIONS, WINDOW_MODEL, have  # noqa: E402
from benchmarks.peer.workers import worker_main  # noqa: E402


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, action="append", help="default: 2 and 1")
    ap.add_argument("--only", choices=(*SECTIONS,), action="append")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--report-only", action="store_true", help="rewrite the docs from docs/bench/peer.json"
    )
    a = ap.parse_args()
    if a.report_only:
        saved = json.loads((ROOT / "docs" / "bench" / "peer.json").read_text())
        saved["plot"] = plot(saved, ROOT / "docs" / "bench" / "peer.png")
        write_section("peer", saved, report(saved))
        return
    a.threads = a.threads or [2, 1]
    parts = a.only or list(SECTIONS)
    skipped: list[str] = []
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "rounds": a.rounds,
        "skipped": skipped,
    }
    if have("litert_lm"):
        from importlib.metadata import version

        res["litert_lm_version"] = version("litert-lm-api")
    Runner = Callable[[argparse.Namespace, list[str]], dict[str, Any] | None]
    command = "python " + " ".join(["benchmarks/bench_peer.py", *sys.argv[1:]])
    runners: dict[str, Runner] = {
        "main": run_main,
        "main-windows": functools.partial(
            run_main, section="main-windows", spec=MAIN_WINDOWS_MODEL
        ),
        "windows": run_windows,
        "continue": run_continue,
        "continue4096": functools.partial(
            run_continue, section="continue4096", spec=WINDOW_MODEL, history=HISTORY_4096
        ),
        "spec": run_spec,
        "verify-cost": run_verify_cost,
    }
    saved_path = ROOT / "docs" / "bench" / "peer.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    for section, run in runners.items():
        if section in parts:
            res[section] = run(a, skipped)
            if res[section]:
                res[section].update(date=res["date"], command=command)
                res[section].setdefault("rounds", a.rounds)
        elif saved.get(section):  # --only: keep the other sections of the last run, dated
            res[section] = saved[section]
            res[section].setdefault("date", saved["date"])
            res[section].setdefault("rounds", saved["rounds"])
            res[section].setdefault("command", saved["command"])
    if res.get("main"):
        res["main"]["tokens"] = a.tokens
    for s in skipped:
        print("SKIPPED:", s)
    res["command"] = command
    print(json.dumps(res, indent=1, default=str)[:3000])
    if a.no_write:
        return
    if not have("matplotlib"):
        skipped.append("the plot: matplotlib (bench extra) is missing")
    res["plot"] = plot(res, ROOT / "docs" / "bench" / "peer.png")
    write_section("peer", json.loads(json.dumps(res, default=str)), report(res))
    print(
        "wrote docs/PERFORMANCE.md, docs/bench/peer.json" + (" and peer.png" if res["plot"] else "")
    )


if __name__ == "__main__":
    main()
