"""The `windows` section: decode speed by used context with the KV windows, without them,
and LiteRT-LM's."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._report import fmt
from benchmarks.peer.harness import collect, spawn
from benchmarks.peer.models import bench_profile, model_and_bundle
from benchmarks.peer.spec import WINDOW_DECODE, WINDOW_MODEL, WINDOW_USED


def run_windows(a: argparse.Namespace, skipped: list[str]) -> dict[str, Any] | None:
    model, bundle = model_and_bundle("windows", WINDOW_MODEL, skipped)
    if model is None:
        return None
    t = max(a.threads)
    profile = bench_profile(t, "int8")
    rounds = min(a.rounds, 3)  # differences far above the noise: 3 rounds
    out: dict[str, Any] = {"model": model.name, "threads": t, "points": [], "rounds": rounds}
    for used in WINDOW_USED:
        prompt = used - WINDOW_DECODE
        runs: dict[str, list[dict[str, Any]]] = {"windows": [], "single": [], "litertlm": []}
        for r in range(rounds):
            common = dict(model=model, quant="int8", profile=profile, threads=t, prompt=prompt)
            runs["windows"].append(spawn("edge", task="window", tokens=WINDOW_DECODE, **common))
            runs["single"].append(
                spawn("edge", task="window", tokens=WINDOW_DECODE, no_windows=True, **common)
            )
            if bundle is not None:
                runs["litertlm"].append(
                    spawn("litertlm", task="window", tokens=WINDOW_DECODE, bundle=bundle, **common)
                )
            print("window", used, r, {k: v[-1].get("decode_tok_s") for k, v in runs.items() if v})
        point: dict[str, Any] = {"used": used, "prompt": prompt}
        for k, rows in runs.items():
            if rows:
                point[k] = {"decode_tok_s": collect(rows, "decode_tok_s")}
        point["same_tokens"] = all(
            w["ids"] == s["ids"] for w, s in zip(runs["windows"], runs["single"], strict=True)
        )
        point["decoded"] = len(runs["windows"][0]["ids"])
        out["points"].append(point)
    return out


def md_windows(w: dict[str, Any]) -> list[str]:
    lines = [
        f"Model `{w['model']}`: KV 4096 with KV windows 256 and 1024 in the same file, int8, "
        f"{w['threads']} threads; {WINDOW_DECODE} tokens decoded after a prompt of "
        f"(used − {WINDOW_DECODE}) tokens, greedy.",
        "",
        "| used context | windows tok/s | single-length tok/s | LiteRT-LM tok/s | windows / "
        "single | windows / LiteRT-LM | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in w["points"]:
        win, one = p["windows"]["decode_tok_s"], p["single"]["decode_tok_s"]
        peer = p.get("litertlm", {}).get("decode_tok_s")
        vs_peer = f"{win['median'] / peer['median']:.2f}x" if peer else "–"
        same = "yes" if p["same_tokens"] else "**no**"
        lines.append(
            f"| {p['used']} | {fmt(win, 1)} | {fmt(one, 1)} | {fmt(peer, 1) if peer else '–'} | "
            f"{win['median'] / one['median']:.2f}x | {vs_peer} | {same} ({p['decoded']} tokens) |"
        )
    return lines
