#!/usr/bin/env python3
"""The kernel ceiling of a decode step: XNNPACK's quantized FULLY_CONNECTED kernels alone.

A `.tflite` holding only the weight matrices of SmolLM-135M as our export writes them (per
layer qkv 576->960: q, k and v in one matrix; o 576->576, gate and up 576->1536, down
1536->576; 30 layers; lm head 576->49152: 151 FULLY_CONNECTED ops, as in the model's decode
graph), chained at batch 1 with the slices, one CONCATENATION and two ADDs per layer and
nothing else: no attention, no KV cache, no norms. Converted with litert-torch, quantized with
the toolchain's own `quantize_bytes` (int8 per channel, int4 block 32: the weights of our
LLMs), run through ai-edge-litert's CompiledModel on the XNNPACK CPU path exactly as
`_CompiledRunner` does.
Reports ms per pass and the weight bytes streamed per second, next to the measured read
bandwidth (`scripts/peer/roofline.py`'s `read_bandwidth`) in the same run.

Models are built once (no lock) into .cache/models/gemv/; timing holds an exclusive flock on
/tmp/bench.lock and alternates quantizations and thread counts within every round.

    python scripts/bench_gemv.py [--threads 2 --threads 1] [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts._report import fmt, med, write_section  # noqa: E402

GEMV_DIR = ROOT / ".cache" / "models" / "gemv"
RESULT = ROOT / "docs" / "bench" / "gemv.json"
LOCK = Path("/tmp/bench.lock")
QUANTS = ("int8", "int4_block32")
DIM = 576
Q, KV = 576, 192  # q's and each of k's and v's outputs
LAYER_SHAPES = {  # name: (in, out), as in SmolLM-135M exported by the toolchain
    "qkv": (576, Q + 2 * KV),
    "o": (576, 576),
    "gate": (576, 1536),
    "up": (576, 1536),
    "down": (1536, 576),
}
LAYERS = 30
VOCAB = 49152
SEED = 0
WARMUP = 10
RUNS_PER_BATCH = 50
RETRY_PAUSE_S = 10.0


# ----------------------------------------------------------------------------- build


def _chain_module(layers: int) -> Any:
    """The torch module: per layer ``q, k, v = qkv(x)``, ``x = o(q + cat(k, v, k))``, then
    ``x = down(gate(x) + up(x))``; ``logits = head(x)``. Every weight is used once."""
    import torch
    from torch import nn

    def linear(shape: tuple[int, int], summed: bool) -> nn.Linear:
        fan_in, fan_out = shape
        lin = nn.Linear(fan_in, fan_out, bias=False)
        # unit-variance activations through the chain (two summed branches: half each)
        std = (fan_in * (2 if summed else 1)) ** -0.5
        with torch.no_grad():
            lin.weight.normal_(0.0, std)
        return lin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.ModuleDict(
                {n: linear(s, summed=n not in ("o", "down")) for n, s in LAYER_SHAPES.items()}
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.w
            q, k, v = w["qkv"](x).split([Q, KV, KV], dim=-1)
            x = w["o"](q + torch.cat([k, v, k], dim=-1))
            return w["down"](w["gate"](x) + w["up"](x))  # type: ignore[no-any-return]

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = linear((DIM, VOCAB), summed=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)  # type: ignore[no-any-return]

    torch.manual_seed(SEED)
    return Chain().eval()


def param_count(layers: int = LAYERS) -> int:
    per_layer = sum(i * o for i, o in LAYER_SHAPES.values())
    return layers * per_layer + DIM * VOCAB


def _install_toolchain_shim() -> None:
    """Importing `agent.toolchain` puts the tensorflow stand-in litert-torch needs on the path."""
    from agent import toolchain  # noqa: F401


def _convert_fp32(out: Path, layers: int) -> Path:
    """The float `.tflite` (cached): litert-torch's conversion of the chain."""
    if out.exists():
        return out
    _install_toolchain_shim()
    import litert_torch
    import torch

    t0 = time.monotonic()
    model = _chain_module(layers)
    edge = litert_torch.convert(model, (torch.zeros(1, DIM, dtype=torch.float32),))
    _write_atomic(out, edge.model_content())
    print(f"[gemv] converted {out.name}: {out.stat().st_size / 1e6:.1f} MB "
          f"in {time.monotonic() - t0:.1f}s", flush=True)  # fmt: skip
    return out


def _write_atomic(out: Path, data: bytes) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)


def model_path(quant: str, out_dir: Path, layers: int = LAYERS) -> Path:
    return out_dir / f"gemv_qkv_l{layers}_{quant}.tflite"


def build(quant: str, out_dir: Path, layers: int = LAYERS) -> Path:
    """The `quant` variant of the GEMV chain in `out_dir` (built once, then cached)."""
    out = model_path(quant, out_dir, layers)
    if out.exists():
        return out
    from agent.toolchain.quantize import quantize_bytes

    fp32 = _convert_fp32(out_dir / f"gemv_qkv_l{layers}_fp32.tflite", layers)
    t0 = time.monotonic()
    _write_atomic(out, quantize_bytes(fp32.read_bytes(), quant))
    print(f"[gemv] quantized {out.name}: {out.stat().st_size / 1e6:.1f} MB "
          f"in {time.monotonic() - t0:.1f}s", flush=True)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- inspect


def _block_scales(sg: Any, tensor: Any) -> tuple[int, int, str] | None:
    """(scale count, block size, scale dtype) of a blockwise-quantized weight, else None.
    ai-edge-quantizer writes block scales as a separate [out, in/block] tensor."""
    from agent.runtime.schema import schema

    q = tensor.Quantization()
    kind = getattr(schema.QuantizationDetails, "BlockwiseQuantization", None)
    if q is None or kind is None or q.DetailsType() != kind:
        return None
    table = q.Details()
    details = schema.BlockwiseQuantization()
    details.Init(table.Bytes, table.Pos)
    st = sg.Tensors(details.Scales())
    dtype = {v: k for k, v in vars(schema.TensorType).items() if isinstance(v, int)}[st.Type()]
    return int(np.prod(st.ShapeAsNumpy())), details.BlockSize(), dtype.lower()


def inspect_model(path: Path) -> dict[str, Any]:
    """Op counts and the bytes of the FULLY_CONNECTED weights, read from the file's tensors.

    ``weight_bytes``: the quantized weight tensors (int8: 1 byte a parameter; int4: 2 a byte)
    plus, for blockwise weights, 2 bytes per block scale (the file holds them as an fp16
    tensor [out, in/32]; XNNPACK's blockwise kernels read 16-bit scales too). Per-channel
    scales (int8: one fp32 per output channel, ~0.6% more) are not counted, as in the
    roofline of bench_peer (`scripts/peer/roofline.py`).
    """
    from agent.runtime.modelfile import read_model_file
    from agent.runtime.schema import schema

    info = read_model_file(path)
    model = schema.Model.GetRootAs(path.read_bytes(), 0)
    tensor_bytes = params = scales = 0
    kinds: set[str] = set()
    for s in range(model.SubgraphsLength()):
        sg = model.Subgraphs(s)
        for o in range(sg.OperatorsLength()):
            op = sg.Operators(o)
            code = model.OperatorCodes(op.OpcodeIndex())
            opcode = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
            if opcode != schema.BuiltinOperator.FULLY_CONNECTED:
                continue
            t = sg.Tensors(op.Inputs(1))
            n = int(np.prod(t.ShapeAsNumpy()))
            bits = {schema.TensorType.INT4: 4, schema.TensorType.INT8: 8}.get(t.Type(), 32)
            params += n
            tensor_bytes += n * bits // 8
            block = _block_scales(sg, t)
            if block is not None:
                scales += block[0]
                kinds.add(f"int{bits} block{block[1]}, {block[2]} scales")
            else:
                q = t.Quantization()
                per_channel = q is not None and q.ScaleLength() > 1
                kinds.add(f"int{bits} per-channel" if per_channel else f"{bits}-bit")
    return {
        "ops": dict(info.op_counts),
        "params": params,
        "weight_kinds": sorted(kinds),
        "weight_tensor_bytes": tensor_bytes,
        "block_scales": scales,
        "weight_bytes": tensor_bytes + 2 * scales,
        "file_bytes": info.size,
    }


# ----------------------------------------------------------------------------- measure


def _weight_cache(path: Path) -> str:
    """An XNNPACK weight cache file for this build of `path` (the option takes a file)."""
    directory = GEMV_DIR / "xnnpack"
    directory.mkdir(parents=True, exist_ok=True)
    st = path.stat()
    return str(directory / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}.xnnpack_cache")


def _load(path: Path, threads: int) -> Any:
    """A CompiledModel on the XNNPACK CPU path, opened as `_CompiledRunner` opens one."""
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_kernel_mode import CpuKernelMode
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.hardware_accelerator import HardwareAccelerator
    from ai_edge_litert.options import Options

    cpu = CpuOptions(
        num_threads=threads,
        kernel_mode=CpuKernelMode.XNNPACK,
        xnnpack_weight_cache_path=_weight_cache(path),
    )
    options = Options(hardware_accelerators=HardwareAccelerator.CPU, cpu_options=cpu)
    return CompiledModel.from_file(str(path), options=options)


def delegation(path: Path) -> dict[str, Any]:
    """How XNNPACK partitions the graph. CompiledModel logs no partitions, so the classic
    Interpreter (same XNNPACK delegate, applied by default) is asked: the number of DELEGATE
    nodes it added, and whether one of them reads the graph input and writes the graph output
    (in a chain, that means every op in between is inside it)."""
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=str(path), num_threads=1)
    it.allocate_tensors()
    ops = it._get_ops_details()  # no public API lists the delegate nodes
    delegates = [o for o in ops if o["op_name"] == "DELEGATE"]
    graph_in = {d["index"] for d in it.get_input_details()}
    graph_out = {d["index"] for d in it.get_output_details()}
    whole = any(
        graph_in <= set(d["inputs"].tolist()) and graph_out <= set(d["outputs"].tolist())
        for d in delegates
    )
    model = _load(path, 1)
    try:
        fully = bool(model.is_fully_accelerated())
    finally:
        model.close()
    return {
        "graph_ops": len(ops) - len(delegates),
        "delegate_nodes": len(delegates),
        "one_partition_input_to_output": whole,
        "compiled_model_fully_accelerated": fully,
    }


class CpuMeter:
    """CPU time used by other processes (in cores) while inside: /proc/stat's busy time minus
    this process's. A GEMV stream on 2 cores loses its second core to anything else running."""

    def __enter__(self) -> CpuMeter:
        self._busy, self._own, self._t = _busy_seconds(), _own_seconds(), time.monotonic()
        self.foreign_cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._t
        foreign = (_busy_seconds() - self._busy) - (_own_seconds() - self._own)
        self.foreign_cores = max(foreign, 0.0) / wall if wall > 0 else 0.0


def _busy_seconds() -> float:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def measure(path: Path, threads: int, repeats: int, runs: int = RUNS_PER_BATCH) -> dict[str, Any]:
    """Median ms per pass over `repeats` batches of `runs` passes (after `WARMUP` passes), the
    weight bytes streamed per second, and the other processes' CPU use meanwhile."""
    model = _load(path, threads)
    try:
        inputs = model.create_input_buffers(0)
        outputs = model.create_output_buffers(0)
        x = np.random.default_rng(SEED).standard_normal((1, DIM)).astype(np.float32)
        inputs[0].write(x)
        for _ in range(WARMUP):
            model.run_by_index(0, inputs, outputs)
        batches = []
        with CpuMeter() as meter:
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(runs):
                    model.run_by_index(0, inputs, outputs)
                batches.append((time.perf_counter() - t0) / runs * 1e3)
        logits = outputs[0].read(VOCAB, np.float32)
    finally:
        model.close()
    ms = statistics.median(batches)
    weight_bytes = inspect_model(path)["weight_bytes"]
    return {
        "ms": ms,
        "ms_batches": batches,
        "gbps": weight_bytes / (ms * 1e-3) / 1e9,
        "weight_bytes": weight_bytes,
        # what XNNPACK packed them into (weights, scales, per-channel sums): what it streams
        "xnnpack_packed_bytes": Path(_weight_cache(path)).stat().st_size,
        "foreign_cores": meter.foreign_cores,
        "finite_output": bool(np.isfinite(logits).all()),
    }


# ----------------------------------------------------------------------------- main


@contextlib.contextmanager
def bench_lock(path: Path = LOCK) -> Iterator[None]:
    """Exclusive flock (the one `flock /tmp/bench.lock ...` takes) while timing."""
    with open(path, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.monotonic() - t0
        if waited > 1:
            print(f"[gemv] waited {waited:.0f}s for {path}", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _quiet(
    run: Callable[[], dict[str, Any]], max_foreign: float, retries: int, label: str
) -> dict[str, Any]:
    """`run()` again (after a pause) while other processes used more than `max_foreign` cores
    during it, at most `retries` more times; the last result, with its attempt count."""
    for attempt in range(retries + 1):
        res = run()
        res["attempts"] = attempt + 1
        if res["foreign_cores"] <= max_foreign:
            break
        if attempt < retries:
            print(f"  ({label}: other processes used {res['foreign_cores']:.2f} cores; again)")
            time.sleep(RETRY_PAUSE_S)
    return res


def _bandwidth(threads: int) -> dict[str, Any]:
    from scripts.peer.roofline import read_bandwidth

    with CpuMeter() as meter:
        gbps = read_bandwidth(threads)
    return {"gbps": gbps, "foreign_cores": meter.foreign_cores}


def run_rounds(
    paths: dict[str, Path], threads: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """`args.rounds` rounds; in each, every (quant, threads) cell and the read bandwidth per
    thread count, the order alternating between rounds; contended measurements are retried."""
    cells: dict[str, list[dict[str, Any]]] = {}
    bandwidth: dict[str, list[dict[str, Any]]] = {}
    order = [(q, t) for q in paths for t in threads]
    for r in range(args.rounds):
        print(f"[gemv] round {r + 1}/{args.rounds}", flush=True)
        for q, t in order if r % 2 == 0 else order[::-1]:
            res = _quiet(
                functools.partial(measure, paths[q], t, args.repeats),
                args.max_foreign,
                args.retries,
                f"{q} {t}t",
            )
            cells.setdefault(f"{q}/{t}", []).append(res)
            print(
                f"  {q} {t}t: {res['ms']:.2f} ms, {res['gbps']:.2f} GB/s "
                f"(other processes: {res['foreign_cores']:.2f} cores)",
                flush=True,
            )
        for t in threads if r % 2 == 0 else threads[::-1]:
            bw = _quiet(
                functools.partial(_bandwidth, t), args.max_foreign, args.retries, f"bandwidth {t}t"
            )
            bandwidth.setdefault(str(t), []).append(bw)
            print(
                f"  read bandwidth {t}t: {bw['gbps']:.2f} GB/s "
                f"(other processes: {bw['foreign_cores']:.2f} cores)",
                flush=True,
            )
    return {"cells": cells, "bandwidth": bandwidth}


def _clean(results: list[dict[str, Any]], max_foreign: float) -> list[dict[str, Any]]:
    """The results measured without contention; all of them if none was."""
    quiet = [r for r in results if r["foreign_cores"] <= max_foreign]
    return quiet or results


def summarize(
    raw: dict[str, Any], models: dict[str, dict[str, Any]], threads: list[int], max_foreign: float
) -> list[dict[str, Any]]:
    """One row per (quant, threads): medians (min, max) over the uncontended rounds."""
    rows = []
    for q, meta in models.items():
        for t in threads:
            runs = _clean(raw["cells"][f"{q}/{t}"], max_foreign)
            bws = _clean(raw["bandwidth"][str(t)], max_foreign)
            gbps = med([r["gbps"] for r in runs])
            bw = med([b["gbps"] for b in bws])
            rows.append(
                {
                    "quant": q,
                    "threads": t,
                    "weight_mb": meta["weight_bytes"] / 1e6,
                    "xnnpack_packed_mb": runs[-1]["xnnpack_packed_bytes"] / 1e6,
                    "ms": med([r["ms"] for r in runs]),
                    "gbps": gbps,
                    "bandwidth_gbps": bw,
                    "ratio": gbps["median"] / bw["median"],
                    "rounds_used": len(runs),
                    "bandwidth_rounds_used": len(bws),
                    "foreign_cores": med([r["foreign_cores"] for r in runs]),
                    "finite_output": all(r["finite_output"] for r in runs),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| quant | threads | weight MB | ms/pass | GB/s | read bandwidth GB/s "
        "| GB/s ÷ bandwidth | rounds | other CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['quant']} | {r['threads']} | {r['weight_mb']:.1f} | {fmt(r['ms'], 2)} "
            f"| {fmt(r['gbps'], 2)} | {fmt(r['bandwidth_gbps'], 2)} | {r['ratio']:.2f} "
            f"| {r['rounds_used']} | {r['foreign_cores']['median']:.2f} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, action="append", help="repeatable (default: 2 and 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help=f"batches of {RUNS_PER_BATCH} passes")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.2,
        help="retry a measurement if other processes used more CPU (cores) meanwhile",
    )
    ap.add_argument("--retries", type=int, default=6)
    ap.add_argument("--quant", action="append", choices=QUANTS, help="default: both")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--no-write", action="store_true", help=f"do not write {RESULT.name}")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    threads: list[int] = args.threads or [2, 1]
    quants: list[str] = args.quant or list(QUANTS)
    paths: dict[str, Path] = {}
    build_s: dict[str, float | None] = {}  # None: cached by an earlier run
    for q in quants:
        cached = model_path(q, GEMV_DIR, args.layers).exists()
        t0 = time.monotonic()
        paths[q] = build(q, GEMV_DIR, args.layers)
        build_s[q] = None if cached else time.monotonic() - t0
    models = {q: {**inspect_model(p), **delegation(p)} for q, p in paths.items()}
    for q, m in models.items():
        print(f"[gemv] {q}: ops {m['ops']}, weights {m['weight_kinds']}, "
              f"{m['params'] / 1e6:.1f} M params, {m['weight_bytes'] / 1e6:.1f} MB read; "
              f"XNNPACK: {m['delegate_nodes']} delegate node(s) for {m['graph_ops']} ops, "
              f"input to output in one: {m['one_partition_input_to_output']}, "
              f"CompiledModel fully accelerated: {m['compiled_model_fully_accelerated']}",
              flush=True)  # fmt: skip
    if args.build_only:
        return
    with bench_lock():
        raw = run_rounds(paths, threads, args)
    rows = summarize(raw, models, threads, args.max_foreign)
    print()
    print(table(rows))
    if not args.no_write:
        data = {
            "layers": args.layers,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "runs_per_batch": RUNS_PER_BATCH,
            "max_foreign_cores": args.max_foreign,
            "build_seconds": build_s,
            "models": {
                q: {**m, "path": str(paths[q].relative_to(ROOT))} for q, m in models.items()
            },
            "rows": rows,
            "raw": raw,
        }
        write_section("gemv", data, report(rows, args))
        print(f"wrote {RESULT.relative_to(ROOT)} and docs/PERFORMANCE.md")


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    command = "python " + " ".join(["scripts/bench_gemv.py", *sys.argv[1:]])
    return (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} CPUs: "
        f"median (min–max) of {args.rounds} alternating rounds of {args.repeats} batches of "
        f"{RUNS_PER_BATCH} passes each, a round's figures retried while other processes used "
        f"more than {args.max_foreign} cores; the read bandwidth measured in the same rounds. "
        f"Command: `{command}`.\n\n" + table(rows)
    )


if __name__ == "__main__":
    main()
