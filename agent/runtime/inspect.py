"""`edge-agent model inspect`: what a model file is, without running it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.errors import ModelFormatError
from agent.modeldir import METADATA_FILE, load_model_dir, sha256_file
from agent.runtime.layout import discover_layout
from agent.runtime.modelfile import read_model_file


def _file_report(path: Path, context_length: int | None) -> dict[str, Any]:
    model = read_model_file(path)
    report: dict[str, Any] = {
        "file": str(path),
        "size": model.size,
        "sha256": sha256_file(path),
        "signatures": {
            s.key: {
                "inputs": {t.name: [list(t.shape), t.dtype] for t in s.inputs},
                "outputs": {t.name: [list(t.shape), t.dtype] for t in s.outputs},
            }
            for s in model.signatures
        },
        "fused_ops": dict(model.composites),
        "ops": dict(model.op_counts),
        "weights": [
            {"op": op, "kind": kind, "tensors": n, "bytes": b} for op, kind, n, b in model.weights
        ],
        "weight_bytes": model.weight_bytes,
    }
    try:
        layout = discover_layout(model, context_length)
    except ModelFormatError as exc:
        report["llm"] = {"error": str(exc)}
        return report
    kv = layout.kv
    report["llm"] = {
        "vocab_size": layout.vocab_size,
        "context_length": kv.context_length,
        "prefill_lengths": [s.length for s in layout.prefill],
        "mask_input": layout.decode.has_mask,
        "kv_layout": kv.name,
        "kv_layers": kv.num_layers,
        "kv_k_shape": list(kv.k_shape),
        "kv_v_shape": list(kv.v_shape),
        "kv_dtype": kv.dtype,
        "kv_bytes_per_session": kv.bytes_per_session,
        "kv_bytes_per_token": kv.bytes_per_token,
    }
    return report


def inspect_report(path: Path) -> dict[str, Any]:
    """A JSON-able description of a `.tflite` file or of every variant in a model directory."""
    if path.is_dir() or path.name == METADATA_FILE:
        directory = path if path.is_dir() else path.parent
        meta = load_model_dir(directory)
        return {
            "model_dir": str(directory),
            "name": meta.name,
            "version": meta.version,
            "context_length": meta.context_length,
            "variants": [
                {
                    "quantization": v.quantization,
                    **_file_report(meta.path_of(v), meta.context_length),
                    "sha256_ok": sha256_file(meta.path_of(v)) == v.sha256,
                }
                for v in meta.variants
            ],
        }
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file")
    return _file_report(path, None)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _format_file(r: dict[str, Any]) -> list[str]:
    lines = [
        f"file        {r['file']}",
        f"size        {_mib(r['size'])}",
        f"sha256      {r['sha256']}",
    ]
    if "sha256_ok" in r:
        lines.append(f"sha256 ok   {r['sha256_ok']}")
    llm = r["llm"]
    if "error" in llm:
        lines.append(f"LLM layout  not recognised: {llm['error']}")
    else:
        lines += [
            f"vocab       {llm['vocab_size']}",
            f"context     {llm['context_length']} tokens",
            f"prefill     {llm['prefill_lengths']}   mask input: {llm['mask_input']}",
            f"KV layout   {llm['kv_layout']}: {llm['kv_layers']} layers, K {llm['kv_k_shape']} "
            f"V {llm['kv_v_shape']} {llm['kv_dtype']}",
            f"KV size     {_mib(llm['kv_bytes_per_session'])} per session "
            f"({llm['kv_bytes_per_token']} bytes per token)",
        ]
    lines.append("signatures  " + ", ".join(r["signatures"]))
    fused = r["fused_ops"]
    lines.append(
        "fused ops   " + (", ".join(f"{k} x{v}" for k, v in fused.items()) if fused else "none")
    )
    lines.append(f"weights     {_mib(r['weight_bytes'])}")
    for w in r["weights"]:
        lines.append(
            f"  {w['op']:24} {w['kind']:20} {w['tensors']:4} tensors {_mib(w['bytes']):>12}"
        )
    return lines


def format_report(report: dict[str, Any]) -> str:
    """Human-readable rendering of `inspect_report`."""
    if "variants" not in report:
        return "\n".join(_format_file(report))
    lines = [
        f"model       {report['name']} {report['version']} ({report['model_dir']})",
        f"context     {report['context_length']}",
    ]
    for v in report["variants"]:
        lines += ["", f"[{v['quantization']}]", *_format_file(v)]
    return "\n".join(lines)
