"""Inline a model's ``STABLEHLO_COMPOSITE`` ops into the graphs that call them.

A fused export wraps small patterns in composites (``odml.rms_norm``: 61 of them in a
SmolLM-shaped decode graph) that keep their decomposition in a subgraph. XNNPACK cannot take
a composite, so every one splits the delegated graph: measured here, the decode step of the
SmolLM-shaped int8 model costs 6–10% more than with the same ops unfused (docs/PERFORMANCE.md).
LiteRT-LM inlines composites when it compiles (a runtime option ai-edge-litert's Python API
does not expose); this does the same to the file: each composite op is replaced by its
decomposition's ops, its inputs and outputs wired to the caller's tensors, and the
decomposition subgraphs are dropped. Weights are untouched: a large model's buffers live after
the flatbuffer (offset/size), and are copied as one block with their offsets shifted.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from agent.errors import ModelFormatError
from agent.runtime.schema import schema

log = logging.getLogger(__name__)

_ALIGN = 4096  # the weight block moves by a multiple of this: buffer alignment is kept


def _ids(v: Any) -> list[int]:
    """A tensor-index vector of the object API (None, a list or a numpy array) as ints."""
    return [] if v is None else [int(x) for x in v]


def _composite_code(model: Any) -> set[int]:
    code = schema.BuiltinOperator.STABLEHLO_COMPOSITE
    return {
        i
        for i, oc in enumerate(model.operatorCodes or [])
        if max(oc.builtinCode, oc.deprecatedBuiltinCode) == code
    }


def _inline_one(model: Any, sg: Any, op: Any) -> list[Any] | None:
    """The decomposition's ops wired into `sg` in place of `op`; None if it cannot be."""
    opts = op.builtinOptions2
    index = getattr(opts, "decompositionSubgraphIndex", -1)
    if not 0 <= index < len(model.subgraphs):
        return None
    dec = model.subgraphs[index]
    d_in, d_out = _ids(dec.inputs), _ids(dec.outputs)
    o_in, o_out = _ids(op.inputs), _ids(op.outputs)
    if len(d_in) != len(o_in) or len(d_out) != len(o_out):
        return None
    if set(d_in) & set(d_out):  # an output that is an input needs a copy op: leave it
        return None
    mapping = dict(zip(d_in, o_in, strict=True))
    mapping.update(zip(d_out, o_out, strict=True))
    ops = []
    for dop in dec.operators or []:
        new = copy.copy(dop)
        for field in ("inputs", "outputs", "intermediates"):
            if getattr(dop, field) is None:
                continue
            remapped = []
            for t in _ids(getattr(dop, field)):
                if t >= 0 and t not in mapping:
                    sg.tensors.append(copy.deepcopy(dec.tensors[t]))
                    mapping[t] = len(sg.tensors) - 1
                remapped.append(mapping[t] if t >= 0 else t)
            setattr(new, field, remapped)
        ops.append(new)
    return ops


def inline_model(data: bytes) -> tuple[bytes, int]:
    """The model `data` with its composites inlined, and how many were; (data, 0) if none."""
    model = schema.ModelT.InitFromPackedBuf(data, 0)
    codes = _composite_code(model)
    if not codes:
        return data, 0
    signature_subgraphs = {s.subgraphIndex for s in model.signatureDefs or []}
    inlined = 0
    dropped: set[int] = set()
    for i in sorted(signature_subgraphs):
        sg = model.subgraphs[i]
        out = []
        for op in sg.operators or []:
            ops = _inline_one(model, sg, op) if op.opcodeIndex in codes else None
            if ops is None:
                out.append(op)
                continue
            out.extend(ops)
            inlined += 1
            dropped.add(op.builtinOptions2.decompositionSubgraphIndex)
        sg.operators = out
    still_used = {
        op.builtinOptions2.decompositionSubgraphIndex
        for sg in model.subgraphs
        for op in sg.operators or []
        if op.opcodeIndex in codes
    }
    dropped -= still_used | signature_subgraphs
    kept = len(model.subgraphs) - len(dropped)
    if dropped and min(dropped) >= kept:  # only trailing subgraphs go: no index changes
        model.subgraphs = model.subgraphs[:kept]
    return _pack(model, data), inlined


def _pack(model: Any, data: bytes) -> bytes:
    """Serialize `model`; buffers stored after the flatbuffer move with their bytes."""
    import flatbuffers

    outside = [b for b in model.buffers or [] if b.offset > 1]
    start = min((b.offset for b in outside), default=len(data))

    def build() -> bytes:
        builder = flatbuffers.Builder(1024)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())

    head = build()
    if not outside:
        return head
    # offsets are absolute: shift them by a multiple of _ALIGN past the new flatbuffer (their
    # uint64 fields are present either way, so the second build has the same size)
    shift = -(-(len(head) - start) // _ALIGN) * _ALIGN
    for b in outside:
        b.offset += shift
    head = build()
    if len(head) > start + shift:
        raise ModelFormatError("inlining composites: the rewritten graph overlaps the weights")
    return head + b"\0" * (start + shift - len(head)) + data[start:]


def inline_file(src: Path, dst: Path) -> int:
    """Write `src` with its composites inlined to `dst` (atomically); how many were inlined."""
    data = Path(src).read_bytes()
    out, n = inline_model(data)
    tmp = Path(dst).with_name(Path(dst).name + ".tmp")
    tmp.write_bytes(out)
    tmp.replace(dst)
    log.info("composites inlined: %d in %s -> %s", n, Path(src).name, dst)
    return n
