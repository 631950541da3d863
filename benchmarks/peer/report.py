"""The peer benchmark's report: the plot and the PERFORMANCE.md section, from a run's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.peer.section_continue import md_continue
from benchmarks.peer.section_main import md_main
from benchmarks.peer.section_spec import md_spec, md_verify_cost
from benchmarks.peer.section_windows import md_windows
from benchmarks.peer.spec import ENGINES, NAMES, have


def plot(res: dict[str, Any], path: Path) -> bool:
    if not have("matplotlib"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    titles = {
        "main": "single-length file (windows added at load)",
        "main-windows": "the same with KV windows exported",
    }
    for ax, (key, title) in zip(axes, titles.items(), strict=False):
        m = res.get(key)
        if not m:
            continue
        labels = []
        for x, c in enumerate(m["cells"]):
            for i, e in enumerate(ENGINES):
                s = c.get(e)
                if s:
                    d = s["decode_tok_s"]
                    ax.bar(
                        x + i * 0.27,
                        d["median"],
                        0.27,
                        yerr=[[d["median"] - d["min"]], [d["max"] - d["median"]]],
                        color=f"C{i}",
                        label=NAMES[e] if x == 0 else None,
                    )
            ceiling = c.get("edge_ceiling_tok_s", c["ceiling_tok_s"])
            ax.hlines(ceiling, x - 0.15, x + 0.7, colors="k", linestyles="dotted")
            labels.append(f"{c['quant']}\n{c['threads']}t")
        ax.set_xticks([i + 0.27 for i in range(len(labels))], labels)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"decode, KV 1024, {title}\n(dotted: edge-agent's bandwidth ceiling)")
        ax.legend(fontsize=8)
    w = res.get("windows")
    if w:
        ax = axes[2]
        used = [p["used"] for p in w["points"]]
        for i, k in enumerate(("windows", "single", "litertlm")):
            ys = [p[k]["decode_tok_s"]["median"] for p in w["points"] if k in p]
            if ys:
                label = {"windows": "edge-agent, KV windows", "single": "edge-agent, single length"}
                ax.plot(used[: len(ys)], ys, "o-", color=f"C{i}", label=label.get(k, "LiteRT-LM"))
        ax.set_xscale("log")
        ax.set_xticks(used, [str(u) for u in used])
        ax.minorticks_off()
        ax.set_xlabel("used context (tokens) of a 4096-token model")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("decode speed by used context")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def report(res: dict[str, Any]) -> str:
    lines = [
        f"Measured on {res['machine']}, Python {res['python']}; every figure is the median "
        "(min–max) of alternating rounds (the number is given per table: 3 where the differences "
        "are far above the noise), each "
        "contender in a fresh process, loaded once, warmed up with the same request, timed "
        "where its tokens arrive: LiteRT-LM "
        f"{res.get('litert_lm_version', '(not installed)')} at the consumer of its Python "
        "API's stream, edge-agent at the consumer of `Engine.generate` or at the gRPC client. "
        "Prefill tok/s = prompt tokens / time to first token. The prompts are made once by the "
        "parent process and handed to every worker in a file, so no worker's peak RSS holds "
        "a tokenizer's work on the source tree they are cut from (before 2026-11-30 each worker "
        "made its own: 30–50 MiB more peak RSS in both engines).",
        "",
    ]
    if res["skipped"]:
        lines += ["Skipped: " + "; ".join(res["skipped"]) + ".", ""]
    sections = (
        ("main", "Against LiteRT-LM and the bandwidth ceiling", md_main),
        ("main-windows", "The same, on the file with KV windows", md_main),
        ("windows", "KV windows: decode cost follows the used context", md_windows),
        ("continue", "Continuing a conversation", md_continue),
        ("continue4096", "Continuing a 1,000-token conversation on the KV-4096 model", md_continue),
        ("spec", "Speculative decoding (prompt lookup) on the demo model", md_spec),
        ("verify-cost", "What a verify call costs against a decode step", md_verify_cost),
    )
    for key, title, md in sections:
        part = res.get(key)
        if not part:
            continue
        lines += [f"#### {title}", ""]
        lines += [
            f"Measured {part['date']}, {part['rounds']} rounds: `{part['command']}`.",
            "",
            *md(part),
            "",
        ]
    if res.get("plot"):
        lines += ["![decode speed](bench/peer.png)", ""]
    return "\n".join(lines).rstrip()
