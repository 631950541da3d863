"""The `spec` and `verify-cost` sections: speculative decoding (prompt lookup) on the demo model
against plain decoding and LiteRT-LM, on prompts grounded in their input and open-ended ones;
and what a verify call costs against a decode step (the demo model and the SmolLM-shaped one),
with the acceptance at which speculation breaks even."""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._report import ROOT, fmt, med
from benchmarks.peer.harness import spawn
from benchmarks.peer.models import bench_profile, ensure_model, pack_litertlm
from benchmarks.peer.spec import MODELS, SMOLLM

DEMO = ROOT / "agent" / "models" / "demo"
VERIFY_MODEL = (
    MODELS / "smollm-kv1024v",
    [*SMOLLM, "--kv-max", "1024", "--quant", "int8"]
    + [arg for n in (4, 8, 16) for arg in ("--verify", str(n))],
)
FILES = 3  # held-out stdlib files per prompt kind
GROUNDED_DOC = 384  # tokens of the file in a grounded prompt
OPEN_PROMPT = 64  # tokens of the file an open-ended prompt starts with
ENGINES = (("plain", "edge", "off"), ("spec", "edge", "ngram"), ("litertlm", "litertlm", ""))


@functools.cache
def spec_prompts() -> tuple[Path, tuple[str, ...], tuple[str, ...]]:
    """The prompts, written once: grounded ones (a held-out stdlib file, then the same file
    again from its start, to be continued: the continuation reuses the prompt's text, as an
    edit of given code does) and open-ended ones (the first lines of another held-out file).
    Held-out files (`agent.toolchain.corpus`): the demo model never trained on them."""
    from agent.model.directory import load_model_dir
    from agent.tokenizer.load import load_tokenizer
    from agent.toolchain import corpus

    tok = load_tokenizer(load_model_dir(DEMO).tokenizer_path)
    _, held = corpus.split(corpus.list_files())
    files = [f for f in sorted(held, key=lambda f: f.rel) if len(f.read()) > 6000]
    texts: dict[str, str] = {}
    warm = tok.encode(files[-1].read())
    texts["64"] = str(tok.decode(warm[:63]))
    grounded, opened = [], []
    for f in files[:FILES]:
        ids = tok.encode(f.read())
        doc = str(tok.decode(ids[:GROUNDED_DOC]))
        head = doc[: doc.find("\n", 120) + 1] if "\n" in doc[120:] else doc[:120]
        key = f"grounded:{f.rel}"
        texts[key] = f"{doc}\n\n\n# {f.rel}, unchanged:\n{head}"
        grounded.append(key)
    for f in files[FILES : 2 * FILES]:
        ids = tok.encode(f.read())
        key = f"open:{f.rel}"
        texts[key] = str(tok.decode(ids[: OPEN_PROMPT - 1]))
        opened.append(key)
    fd, name = tempfile.mkstemp(prefix="bench-spec-prompts-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(texts, out)
    return Path(name), tuple(grounded), tuple(opened)


def run_spec(a: argparse.Namespace, skipped: list[str]) -> dict[str, Any] | None:
    from benchmarks.peer.workers_spec import SAMPLED

    prompts, grounded, opened = spec_prompts()
    sampled = tuple(k + SAMPLED for k in opened)
    keys = ",".join((*grounded, *opened, *sampled))
    t = max(a.threads)
    q = "int8"
    bundle = pack_litertlm(DEMO, q)
    if bundle is None:
        skipped.append("spec: the LiteRT-LM column (peer extra missing)")
    engines = [e for e in ENGINES if e[1] != "litertlm" or bundle is not None]
    common = dict(model=DEMO, quant=q, profile=bench_profile(t, q), threads=t, prompts=prompts)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in engines}
    for r in range(a.rounds):
        for name, engine, speculation in engines if r % 2 == 0 else engines[::-1]:
            res = spawn(
                engine,
                task="spec",
                keys=keys,
                speculation=speculation or None,
                bundle=bundle,
                tokens=a.tokens,
                **common,
            )
            runs[name].append(res)
            print(
                "spec", name, r, {k: round(v["decode_tok_s"], 1) for k, v in res["prompts"].items()}
            )
    out: dict[str, Any] = {"model": "edge-demo-pystdlib (agent/models/demo)", "quant": q}
    out.update(threads=t, tokens=a.tokens, rows=[])
    for key in (*grounded, *opened, *sampled):
        kind = key.split(":")[0] + (" sampled" if key.endswith(SAMPLED) else "")
        row: dict[str, Any] = {"prompt": key, "kind": kind}
        for name in runs:
            row[name] = [res["prompts"][key] for res in runs[name] if key in res["prompts"]]
        row["same_tokens"] = all(
            p["ids"] == s["ids"] for p, s in zip(row["plain"], row["spec"], strict=True)
        )
        for p in (*row["plain"], *row["spec"]):
            p.pop("ids", None)
        out["rows"].append(row)
    return out


def _rates(xs: list[dict[str, Any]]) -> list[float]:
    return [x["decode_tok_s"] for x in xs]


def _paired(xs: list[dict[str, Any]], ys: list[dict[str, Any]]) -> list[float]:
    return [a / b for a, b in zip(_rates(xs), _rates(ys), strict=True) if b]


def md_spec(s: dict[str, Any]) -> list[str]:
    lines = [
        f"Model {s['model']}, {s['quant']}, {s['threads']} threads, {s['tokens']} tokens. "
        "Grounded prompts: a held-out standard-library file's first "
        f"{GROUNDED_DOC} tokens, then the same file again from its start, to be continued (the "
        "continuation reuses the prompt's text, as an edit of given code does); open-ended: "
        f"another held-out file's first {OPEN_PROMPT} tokens, greedy and sampled (`@sampled`: "
        "temperature 0.8, top-k 40, seed 0; LiteRT-LM not run: its sampler is not ours). "
        "Speculation: prompt lookup "
        '(`ngram`), adaptive draft length; plain: `speculation = "off"`. Ratios are paired '
        "within a round.",
        "",
        "| prompt | spec tok/s | plain tok/s | LiteRT-LM tok/s | spec ÷ plain | spec ÷ LiteRT-LM "
        "| plain ÷ LiteRT-LM | acceptance | tokens per verify call | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in s["rows"]:
        spec, plain = row["spec"], row["plain"]
        drafted = sum(x["drafted"] for x in spec)
        accepted = sum(x["accepted"] for x in spec)
        calls = sum(x["verify_calls"] for x in spec)
        emitted = sum(x["accepted"] + x["verify_calls"] for x in spec)  # one sampled per call
        litert = row.get("litertlm") or []
        lines.append(
            f"| {row['prompt']} | {fmt(med(_rates(spec)), 1)} | {fmt(med(_rates(plain)), 1)} | "
            + (f"{fmt(med(_rates(litert)), 1)} | " if litert else "– | ")
            + f"{fmt(med(_paired(spec, plain)), 2)} | "
            + (f"{fmt(med(_paired(spec, litert)), 2)} | " if litert else "– | ")
            + (f"{fmt(med(_paired(plain, litert)), 2)} | " if litert else "– | ")
            + (f"{accepted / drafted:.0%} | " if drafted else "no drafts | ")
            + (f"{emitted / calls:.2f} | " if calls else "– | ")
            + ("yes" if row["same_tokens"] else "**no**")
            + " |"
        )
    lines += ["", "By kind (median over the prompts and rounds of the paired ratios):", ""]
    lines += ["| kind | spec ÷ plain | spec ÷ LiteRT-LM | plain ÷ LiteRT-LM |", "|---|---|---|---|"]
    for kind in ("grounded", "open", "open sampled"):
        rows = [r for r in s["rows"] if r["kind"] == kind]
        sp = [x for r in rows for x in _paired(r["spec"], r["plain"])]
        sl = [x for r in rows if r.get("litertlm") for x in _paired(r["spec"], r["litertlm"])]
        pl = [x for r in rows if r.get("litertlm") for x in _paired(r["plain"], r["litertlm"])]
        if not sp:
            continue
        lines.append(
            f"| {kind} | {fmt(med(sp), 2)} | {fmt(med(sl), 2) if sl else '–'} | "
            f"{fmt(med(pl), 2) if pl else '–'} |"
        )
    return lines


def run_verify_cost(a: argparse.Namespace, skipped: list[str]) -> dict[str, Any] | None:
    t = max(a.threads)
    out: dict[str, Any] = {"threads": t, "models": []}
    smollm = ensure_model(*VERIFY_MODEL)
    if smollm is None:
        skipped.append("verify-cost: no SmolLM-shaped model (toolchain extra missing)")
    for name, model in (("demo", DEMO), ("smollm-kv1024v", smollm)):
        if model is None:
            continue
        runs = [
            spawn(
                "edge",
                task="verify",
                model=model,
                quant="int8",
                profile=bench_profile(t, "int8"),
                threads=t,
            )
            for _ in range(a.rounds)
        ]
        out["models"].append({"model": name, "runs": runs})
    return out


def md_verify_cost(v: dict[str, Any]) -> list[str]:
    from agent.engine.speculation import break_even

    lines = [
        f"{v['threads']} threads, int8, through the runner: the median of 40 calls after 5 "
        "untimed ones, after a prompt of 64 tokens (decoding in the 256-row KV window) and of "
        "448 (the 512-row one); the median over rounds of each round's figure. A verify call "
        "of N tokens checks N−1 drafted tokens and yields 1 + the accepted ones; break-even is "
        "the per-token acceptance at which that pays for the call's cost (random weights give "
        "no meaningful acceptance on the SmolLM-shaped model).",
        "",
        "| model | context | KV window | decode ms | verify N | verify ms | ÷ decode "
        "| break-even acceptance | tokens/s at 90% acceptance ÷ decode |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in v["models"]:
        runs = [r for r in m["runs"] if r.get("allowed")]
        if not runs:
            lines.append(f"| {m['model']} | – | – | – | – | – | – | not allowed on this load | – |")
            continue
        for ctx, first in runs[0]["contexts"].items():
            points = [r["contexts"][ctx] for r in runs]
            dec = med([p["decode_ms"] for p in points])
            for n in sorted(first["verify_ms"], key=int):
                ver = med([p["verify_ms"][n] for p in points])
                ratio = med([p["verify_ms"][n] / p["decode_ms"] for p in points])
                be = break_even(ratio["median"], int(n) - 1)  # n tokens: n - 1 drafts
                at90 = (1 - 0.9 ** int(n)) / 0.1 / ratio["median"]
                lines.append(
                    f"| {m['model']} | {ctx} | {first['kv_rows']} | {fmt(dec, 3)} | {n} | "
                    f"{fmt(ver, 3)} | {fmt(ratio, 2)} | "
                    + (f"{be:.0%}" if be is not None else "never")
                    + f" | {at90:.2f}x |"
                )
    return lines
