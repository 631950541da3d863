"""`edge-agent model inspect`: what a model file, model directory or `.litertlm` bundle is,
without running it (``--check``: and whether a load under a profile allows speculation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.base.errors import AgentError, ModelFormatError
from agent.model.directory import METADATA_FILE, load_model_dir, sha256_file
from agent.model.facts import context_length_of, quantization_of
from agent.model.tflite.file import read_model_file
from agent.model.tflite.info import ModelFile
from agent.model.tflite.layout import discover_layout
from agent.profile import DeviceProfile


def _file_report(
    path: Path, context_length: int | None, check: DeviceProfile | None = None
) -> dict[str, Any]:
    sha = sha256_file(path)
    report = _model_report(read_model_file(path), str(path), sha, context_length)
    llm = report["llm"]
    if check is not None and "error" not in llm and llm["verify_lengths"]:
        llm["speculation"] = speculation_check(path, check, sha, context_length)
    return report


def speculation_check(
    path: Path, profile: DeviceProfile, sha256: str, context_length: int | None
) -> dict[str, Any]:
    """Load `path` under `profile` and say whether its first-load check allows speculation
    (`agent.runtime.speccheck`; an outcome an earlier load kept in the profile's weight cache
    directory is read, not checked again)."""
    from agent.runtime import litert

    try:
        loaded = litert.load(path, profile, context_length=context_length, cache_key=sha256)
    except AgentError as exc:
        return {"allowed": False, "reason": f"the model did not load: {exc}"}
    runner = loaded.runner
    try:
        lengths = list(runner.verify_lengths)
        why = getattr(runner, "verify_problem", None)
        out: dict[str, Any] = {"allowed": bool(lengths), "accelerator": loaded.accelerator}
        out["verify_lengths"] = lengths
        if not lengths:
            out["reason"] = why or "no verify signature in the windows this load runs"
        return out
    finally:
        runner.close()


def _model_report(
    model: ModelFile, where: str, sha256: str, context_length: int | None
) -> dict[str, Any]:
    try:
        quantization = quantization_of(model)
    except ModelFormatError as exc:
        quantization = f"unknown ({exc})"
    report: dict[str, Any] = {
        "file": where,
        "size": model.size,
        "sha256": sha256,
        "quantization": quantization,
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
        "verify_lengths": [s.length for s in layout.verify],
        "verify_by_window": {str(w.length): [s.length for s in w.verify] for w in layout.windows},
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


def inspect_report(path: Path, check: DeviceProfile | None = None) -> dict[str, Any]:
    """A JSON-able description of a `.tflite` file or of every variant in a model directory;
    with `check`, each file with verify signatures is loaded under that profile to say whether
    speculation is allowed (``llm.speculation``)."""
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
                    **_file_report(meta.path_of(v), meta.context_length, check),
                    "sha256_ok": sha256_file(meta.path_of(v)) == v.sha256,
                }
                for v in meta.variants
            ],
        }
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file")
    from agent.model.litertlm.bundle import is_litertlm

    if path.suffix == ".litertlm" or is_litertlm(path):
        return _bundle_report(path)
    return _file_report(path, None, check)


def _bundle_report(path: Path) -> dict[str, Any]:
    from agent.model.litertlm.bundle import read_bundle, read_model_section, section_sha256
    from agent.model.litertlm.metadata import read_llm_metadata

    bundle = read_bundle(path)
    ignored = {s.index: why for s, why in bundle.ignored}
    roles = {bundle.model.index: "model", bundle.tokenizer.index: "tokenizer"}
    roles[bundle.metadata.index] = "metadata"
    info = read_llm_metadata(bundle)
    model = read_model_section(bundle)
    where = f"{path} (section {bundle.model.index})"
    try:  # the bundle's max tokens tell the KV layout only where its shape cannot
        context: int | None = context_length_of(model, info.max_tokens)[0]
    except ModelFormatError:
        context = None  # the layout's own error is in the report
    return {
        "litertlm": str(path),
        "size": bundle.size,
        "format": ".".join(map(str, bundle.version)),
        "system_metadata": {k: v for k, v in bundle.system},
        "sections": [
            {
                "index": s.index,
                "type": s.kind,
                "model_type": s.model_type,
                "backends": list(s.backends),
                "offset": s.begin,
                "size": s.size,
                "use": roles.get(s.index, "ignored"),
                **({"why": ignored[s.index]} if s.index in ignored else {}),
            }
            for s in bundle.sections
        ],
        "llm_metadata": {
            "model_type": info.model_type,
            "start_token": _token_json(info.start),
            "stop_tokens": [_token_json(t) for t in info.stops],
            "template": info.template_kind,
            "generation": dict(info.generation),
            "max_num_tokens": info.max_tokens,
        },
        "model": _model_report(model, where, section_sha256(path, bundle.model), context),
    }


def _token_json(ref: tuple[int, ...] | str | None) -> Any:
    return list(ref) if isinstance(ref, tuple) else ref


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
    lines.append(f"weights as  {r['quantization']}")
    llm = r["llm"]
    if "error" in llm:
        lines.append(f"LLM layout  not recognised: {llm['error']}")
    else:
        lines += [
            f"vocab       {llm['vocab_size']}",
            f"context     {llm['context_length']} tokens",
            f"prefill     {llm['prefill_lengths']}   mask input: {llm['mask_input']}",
            f"verify      {_verify_line(llm)}",
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


def _verify_line(llm: dict[str, Any]) -> str:
    """Verify lengths, per KV window when the file has windows, and the load check's outcome."""
    lengths = llm.get("verify_lengths") or []
    by_window = llm.get("verify_by_window") or {}
    if not lengths and not any(by_window.values()):
        return "none (no speculative decoding)"
    text = f"{lengths}"
    if by_window:
        text += " (" + ", ".join(f"KV {w}: {n}" for w, n in by_window.items()) + ")"
    spec = llm.get("speculation")
    if spec is not None:
        if spec["allowed"]:
            text += f"; speculation allowed on {spec['accelerator']}"
        else:
            text += f"; speculation off: {spec['reason']}"
    return text


def format_report(report: dict[str, Any]) -> str:
    """Human-readable rendering of `inspect_report`."""
    if "litertlm" in report:
        return _format_bundle(report)
    if "variants" not in report:
        return "\n".join(_format_file(report))
    lines = [
        f"model       {report['name']} {report['version']} ({report['model_dir']})",
        f"context     {report['context_length']}",
    ]
    for v in report["variants"]:
        lines += ["", f"[{v['quantization']}]", *_format_file(v)]
    return "\n".join(lines)


def _format_bundle(r: dict[str, Any]) -> str:
    md = r["llm_metadata"]
    lines = [
        f"bundle      {r['litertlm']} (.litertlm {r['format']}, {_mib(r['size'])})",
        f"LLM         {md['model_type'] or 'no model type'}; start {md['start_token']}, "
        f"stop {md['stop_tokens']}; template {md['template']}; max tokens "
        f"{md['max_num_tokens']}; sampler {md['generation'] or 'not set'}",
        "sections",
    ]
    for s in r["sections"]:
        kind = s["type"] + (f" {s['model_type']}" if s["model_type"] else "")
        if s["backends"]:
            kind += f" [{', '.join(s['backends'])}]"
        use = s["use"] + (f": {s['why']}" if "why" in s else "")
        lines.append(f"  {s['index']:2} {kind:40} {_mib(s['size']):>12}  {use}")
    lines += ["", "[model]", *_format_file(r["model"])]
    return "\n".join(lines)
