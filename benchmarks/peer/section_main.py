"""The `main` and `main-windows` sections: decode, time to first token, prefill and peak RSS
of every engine by quantization and threads, and the roofline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks._report import fmt, med
from benchmarks.peer.harness import collect, spawn
from benchmarks.peer.models import bench_profile, ensure_model, pack_litertlm
from benchmarks.peer.roofline import (
    bytes_per_token,
    decode_rows,
    read_bandwidth,
    read_variant,
    set_ceilings,
)
from benchmarks.peer.spec import ENGINES, MAIN_MODEL, NAMES, QUANTS

MAIN_KEYS = (
    "decode_tok_s",
    "ttft64_ms",
    "ttft448_ms",
    "prefill64_tok_s",
    "prefill448_tok_s",
    "peak_rss_mib",
    "load_s",
)


def run_main(
    a: argparse.Namespace,
    skipped: list[str],
    section: str = "main",
    spec: tuple[Path, list[str]] = MAIN_MODEL,
) -> dict[str, Any] | None:
    model = ensure_model(*spec)
    if model is None:
        skipped.append(f"{section}: no model (toolchain extra missing)")
        return None
    from agent.model.tflite.layout import discover_layout

    engines = [e for e in ENGINES if e != "litertlm"]
    bundles = {q: pack_litertlm(model, q) for q in QUANTS}
    if all(bundles.values()):
        engines.append("litertlm")
    else:
        skipped.append("LiteRT-LM: the peer extra (litert-lm-api, litert-lm-builder) is missing")
    # The ceiling is the best read bandwidth the machine showed: sampled before every round,
    # since a neighbour's load on a shared machine lowers a single sample by up to half.
    samples: dict[int, list[float]] = {t: [read_bandwidth(t)] for t in a.threads}
    out: dict[str, Any] = {"model": model.name, "cells": []}
    for q in QUANTS:
        parsed = read_variant(model, q)
        bpt = bytes_per_token(parsed, 1024)
        for t in a.threads:
            cold: dict[str, Any] = {}
            for e in ("edge", "litertlm"):  # the first load: nothing prepared, packed or cached
                if e in engines:
                    cold[e] = spawn(
                        e,
                        model=model,
                        quant=q,
                        profile=bench_profile(t, q, cold=True),
                        threads=t,
                        bundle=bundles[q],
                        tokens=a.tokens,
                        cold=True,
                    )
                    print(q, t, e, "cold", {k: v for k, v in cold[e].items() if k != "ids"})
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
            for r in range(a.rounds):
                samples[t].append(read_bandwidth(t))
                for e in engines if r % 2 == 0 else reversed(engines):
                    res = spawn(
                        e,
                        model=model,
                        quant=q,
                        profile=bench_profile(t, q),
                        threads=t,
                        bundle=bundles[q],
                        tokens=a.tokens,
                    )
                    runs[e].append(res)
                    print(q, t, e, r, {k: v for k, v in res.items() if k != "ids"}, flush=True)
            cell: dict[str, Any] = {"quant": q, "threads": t, "bytes_per_token": bpt, "cold": cold}
            out["edge_windows"] = runs["edge"][0]["kv_windows"]
            out["file_windows"] = [w.length for w in discover_layout(parsed).windows]
            rows = decode_rows(out["edge_windows"], 64 + a.tokens)
            out["edge_kv_rows"] = rows
            edge_bpt = bytes_per_token(parsed, rows)
            if edge_bpt != bpt:  # edge-agent decodes in a KV window: it reads fewer bytes
                cell["edge_bytes_per_token"] = edge_bpt
            for e, results in runs.items():
                stats: dict[str, Any] = {"rounds": {}}
                for k in MAIN_KEYS:
                    got = collect(results, k)
                    if got is not None:
                        stats[k] = got
                        stats["rounds"][k] = [row[k] for row in results]
                cell[e] = stats
            out["cells"].append(cell)
    out["bandwidth_gb_s"] = {t: max(v) for t, v in samples.items()}
    out["bandwidth_samples_gb_s"] = samples
    for cell in out["cells"]:
        set_ceilings(cell, out["bandwidth_gb_s"][cell["threads"]])
    return out


def md_main(m: dict[str, Any]) -> list[str]:
    spread = m.get("bandwidth_samples_gb_s", {})
    bw = ", ".join(
        f"{t} thread(s) {v:.1f} GB/s"
        + (
            f" (the best of {len(spread[t])} samples taken before each round; lowest "
            f"{min(spread[t]):.1f})"
            if spread.get(t)
            else ""
        )
        for t, v in m["bandwidth_gb_s"].items()
    )
    rows = m.get("edge_kv_rows")
    edge = ", ".join(str(w) for w in m.get("edge_windows", [])[:-1])
    runs = (
        f"LiteRT-LM runs its `decode` and `prefill_<N>` signatures over 1024 rows, edge-agent "
        f"decodes in the {rows}-row window and prefills a 448-token prompt in the 512-row one"
    )
    windows = ""
    if rows and rows < 1024 and m.get("file_windows"):
        windows = f" with KV windows {edge} in the same file: {runs}"
    elif rows and rows < 1024:
        windows = f", a single-length file; edge-agent adds KV windows {edge} at load: {runs}"
    lines = [
        f"Model `{m['model']}` (SmolLM-135M shape, random weights, KV 1024){windows}. Measured "
        f"read bandwidth: {bw}. Decode: 64-token prompt, {m.get('tokens', 128)} tokens, greedy.",
        "",
        "| quant | threads | engine | decode tok/s | of ceiling | TTFT 64 (ms) | TTFT 448 (ms) "
        "| prefill 448 tok/s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in m["cells"]:
        for e in ENGINES:
            s = c.get(e)
            if s is None:
                continue
            pf = s.get("prefill448_tok_s")
            lines.append(
                f"| {c['quant']} | {c['threads']} | {NAMES[e]} | {fmt(s['decode_tok_s'], 1)} | "
                f"{100 * s['of_ceiling']:.0f}% | {fmt(s['ttft64_ms'], 0)} | "
                f"{fmt(s['ttft448_ms'], 0)} | {pf['median']:.0f} | "
                f"{s['peak_rss_mib']['median']:.0f} |"
                if pf
                else f"| {c['quant']} | {c['threads']} | {NAMES[e]} | "
                f"{fmt(s['decode_tok_s'], 1)} | {100 * s['of_ceiling']:.0f}% | "
                f"{fmt(s['ttft64_ms'], 0)} | {fmt(s['ttft448_ms'], 0)} | – | "
                f"{s['peak_rss_mib']['median']:.0f} |"
            )
    lines += [
        "",
        "Ratios are paired: the median (min–max) over rounds of the ratio within a round, so a "
        "slow spell of the machine that hits one round hits both sides of its ratio.",
        "",
        "| quant | threads | bytes/token (weights + KV) | ceiling tok/s | decode edge ÷ LiteRT-LM "
        "(≥ 1 is better) | decode gRPC ÷ in-process | TTFT 64 edge ÷ LiteRT-LM (≤ 1 is better) "
        "| TTFT 448 edge ÷ LiteRT-LM | peak RSS edge ÷ LiteRT-LM (≤ 1 is better) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in m["cells"]:
        b = c["bytes_per_token"]
        e, g, p = c["edge"], c["grpc"], c.get("litertlm")
        read = f"{b['total'] / 1e6:.1f} MB ({b['weights'] / 1e6:.1f} + {b['kv'] / 1e6:.1f})"
        ceiling = f"{c['ceiling_tok_s']:.0f}"
        if "edge_bytes_per_token" in c:
            eb = c["edge_bytes_per_token"]
            read = (
                f"edge-agent {eb['total'] / 1e6:.1f} MB (KV {eb['kv'] / 1e6:.1f}), LiteRT-LM {read}"
            )
            ceiling = f"edge-agent {c['edge_ceiling_tok_s']:.0f}, LiteRT-LM {ceiling}"

        def ratio(x: dict[str, Any], y: dict[str, Any] | None, k: str) -> str:
            if not y or k not in y:
                return "–"
            xs, ys = x.get("rounds", {}).get(k), y.get("rounds", {}).get(k)
            if not xs or not ys:  # a run saved before the rounds were kept: medians
                return f"{x[k]['median'] / y[k]['median']:.2f}x (of medians)"
            return fmt(med([a / b for a, b in zip(xs, ys, strict=True)]), 2).replace(" (", "x (")

        lines.append(
            f"| {c['quant']} | {c['threads']} | {read} | {ceiling} | "
            f"{ratio(e, p, 'decode_tok_s')} | {ratio(g, e, 'decode_tok_s')} | "
            f"{ratio(e, p, 'ttft64_ms')} | {ratio(e, p, 'ttft448_ms')} | "
            f"{ratio(e, p, 'peak_rss_mib')} |"
        )
    return lines + md_cold(m["cells"])


def md_cold(cells: list[dict[str, Any]]) -> list[str]:
    """The first load of a model: one run per cell with empty caches."""
    rows = [c for c in cells if c.get("cold", {}).get("edge") and c["cold"].get("litertlm")]
    if not rows:
        return []
    lines = [
        "",
        "First load, one run per cell with empty caches: edge-agent writes its prepared copy "
        "(composites inlined, KV windows added), packs the weights, reopens the model to map "
        "them and checks the windows; LiteRT-LM packs its weights into its cache directory. "
        "Then the same requests as above.",
        "",
        "| quant | threads | load s edge-agent / LiteRT-LM | peak RSS MiB edge-agent / "
        "LiteRT-LM | peak RSS edge ÷ LiteRT-LM |",
        "|---|---|---|---|---|",
    ]
    for c in rows:
        e, p = c["cold"]["edge"], c["cold"]["litertlm"]
        lines.append(
            f"| {c['quant']} | {c['threads']} | {e['load_s']:.1f} / {p['load_s']:.1f} | "
            f"{e['peak_rss_mib']:.0f} / {p['peak_rss_mib']:.0f} | "
            f"{e['peak_rss_mib'] / p['peak_rss_mib']:.2f}x |"
        )
    return lines
