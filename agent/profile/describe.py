"""A profile rendered: as JSON-ready values (``profile show|list --json``) and as readable text
(``profile show``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent.base.tomltable import size_text as _size_text
from agent.profile.detect import _range_text
from agent.profile.quantization import quantization_preference
from agent.profile.schema import (
    AUTO,
    BOARD_KEYS,
    GENERATION_KEYS,
    KV_KEYS,
    MODEL_KEYS,
    RUNTIME_KEYS,
    DeviceProfile,
)


def _json_value(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


def as_json(profile: DeviceProfile) -> dict[str, object]:
    """The profile as JSON-ready values under its TOML keys (``profile show|list --json``):
    `name`, `description`, `source`, and one object per table with every key of that table,
    defaults filled in (`npu` is null without one; its `options` an object)."""
    tables: dict[str, object] = {"name": profile.name, "description": profile.description}
    tables["source"] = str(profile.source)
    for table, keys in (
        ("board", BOARD_KEYS),
        ("runtime", RUNTIME_KEYS),
        ("model", MODEL_KEYS),
        ("generation", GENERATION_KEYS),
        ("kv", KV_KEYS),
    ):
        section = getattr(profile, table)
        tables[table] = {key: _json_value(getattr(section, key)) for key in keys}
    npu = profile.npu
    tables["npu"] = (
        None
        if npu is None
        else {"kind": npu.kind, "library": npu.library, "options": dict(npu.options)}
    )
    return tables


def describe(profile: DeviceProfile) -> str:
    """A readable multi-line rendering (``edge-agent profile show``)."""
    b, r, m, g, kv = profile.board, profile.runtime, profile.model, profile.generation, profile.kv

    def row(label: str, value: object) -> str:
        return f"  {label:<22}{value}"

    def listed(items: Sequence[str]) -> str:
        return ", ".join(items) if items else "-"

    quant = m.quantization
    if quant == AUTO:
        order = quantization_preference(r.max_num_bytes, r.backend)
        quant = f"auto (tries {', '.join(order)})"
    lines = [
        f"{profile.name}: {profile.description}",
        row("source", profile.source),
        "board",
        row("device-tree model", listed(b.device_tree_model)),
        row("arch", listed(b.arch)),
        row("cpu features", listed(b.cpu_features)),
        row("RAM", _range_text(b.ram_mb_min, b.ram_mb_max, "MiB")),
        row("cores", _range_text(b.cores_min, b.cores_max, "")),
        row("NPU nodes", listed(b.npu_nodes)),
        row("priority", b.priority),
        "runtime",
        row("backend", r.backend),
        row("accelerators", " -> ".join(r.accelerators)),
        row("threads", r.num_threads),
        row("memory budget", f"{_size_text(r.max_num_bytes)} ({r.max_num_bytes} bytes)"),
        row("arena growth", r.arena_extend_strategy),
        row("require fused ops", "yes" if r.require_fused else "no"),
        row("xnnpack weight cache", r.xnnpack_weight_cache_dir or "-"),
        row("KV windows at load", "yes" if r.kv_windows else "no"),
    ]
    if profile.npu is not None:
        opts = ", ".join(f"{k}={v}" for k, v in profile.npu.options_as_strings().items())
        lines += [
            "npu",
            row("kind", profile.npu.kind),
            row("library", profile.npu.library),
            row("options", opts or "-"),
        ]
    lines += [
        "model",
        row("quantization", quant),
        row("path", m.path or "(default)"),
        "generation",
        row("max tokens", g.max_tokens),
        row("temperature", f"{g.temperature:g}" + (" (greedy)" if g.temperature == 0 else "")),
        row("top-k", g.top_k or "off"),
        row("top-p", f"{g.top_p:g}"),
        row("prefill chunk", g.prefill_chunk),
        row("speculation", g.speculation),
        "kv",
        row("host tier", _size_text(kv.host_max_bytes) if kv.host_max_bytes else "off"),
        row("disk tier", _size_text(kv.disk_max_bytes) if kv.disk_max_bytes else "off"),
        row("prefix cache", _size_text(kv.prefix_max_bytes) if kv.prefix_max_bytes else "off"),
        row("preallocate", "yes" if kv.preallocate else "no"),
    ]
    return "\n".join(line.rstrip() for line in lines)
