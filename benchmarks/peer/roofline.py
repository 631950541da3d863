"""The bandwidth limit of a decode step: the machine's read bandwidth, the bytes one decoded
token reads, and the decode speed they allow."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.peer.spec import ENGINES


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Sustained memory read bandwidth (GB/s): `threads` threads each OR-reducing their share of
    a buffer far larger than the caches (numpy releases the GIL in the reduction); best run."""
    import numpy as np

    data = np.ones(mib * 2**20 // 8, dtype=np.int64)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.bitwise_or.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def read_variant(model_dir: Path, quant: str) -> Any:
    """The parsed `.tflite` of one variant of a model directory (a `ModelFile`)."""
    from agent.model.directory import load_model_dir
    from agent.model.tflite.file import read_model_file

    meta = load_model_dir(model_dir)
    variant = next(v for v in meta.variants if v.quantization == quant)
    return read_model_file(meta.path_of(variant))


def bytes_per_token(model: Any, kv_rows: int) -> dict[str, float]:
    """What one decode step reads: every weight except the embedding table (one row of it is
    looked up) plus the K and V of every layer over the KV length the step attends over."""
    from agent.model.tflite.layout import discover_layout

    weights = sum(
        b for op, _kind, _n, b in model.weights if op not in ("EMBEDDING_LOOKUP", "GATHER")
    )
    kv = discover_layout(model).kv.bytes_per_token * kv_rows
    return {"weights": weights, "kv": kv, "total": weights + kv}


def decode_rows(windows: list[int], used: int) -> int:
    """The KV rows edge-agent's decode attends over with `used` rows in use: the smallest of
    its KV windows (the lengths its worker reported, the full length last) that holds them."""
    return min(w for w in windows if w >= used)


def set_ceilings(cell: dict[str, Any], gb_s: float) -> None:
    """The decode speed the read bandwidth allows for the bytes each engine reads per token,
    and the fraction of it each engine reached."""
    ceiling = cell["ceiling_tok_s"] = gb_s * 1e9 / cell["bytes_per_token"]["total"]
    if "edge_bytes_per_token" in cell:
        cell["edge_ceiling_tok_s"] = gb_s * 1e9 / cell["edge_bytes_per_token"]["total"]
    for e in ENGINES:
        if e in cell:
            own = cell.get("edge_ceiling_tok_s", ceiling) if e != "litertlm" else ceiling
            cell[e]["of_ceiling"] = cell[e]["decode_tok_s"]["median"] / own
