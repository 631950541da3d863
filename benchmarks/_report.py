"""Shared by the benchmarks: medians with ranges, and writing results into docs/."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def med(xs: list[float]) -> dict[str, float]:
    """Median, min and max of a list of measurements."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fmt(d: dict[str, float], digits: int = 3) -> str:
    """`median (min–max)` of a `med` result."""
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def write_section(name: str, data: dict[str, Any], body: str) -> None:
    """Write docs/bench/<name>.json and replace (or append) the section in PERFORMANCE.md."""
    out = ROOT / "docs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    begin, end = markers(name)
    block = f"{begin}\n{body}\n{end}"
    perf = ROOT / "docs" / "PERFORMANCE.md"
    text = perf.read_text() if perf.exists() else "# Performance\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    perf.write_text(text)


def section_name(base: str, args: argparse.Namespace) -> str:
    """The PERFORMANCE.md section a run writes: `base` for the demo model, `base-<dir name>`
    for another model, so that runs on different models keep their own tables."""
    return f"{base}-{Path(args.model).name}" if args.model else base


def bench_args(doc: str | None) -> argparse.Namespace:
    """The options every benchmark takes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the demo model)")
    ap.add_argument("--profile", help="profile name or path (default: detect)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch docs/")
    return ap.parse_args()
