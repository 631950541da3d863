#!/usr/bin/env python3
"""The legacy backend (tflite-runtime 2.14, its own numpy<2 venv) against ai-edge-litert on the
same unfused files: engine decode ms/token (greedy) and time to first token, alternating rounds.

    python scripts/build_model.py --random --kv-max 1024 --no-composites \\
        --tokenizer agent/models/demo/tokenizer.model --quant int8_weight_only --quant fp32 \\
        --name demo-shape-unfused --out .cache/models/legacy-demo
    python benchmarks/bench_legacy.py --model .cache/models/legacy-demo \\
        [--legacy-python .venv-legacy/bin/python] [--rounds 5] [--tokens 128]

The legacy venv is the one `scripts/test` makes (`.venv-legacy`). Writes docs/bench/legacy.json
and the `legacy` section of docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import fmt, med, write_section  # noqa: E402

QUANTS = ("int8_weight_only", "fp32")

# One measurement, run by either interpreter: prints {"decode_ms": ..., "ttft_ms": ...}.
PROBE = r"""
import json, re, sys, tomllib
from pathlib import Path
from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.profile import parse_profile, profiles_dir

model, quant, backend, tokens, interp = sys.argv[1:6]
text = (profiles_dir() / "generic-x86_64.toml").read_text()
text = re.sub(r'(?m)^backend = ".*"$', f'backend = "{backend}"', text)
profile = parse_profile(tomllib.loads(text), "generic-x86_64.toml")
engine = Engine.load(profile, Path(model), quantization=quant, prefer_interpreter=interp == "1")
req = GenerateRequest("import os\n", max_tokens=int(tokens), sampling=SamplingParams(0.0))
engine.complete(req)  # warm-up
stats = engine.complete(req).stats
print(json.dumps({"decode_ms": 1e3 / stats.decode_tok_s, "ttft_ms": stats.ttft_ms,
                  "path": engine.info.execution_path}))
engine.close()
"""


def probe(python: str, model: Path, quant: str, backend: str, tokens: int, interp: bool) -> dict:  # type: ignore[type-arg]
    argv = [python, "-c", PROBE, str(model), quant, backend, str(tokens), "1" if interp else "0"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{backend} {quant}: {r.stderr.strip().splitlines()[-1]}")
    out: dict = json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[type-arg]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--legacy-python", default=str(ROOT / ".venv-legacy" / "bin" / "python"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    model = Path(args.model).resolve()
    paths = {
        "ai-edge-litert, CompiledModel": (sys.executable, "ai-edge-litert", False),
        "ai-edge-litert, Interpreter": (sys.executable, "ai-edge-litert", True),
        "tflite-runtime 2.14, Interpreter": (args.legacy_python, "tflite-runtime", True),
    }
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": model.name,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "rows": {},
    }
    for quant in QUANTS:
        runs: dict[str, list[dict]] = {name: [] for name in paths}  # type: ignore[type-arg]
        for _ in range(args.rounds):  # alternating, so drift hits every path alike
            for name, (python, backend, interp) in paths.items():
                runs[name].append(probe(python, model, quant, backend, args.tokens, interp))
        for name, rs in runs.items():
            res["rows"][f"{quant} | {name}"] = {
                "decode_ms": med([r["decode_ms"] for r in rs]),
                "ttft_ms": med([r["ttft_ms"] for r in rs]),
            }
            print(quant, name, fmt(res["rows"][f"{quant} | {name}"]["decode_ms"]), flush=True)
    body = table(res, args)
    print(body)
    if not args.no_write:
        write_section("legacy", res, body)


def table(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"Measured {res['date']} on x86_64, 2 threads, model `{res['model']}` (the demo model's "
        f"shape, random weights, composites off); engine greedy decode of {res['tokens']} tokens, "
        f"median (min–max) of {res['rounds']} alternating rounds, each in a fresh process. "
        f"Command: `python benchmarks/bench_legacy.py --model {args.model}`.",
        "",
        "| variant | backend and path | decode ms/token | vs ai-edge-litert CompiledModel "
        "| TTFT ms |",
        "|---|---|---|---|---|",
    ]
    for quant in QUANTS:
        base = res["rows"][f"{quant} | ai-edge-litert, CompiledModel"]["decode_ms"]["median"]
        for key, row in res["rows"].items():
            if not key.startswith(quant + " |"):
                continue
            name = key.split(" | ", 1)[1]
            ratio = row["decode_ms"]["median"] / base
            lines.append(
                f"| {quant} | {name} | {fmt(row['decode_ms'])} | {ratio:.2f}x the time | "
                f"{fmt(row['ttft_ms'], 1)} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
