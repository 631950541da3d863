"""Prepare a model file for XNNPACK: inline its ``STABLEHLO_COMPOSITE`` ops into the graphs
that call them (each composite splits XNNPACK's delegated graph), keep the attention composite
XNNPACK runs itself, and add KV windows (`agent.runtime.prepare.windows`). Weights are copied
as one block; every copy is checked on its first load (`agent.runtime.prepare.check`).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from agent.model.tflite.fbread import U32, ints, scalar, tables
from agent.model.tflite.schema import schema
from agent.runtime.memory import give_back_memory
from agent.runtime.prepare.overlay import Graph, Old, Overlay, operator

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # bytes per read when the weights are copied


# Composites XNNPACK runs itself: inlining them buys nothing and their decompositions are not
# always exact (see the module docstring).
KEPT_COMPOSITES = frozenset({"odml.scaled_dot_product_attention"})


@dataclass(frozen=True, slots=True)
class _Composite:
    name: str
    decomposition: int  # its subgraph index


def _composite(op: schema.Operator) -> _Composite | None:
    """A composite op's name and decomposition, or None when it has none."""
    if op.BuiltinOptions2Type() != schema.BuiltinOptions2.StableHLOCompositeOptions:
        return None
    table = op.BuiltinOptions2()
    opts = schema.StableHLOCompositeOptions()
    opts.Init(table.Bytes, table.Pos)
    raw = opts.Name()
    return _Composite(raw.decode() if raw else "", opts.DecompositionSubgraphIndex())


def _composite_code(ov: Overlay) -> set[int]:
    code = schema.BuiltinOperator.STABLEHLO_COMPOSITE
    return {i for i, builtin in enumerate(ov.codes) if builtin == code}


def _op(ov: Overlay, ref: Any) -> schema.Operator | Any:
    """An operator's accessor (an `Old` table) or its object-API table."""
    if not isinstance(ref, Old):
        return ref
    op = schema.Operator()
    op.Init(ov.buf, ref.pos)
    return op


def _opcode(ov: Overlay, ref: Any) -> int:
    return scalar(ov.buf, ref.pos, 0, U32) if isinstance(ref, Old) else int(ref.opcodeIndex)


def _inline_one(ov: Overlay, sg: Graph, op: schema.Operator, comp: _Composite) -> list[Any] | None:
    """The decomposition's ops wired into `sg` in place of `op`; None if it cannot be."""
    index = comp.decomposition
    if not 0 <= index < len(ov.subgraphs) or not isinstance(ov.subgraphs[index], Old):
        return None
    dec = ov.subgraphs[index].pos
    d_in, d_out = ints(ov.buf, dec, 1), ints(ov.buf, dec, 2)
    o_in, o_out = op.InputsAsNumpy().tolist(), op.OutputsAsNumpy().tolist()
    if len(d_in) != len(o_in) or len(d_out) != len(o_out):
        return None
    if set(d_in) & set(d_out):  # an output that is an input needs a copy op: leave it
        return None
    mapping = dict(zip(d_in, o_in, strict=True))
    mapping.update(zip(d_out, o_out, strict=True))
    d_tensors = tables(ov.buf, dec, 0)
    ops = []
    for pos in tables(ov.buf, dec, 3):
        new = operator(ov.buf, pos)  # its options stay the decomposition's tables
        for name in ("inputs", "outputs", "intermediates"):
            value = getattr(new, name)
            if value is None:
                continue
            remapped = []
            for t in value:
                if t >= 0 and t not in mapping:
                    sg.tensors.append(Old(d_tensors[t]))  # a tensor table needs no copy
                    mapping[t] = len(sg.tensors) - 1
                remapped.append(mapping[t] if t >= 0 else t)
            setattr(new, name, np.array(remapped, dtype=np.int32))
        ops.append(new)
    return ops


def _inline(ov: Overlay) -> int:
    """Inline the composites of `ov`'s signature graphs; how many were."""
    root = ov.root
    codes = _composite_code(ov)
    if not codes:
        return 0
    signature_subgraphs = {
        root.SignatureDefs(i).SubgraphIndex() for i in range(root.SignatureDefsLength())
    }
    inlined = 0
    dropped: set[int] = set()
    still_used: set[int] = set()
    for i in sorted(signature_subgraphs):
        sg = ov.graph(i)
        out = []
        for ref in sg.operators:
            op = _op(ov, ref) if _opcode(ov, ref) in codes else None
            comp = _composite(op) if op is not None else None
            ops = None
            if comp is not None and comp.name not in KEPT_COMPOSITES:
                ops = _inline_one(ov, sg, op, comp)
            if comp is None or ops is None:
                out.append(ref)
                if comp is not None:
                    still_used.add(comp.decomposition)
                continue
            out.extend(ops)
            inlined += 1
            dropped.add(comp.decomposition)
        if out != sg.operators:
            sg.operators = out
            ov.subgraphs[i] = sg
    for i, ref in enumerate(ov.subgraphs):  # composites in the graphs left as they are
        if i in signature_subgraphs or not isinstance(ref, Old):
            continue
        for pos in tables(ov.buf, ref.pos, 3):
            op = _op(ov, Old(pos)) if _opcode(ov, Old(pos)) in codes else None
            comp = _composite(op) if op is not None else None
            if comp is not None:
                still_used.add(comp.decomposition)
    dropped -= still_used | signature_subgraphs
    kept = len(ov.subgraphs) - len(dropped)
    if dropped and min(dropped) >= kept:  # only trailing subgraphs go: no index changes
        ov.subgraphs = ov.subgraphs[:kept]
    return inlined


def _copy_weights(src: BinaryIO, dst: BinaryIO, start: int) -> None:
    """Copy `src` from byte `start` to the end of `dst`: in the kernel where it can
    (``copy_file_range``, which some filesystems turn into shared extents), else in chunks."""
    dst.flush()
    size = os.fstat(src.fileno()).st_size
    offset = start
    try:
        while offset < size:
            done = os.copy_file_range(src.fileno(), dst.fileno(), size - offset, offset)
            if done <= 0:
                break
            offset += done
    except (AttributeError, OSError):  # no such call here, or not between these files
        pass
    dst.seek(0, os.SEEK_END)
    src.seek(offset)
    shutil.copyfileobj(src, dst, _CHUNK)


def _flatbuffer_end(view: mmap.mmap) -> int:
    """Where a model file's flatbuffer ends: the first byte of the buffers a large model stores
    after it (offset/size), else the file's length."""
    root = schema.Model.GetRootAs(view, 0)
    starts = (root.Buffers(i).Offset() for i in range(root.BuffersLength()))
    return min((o for o in starts if o > 1), default=len(view))


@dataclass(frozen=True, slots=True)
class Prepared:
    """What `prepare_file` changed."""

    inlined: int  # composites inlined
    windows: tuple[int, ...]  # KV windows added (`agent.runtime.prepare.windows`)
    refused: str | None = None  # why windows that were asked for were not added

    @property
    def changed(self) -> bool:
        return bool(self.inlined or self.windows)


def prepare_file(
    src: Path, dst: Path, windows: tuple[int, ...] = (), kv_length: int = 0
) -> Prepared:
    """Write `src` with its composites inlined and KV windows `windows` added (for a KV length
    of `kv_length`) to `dst`, atomically; nothing is written when nothing changes.

    Only the flatbuffer is read into memory; the copy is the original flatbuffer after a new
    small one (`agent.runtime.prepare.overlay`), and the weights after it are copied from file
    to file in chunks, so a large model's first load does not hold it in memory twice.

    A fused export wraps small patterns in composites (``odml.rms_norm``, dozens of them in a
    decode graph) that keep their decomposition in a subgraph. XNNPACK cannot take a composite,
    so every one splits the delegated graph and the decode step costs more than with the same
    ops unfused (docs/PERFORMANCE.md).
    LiteRT-LM inlines composites when it compiles (a runtime option ai-edge-litert's Python API does
    not expose); this does the same to the file: each composite op is replaced by its
    decomposition's ops, its inputs and outputs wired to the caller's tensors, and the decomposition
    subgraphs are dropped. Weights are untouched: a large model's buffers live after the flatbuffer
    (offset/size), and are copied as one block with their offsets shifted.

    Not every composite is inlined: XNNPACK runs ``odml.scaled_dot_product_attention`` itself (it
    does not split the graph), and its decomposition is not always what the composite means.
    litert-torch exports it for one KV head in the default KV layout with K's transpose folded into
    a RESHAPE (``[1, kv, 1, d] -> [1, 1, d, kv]``), which reorders nothing: the decomposition is
    then far off in the logits from the second position on, while XNNPACK running the composite
    matches the float torch model (docs/PERFORMANCE.md, "Notes from the code"). Inlining it would
    make the copy compute something else, so it stays a composite (`KEPT_COMPOSITES`); every copy is
    also checked against the original file on its first load (`agent.runtime.prepare.check`).
    """
    from agent.runtime.prepare.windows import WindowsRefused, add_windows

    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        start = _flatbuffer_end(view)
        ov = Overlay.open(bytes(view[:start]), start)
        n = _inline(ov)
        refused = None

        def read(offset: int, size: int) -> bytes:
            return bytes(view[offset : offset + size])

        try:
            added = add_windows(ov, kv_length, windows, read) if windows else ()
        except WindowsRefused as exc:
            added, refused = (), str(exc)
            log.warning("KV windows not added to %s: %s", Path(src).name, exc)
        done = Prepared(n, added, refused)
        if done.changed:
            tmp = Path(dst).with_name(Path(dst).name + ".tmp")
            try:
                with open(tmp, "wb") as out:
                    ov.write(out)
                    _copy_weights(f, out, start)
                    out.flush()
                    # synced before it is named: a filesystem may commit the renames (this one
                    # and the one to the checked name) before the data, and a later load trusts
                    # the checked name
                    os.fsync(out.fileno())
                tmp.replace(dst)
            except BaseException:  # ENOSPC mid-copy: the partial copy goes, its room with it
                tmp.unlink(missing_ok=True)
                raise
    del ov
    give_back_memory()
    log.info(
        "model prepared: %d composites inlined, KV windows %s in %s -> %s",
        n,
        list(added) or "none",
        Path(src).name,
        dst if done.changed else "(unchanged)",
    )
    return done
