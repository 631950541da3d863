"""One GEMV chain file on XNNPACK: how the delegate partitions it, and ms per pass with the
other processes' CPU use meanwhile."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gemv.chain import DIM, GEMV_DIR, SEED, VOCAB
from benchmarks.gemv.weights import inspect_model

WARMUP = 10
RUNS_PER_BATCH = 50


def _weight_cache(path: Path) -> str:
    """An XNNPACK weight cache file for this build of `path` (the option takes a file)."""
    directory = GEMV_DIR / "xnnpack"
    directory.mkdir(parents=True, exist_ok=True)
    st = path.stat()
    return str(directory / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}.xnnpack_cache")


def _load(path: Path, threads: int) -> Any:
    """A CompiledModel on the XNNPACK CPU path, opened as `CompiledRunner` opens one."""
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
