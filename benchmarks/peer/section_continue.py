"""The `continue` and `continue4096` sections: continuing a long conversation, edge-agent's
sessions against LiteRT-LM re-prefilling it and keeping its session alive."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks._report import fmt
from benchmarks.peer.harness import collect, spawn
from benchmarks.peer.models import bench_profile, model_and_bundle
from benchmarks.peer.spec import HISTORY, MAIN_MODEL


def run_continue(
    a: argparse.Namespace,
    skipped: list[str],
    section: str = "continue",
    spec: tuple[Path, list[str]] = MAIN_MODEL,
    history: int = HISTORY,
) -> dict[str, Any] | None:
    model, bundle = model_and_bundle(section, spec, skipped)
    if model is None:
        return None
    t = max(a.threads)
    profile = bench_profile(t, "int8")
    edge, peer = [], []
    rounds = min(a.rounds, 3)  # differences far above the noise: 3 rounds
    for _ in range(rounds):
        common = dict(model=model, quant="int8", profile=profile, threads=t, history=history)
        edge.append(spawn("edge", task="continue", **common))
        if bundle is not None:
            peer.append(spawn("litertlm", task="continue", bundle=bundle, **common))
        print("continue", edge[-1], peer[-1] if peer else "")
    out: dict[str, Any] = {
        "model": model.name,
        "threads": t,
        "rounds": rounds,
        "history_tokens": edge[0]["history_tokens"],
        "turn_tokens": edge[0]["turn_tokens"],
        "bound_ttft_ms": collect(edge, "bound_ttft_ms"),
        "disk_ttft_ms": collect(edge, "disk_ttft_ms"),
    }
    if peer:
        out["reprefill_ttft_ms"] = collect(peer, "reprefill_ttft_ms")
        out["reprefill_tokens"] = peer[0]["reprefill_tokens"]
        out["live_ttft_ms"] = collect(peer, "live_ttft_ms")
    return out


def md_continue(c: dict[str, Any]) -> list[str]:
    lines = [
        f"A {c['history_tokens']}-token conversation continued with a {c['turn_tokens']}-token "
        f"turn (`{c['model']}`, int8, {c['threads']} threads): time to first token.",
        "",
        "| how | TTFT (ms) |",
        "|---|---|",
        f"| edge-agent session, bound | {fmt(c['bound_ttft_ms'], 1)} |",
        f"| edge-agent session, from the disk tier after a restart | {fmt(c['disk_ttft_ms'], 1)} |",
    ]
    if "reprefill_ttft_ms" in c:
        lines += [
            f"| LiteRT-LM, re-prefilling the history ({c['reprefill_tokens']} tokens) | "
            f"{fmt(c['reprefill_ttft_ms'], 1)} |",
            f"| LiteRT-LM, its session kept alive in the process | {fmt(c['live_ttft_ms'], 1)} |",
            "",
            f"Re-prefill / edge-agent: bound "
            f"**{c['reprefill_ttft_ms']['median'] / c['bound_ttft_ms']['median']:.1f}x**, "
            f"disk tier **{c['reprefill_ttft_ms']['median'] / c['disk_ttft_ms']['median']:.1f}x**.",
        ]
    return lines
