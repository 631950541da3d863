#!/usr/bin/env python3
"""Update delta benchmark: ``ea-delta-1`` against bsdiff4 and ``zstd --patch-from`` on
realistic updates of the demo model.

Updates (all made from the shipped demo model, seeded):

* fine-tune 10%: 10% of the int8 weight tensors, 30% of their values nudged by ±1..3 (what a
  short fine-tune + requantization does to int8 weights); the goal is a delta ≤ ~11% of the
  model.
* fine-tune last layer: every weight of the last transformer block nudged by ±1..3.
* re-quantization: the int8 file -> the int4 block32 file of the same model.
* re-calibration: every int8 weight requantized with 3% larger scales (q' = round(q * 0.97),
  per-channel scales rewritten in the flatbuffer).
* tokenizer: 16 pieces replaced and 5% of the merge scores changed (SentencePiece protobuf).

For each: delta size, time to make it, time to apply it and the peak RSS of applying it, each
tool in a fresh process (Python tools: peak RSS above the interpreter's after imports; the
zstd CLI: its whole peak RSS). Our apply time includes checking the base's sha256.

Writes its section of docs/UPDATES.md.

    python benchmarks/bench_delta.py [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bsdiff4  # noqa: E402
import numpy as np  # noqa: E402
from ai_edge_litert import schema_py_generated as schema  # noqa: E402

from agent.model.directory import demo_model_dir, sha256_file  # noqa: E402
from agent.ota.delta.files import diff_file  # noqa: E402
from agent.ota.delta.regions import tflite_regions  # noqa: E402

MIB = 1 << 20
ZSTD = "/usr/bin/zstd"
TIME = "/usr/bin/time"
DOC = ROOT / "docs" / "UPDATES.md"
BEGIN, END = "<!-- bench:updates-delta:begin -->", "<!-- bench:updates-delta:end -->"
GOAL = 0.11

# Runs in a fresh interpreter: apply one delta, report time and peak RSS above the baseline.
CHILD = """
import gc, json, re, sys, time
from pathlib import Path
tool, base, patch, out = sys.argv[1:]
if tool == "ours":
    from agent.ota.delta.files import patch_file
    run = lambda: patch_file(Path(base), Path(patch), Path(out))
else:
    import bsdiff4
    run = lambda: bsdiff4.file_patch(base, out, patch)
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before = status("VmRSS")
start = time.perf_counter()
run()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss_kib": status("VmHWM") - before}))
"""


@dataclass(frozen=True, slots=True)
class Update:
    name: str
    base: Path
    new: Path


# ----------------------------------------------------------------------------- updates


def int8_weights(path: Path) -> list[tuple[str, int, int, int]]:
    """(tensor key, offset, length, tensor index in subgraph 0 or -1) of int8 weight buffers."""
    data = path.read_bytes()
    regions = tflite_regions(data, str(path))
    assert regions is not None
    model = schema.Model.GetRootAs(data, 0)
    int8 = set()
    for s in range(model.SubgraphsLength()):
        sg = model.Subgraphs(s)
        for t in range(sg.TensorsLength()):
            if sg.Tensors(t).Type() == schema.TensorType.INT8:
                int8.add(sg.Tensors(t).Buffer())
    return [(r.key, r.offset, r.length, r.ordinal) for r in regions if r.key and r.ordinal in int8]


def nudge(
    data: bytearray, off: int, length: int, fraction: float, rng: np.random.Generator
) -> None:
    a = np.frombuffer(data, np.int8, length, off).astype(np.int16)
    mask = rng.random(a.size) < fraction
    a[mask] += rng.integers(1, 4, a.size)[mask] * rng.choice([-1, 1], a.size)[mask]
    data[off : off + length] = np.clip(a, -127, 127).astype(np.int8).tobytes()


def fine_tune(base: Path, out: Path, share: float, last_layer: bool, seed: int) -> str:
    rng = np.random.default_rng(seed)
    data = bytearray(base.read_bytes())
    weights = int8_weights(base)
    if last_layer:
        last = max(int(k.split("TransformerBlock_")[1][0]) for k, *_ in weights if "Block_" in k)
        picked = [w for w in weights if f"TransformerBlock_{last}/" in w[0]]
        fraction = 1.0
    else:
        n = max(1, round(share * len(weights)))
        picked = [weights[i] for i in sorted(rng.choice(len(weights), n, replace=False))]
        fraction = 0.3
    for _, off, length, _ in picked:
        nudge(data, off, length, fraction, rng)
    out.write_bytes(data)
    touched = sum(w[2] for w in picked)
    return (
        f"{len(picked)} of {len(weights)} int8 weight tensors, {touched / len(data):.1%} of "
        f"the file's bytes, {fraction:.0%} of their values ±1..3"
    )


def recalibrate(base: Path, out: Path, factor: float = 0.97) -> str:
    """Every int8 weight requantized with scales / factor: q' = round(q * factor)."""
    data = bytearray(base.read_bytes())
    model = schema.Model.GetRootAs(bytes(data), 0)
    done: set[int] = set()
    regions = {r.ordinal: r for r in tflite_regions(bytes(data), "x") or [] if r.key}
    for s in range(model.SubgraphsLength()):
        sg = model.Subgraphs(s)
        for t in range(sg.TensorsLength()):
            tensor = sg.Tensors(t)
            b, q = tensor.Buffer(), tensor.Quantization()
            if tensor.Type() != schema.TensorType.INT8 or b in done or b not in regions or not q:
                continue
            done.add(b)
            r = regions[b]
            a = np.frombuffer(data, np.int8, r.length, r.offset).astype(np.float32)
            new = np.clip(np.round(a * factor), -127, 127).astype(np.int8)
            data[r.offset : r.end] = new.tobytes()
            slot = q._tab.Offset(8)  # QuantizationParameters.scale
            if slot:
                start, n = q._tab.Vector(slot), q._tab.VectorLen(slot)
                scales = np.frombuffer(data, np.float32, n, start) / factor
                data[start : start + 4 * n] = scales.astype(np.float32).tobytes()
    out.write_bytes(data)
    return f"{len(done)} int8 weight tensors requantized, scales / {factor}"


def retokenize(base: Path, out: Path, seed: int) -> str:
    from sentencepiece import sentencepiece_model_pb2

    spm: Any = sentencepiece_model_pb2  # generated protobuf code: no types to check against

    rng = np.random.default_rng(seed)
    proto = spm.ModelProto()
    proto.ParseFromString(base.read_bytes())
    normal = [p for p in proto.pieces if p.type == spm.ModelProto.SentencePiece.NORMAL]
    for i, piece in enumerate(rng.choice(len(normal), 16, replace=False)):
        normal[piece].piece = f"▁update_{i}"
    rescored = rng.choice(len(normal), len(normal) // 20, replace=False)
    for i in rescored:
        normal[i].score += float(rng.normal(0, 1.0))
    out.write_bytes(proto.SerializeToString())
    return f"16 of {len(normal)} pieces replaced, {len(rescored)} scores changed"


def make_updates(work: Path) -> list[tuple[Update, str]]:
    demo = demo_model_dir()
    int8 = demo / "model_int8.tflite"
    out = []
    new = work / "finetune10.tflite"
    out.append(
        (Update("fine-tune 10% of tensors", int8, new), fine_tune(int8, new, 0.10, False, 0))
    )
    new = work / "finetune_last.tflite"
    out.append((Update("fine-tune last layer", int8, new), fine_tune(int8, new, 0, True, 1)))
    out.append(
        (
            Update("re-quantization int8 -> int4", int8, demo / "model_int4_block32.tflite"),
            "the demo's int4 block32 file from its int8 file",
        )
    )
    new = work / "recalibrated.tflite"
    out.append((Update("re-calibration (all scales)", int8, new), recalibrate(int8, new)))
    new = work / "tokenizer.model"
    note = retokenize(demo / "tokenizer.model", new, 2)
    out.append((Update("tokenizer change", demo / "tokenizer.model", new), note))
    return out


# ----------------------------------------------------------------------------- tools


def _child(tool: str, base: Path, patch: Path, out: Path) -> tuple[float, float]:
    res = subprocess.run(
        [sys.executable, "-c", CHILD, tool, str(base), str(patch), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return doc["seconds"], doc["rss_kib"] / 1024


def _zstd(args: list[str]) -> tuple[float, float]:
    """Run the zstd CLI under /usr/bin/time (a child forked from this big process would count
    this process's pages in its own peak RSS)."""
    start = time.perf_counter()
    res = subprocess.run(
        [TIME, "-f", "%M", ZSTD, "-q", "-f", *args], capture_output=True, text=True, check=True
    )
    seconds = time.perf_counter() - start
    return seconds, int(res.stderr.strip().splitlines()[-1]) / 1024


def measure(u: Update, work: Path, rounds: int) -> dict[str, Any]:
    target_sha, size = sha256_file(u.new), u.new.stat().st_size
    row: dict[str, Any] = {"update": u.name, "target_bytes": size}
    tag = u.new.stem

    def applied(tool: str, run: Any, out: Path) -> dict[str, float]:
        times, rss = [], []
        for _ in range(rounds):
            out.unlink(missing_ok=True)
            t, m = run()
            times.append(t)
            rss.append(m)
            if sha256_file(out) != target_sha:
                raise RuntimeError(f"{tool} rebuilt {u.name} wrongly")
        return {"apply_s": statistics.median(times), "apply_rss_mib": max(rss)}

    # ours
    ours = work / f"{tag}.ea-delta"
    start = time.perf_counter()
    stats = diff_file(u.base, u.new, ours)
    row["ours"] = {"bytes": stats.delta_bytes, "diff_s": time.perf_counter() - start}
    out = work / f"{tag}.ours.out"
    row["ours"] |= applied("ours", lambda: _child("ours", u.base, ours, out), out)
    row["ours"]["ops"] = {
        "copied": stats.copied_bytes,
        "data": stats.data_bytes,
        "patched": stats.patched_bytes,
    }

    # bsdiff4
    bsd = work / f"{tag}.bsdiff"
    start = time.perf_counter()
    bsdiff4.file_diff(str(u.base), str(u.new), str(bsd))
    row["bsdiff4"] = {"bytes": bsd.stat().st_size, "diff_s": time.perf_counter() - start}
    out = work / f"{tag}.bsdiff.out"
    row["bsdiff4"] |= applied("bsdiff4", lambda: _child("bsdiff4", u.base, bsd, out), out)

    # zstd --patch-from, a window covering base and target
    long = max(10, (u.base.stat().st_size + size).bit_length())
    zd = work / f"{tag}.zst"
    t, m = _zstd(["-19", f"--long={long}", f"--patch-from={u.base}", str(u.new), "-o", str(zd)])
    row["zstd"] = {"bytes": zd.stat().st_size, "diff_s": t, "diff_rss_mib": m}
    out = work / f"{tag}.zstd.out"
    row["zstd"] |= applied(
        "zstd",
        lambda: _zstd(["-d", f"--long={long}", f"--patch-from={u.base}", str(zd), "-o", str(out)]),
        out,
    )

    # the whole target compressed: what an update without any delta costs
    full = work / f"{tag}.full.zst"
    _zstd(["-19", str(u.new), "-o", str(full)])
    row["zstd_full_bytes"] = full.stat().st_size
    return row


# ----------------------------------------------------------------------------- report


def _pct(n: int, size: int) -> str:
    return f"{n / size:.2%}"


def render(rows: list[dict[str, Any]], notes: list[str], rss_note: str) -> str:
    tools = (("ours", "ea-delta-1"), ("bsdiff4", "bsdiff4"), ("zstd", "zstd --patch-from"))
    lines = [
        "Delta size, as a share of the target file (smaller is better); `zstd -19` is the whole "
        "target compressed, i.e. no delta at all.",
        "",
        "| update | target | " + " | ".join(label for _, label in tools) + " | zstd -19 |",
        "|---|---:|" + "---:|" * (len(tools) + 1),
    ]
    for r in rows:
        size = r["target_bytes"]
        cells = [f"{r[t]['bytes']:,} B ({_pct(r[t]['bytes'], size)})" for t, _ in tools]
        full = f"{r['zstd_full_bytes']:,} B ({_pct(r['zstd_full_bytes'], size)})"
        lines.append(
            f"| {r['update']} | {size / MIB:.2f} MiB | " + " | ".join(cells) + f" | {full} |"
        )
    lines += [
        "",
        "Making and applying (median of the rounds; apply peak RSS: " + rss_note + ").",
        "",
        "| update | tool | make (s) | apply (s) | apply peak RSS (MiB) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        for t, label in tools:
            x = r[t]
            lines.append(
                f"| {r['update']} | {label} | {x['diff_s']:.2f} | {x['apply_s']:.3f} | "
                f"{x['apply_rss_mib']:.1f} |"
            )
    lines += ["", "Updates:", ""]
    lines += [f"* {r['update']}: {note}" for r, note in zip(rows, notes, strict=True)]
    return "\n".join(lines)


def write_doc(body: str) -> None:
    text = DOC.read_text() if DOC.exists() else "# Update deltas\n"
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch docs/")
    args = ap.parse_args()
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as d:
        work = Path(d)
        for update, note in make_updates(work):
            print(f"== {update.name}: {note}", file=sys.stderr)
            rows.append(measure(update, work, args.rounds))
            notes.append(note)
    finetune = rows[0]
    share = finetune["ours"]["bytes"] / finetune["target_bytes"]
    verdict = "met" if share <= GOAL else "NOT met"
    rss_note = (
        "Python tools in a fresh interpreter, the peak (VmHWM, reset after imports) above the "
        "RSS before applying; the zstd CLI, the whole process's peak"
    )
    body = render(rows, notes, rss_note)
    body += (
        f"\n\nGoal: a fine-tune touching 10% of the tensors costs at most ~{GOAL:.0%} of the "
        f"model. Measured: {share:.2%} — {verdict}.\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores, Python "
        f"{sys.version.split()[0]}, zstd CLI {_zstd_version()}, bsdiff4 {bsdiff4.__version__}; "
        f"ours at zstd level 19."
    )
    print(body)
    if not args.no_write:
        write_doc(body)
    return 0


def _zstd_version() -> str:
    out = subprocess.run([ZSTD, "--version"], capture_output=True, text=True).stdout
    return out.split("v")[-1].split(",")[0].strip() if "v" in out else "?"


if __name__ == "__main__":
    sys.exit(main())
