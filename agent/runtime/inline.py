"""Prepare a model file for XNNPACK: inline its ``STABLEHLO_COMPOSITE`` ops into the graphs
that call them, and add KV windows (`agent.runtime.windows`).

A fused export wraps small patterns in composites (``odml.rms_norm``: 61 of them in a
SmolLM-shaped decode graph) that keep their decomposition in a subgraph. XNNPACK cannot take
a composite, so every one splits the delegated graph: measured here, the decode step of the
SmolLM-shaped int8 model costs 6–10% more than with the same ops unfused (docs/PERFORMANCE.md).
LiteRT-LM inlines composites when it compiles (a runtime option ai-edge-litert's Python API
does not expose); this does the same to the file: each composite op is replaced by its
decomposition's ops, its inputs and outputs wired to the caller's tensors, and the
decomposition subgraphs are dropped. Weights are untouched: a large model's buffers live after
the flatbuffer (offset/size), and are copied as one block with their offsets shifted.

Not every composite is inlined: XNNPACK runs ``odml.scaled_dot_product_attention`` itself (it
does not split the graph), and its decomposition is not always what the composite means.
litert-torch exports it for one KV head in the default KV layout with K's transpose folded into
a RESHAPE (``[1, kv, 1, d] -> [1, 1, d, kv]``), which reorders nothing: the decomposition is
then off by up to 9.3 in the logits from the second position on, while XNNPACK running the
composite matches the float torch model (measured here; docs/PERFORMANCE.md). Inlining it would
make the copy compute something else, so it stays a composite (`KEPT_COMPOSITES`); every copy
is also checked against the original file on its first load (`agent.runtime.check`).
"""

from __future__ import annotations

import copy
import logging
import mmap
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import flatbuffers

from agent.runtime.memory import give_back_memory
from agent.runtime.schema import schema

log = logging.getLogger(__name__)

_BUFFER_OFFSET_FIELD = 6  # vtable slot of Buffer.offset (fields: data, offset, size)
_ALIGN = 4096  # the weight block moves by a multiple of this: buffer alignment is kept
_CHUNK = 1 << 20  # bytes per read when the weights are copied


def _ids(v: Any) -> list[int]:
    """A tensor-index vector of the object API (None, a list or a numpy array) as ints."""
    return [] if v is None else [int(x) for x in v]


# Composites XNNPACK runs itself: inlining them buys nothing and their decompositions are not
# always exact (see the module docstring).
KEPT_COMPOSITES = frozenset({"odml.scaled_dot_product_attention"})


def _composite_name(op: Any) -> str:
    name = getattr(op.builtinOptions2, "name", b"")
    return name.decode() if isinstance(name, bytes) else str(name or "")


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


def _inline(head: bytes) -> tuple[Any, int]:
    """The model whose flatbuffer is `head`, with its composites inlined, and how many were."""
    model = schema.ModelT.InitFromPackedBuf(head, 0)
    codes = _composite_code(model)
    if not codes:
        return model, 0
    signature_subgraphs = {s.subgraphIndex for s in model.signatureDefs or []}
    inlined = 0
    dropped: set[int] = set()
    for i in sorted(signature_subgraphs):
        sg = model.subgraphs[i]
        out = []
        for op in sg.operators or []:
            inline = op.opcodeIndex in codes and _composite_name(op) not in KEPT_COMPOSITES
            ops = _inline_one(model, sg, op) if inline else None
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
    return model, inlined


class _SharedTable:
    """An object-API table that every tensor holding it points to: packed once per builder
    (a flatbuffer may reference one table from many places)."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self._packed: tuple[Any, int] | None = None

    def Pack(self, builder: Any) -> int:
        if self._packed is None or self._packed[0] is not builder:
            self._packed = (builder, self.table.Pack(builder))
        return self._packed[1]


def _content(value: Any) -> Any:
    """A hashable key for the value of an object-API field."""
    if value is None or isinstance(value, (int, float, bytes, str)):
        return value
    if hasattr(value, "tobytes"):
        return (str(value.dtype), value.tobytes())
    if isinstance(value, list):
        return tuple(_content(v) for v in value)
    return tuple((k, _content(v)) for k, v in sorted(vars(value).items()))


def _share_quantization(model: Any) -> None:
    """Make tensors with equal quantization parameters share one table. Every signature's
    graph carries its own copy of each weight's parameters (int8 per-channel: a scale and a
    zero point per output channel, ~2.3 MB per SmolLM-shaped graph); shared, the prepared
    file's graph is that much smaller, and so is what the runtime maps."""
    shared: dict[Any, _SharedTable] = {}
    for sg in model.subgraphs or []:
        for t in sg.tensors or []:
            q = t.quantization
            if q is None or isinstance(q, _SharedTable):
                continue
            t.quantization = shared.setdefault(_content(q), _SharedTable(q))


def _write_packed(model: Any, start: int, out: BinaryIO) -> None:
    """Serialize `model` to `out`, padded so that the weights stored after the old flatbuffer
    (from byte `start` of the file, addressed by absolute offsets) can follow it unchanged:
    their offsets are shifted by a multiple of `_ALIGN`, which keeps every buffer's alignment.
    The builder's bytes are written as they are, not copied (a SmolLM-shaped int8 graph with
    KV windows is ~8 MB with shared tables, 36 MB without)."""
    outside = [b for b in model.buffers or [] if b.offset > 1]

    _share_quantization(model)

    class Builder(flatbuffers.Builder):  # type: ignore[misc]
        """Writes each distinct string once (tensor names repeat in every signature's graph)."""

        def __init__(self, size: int) -> None:
            super().__init__(size)
            self.strings: dict[Any, int] = {}

        def CreateString(self, s: Any, encoding: str = "utf-8", errors: str = "strict") -> int:
            if s not in self.strings:
                self.strings[s] = super().CreateString(s, encoding, errors)
            return self.strings[s]

    def build() -> memoryview:
        builder = Builder(1024)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return memoryview(builder.Bytes)[builder.Head() :]

    head = build()
    if not outside:
        out.write(head)
        return
    shift = -(-(len(head) - start) // _ALIGN) * _ALIGN
    _shift_offsets(head, shift)
    out.write(head)
    out.write(b"\0" * (start + shift - len(head)))


def _shift_offsets(head: memoryview, shift: int) -> None:
    """Add `shift` to the offset of every buffer stored outside the flatbuffer `head`, in
    place: the uint64 fields are there already (an offset > 1 is never the default), so the
    graph does not have to be built a second time (half of a rewrite's time, measured)."""
    root = schema.Model.GetRootAs(head, 0)
    for i in range(root.BuffersLength()):
        tab = root.Buffers(i)._tab
        field = tab.Offset(_BUFFER_OFFSET_FIELD)
        if not field:
            continue
        offset = struct.unpack_from("<Q", head, tab.Pos + field)[0]
        if offset > 1:
            struct.pack_into("<Q", head, tab.Pos + field, offset + shift)


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
    windows: tuple[int, ...]  # KV windows added (`agent.runtime.windows`)
    refused: str | None = None  # why windows that were asked for were not added

    @property
    def changed(self) -> bool:
        return bool(self.inlined or self.windows)


def prepare_file(
    src: Path, dst: Path, windows: tuple[int, ...] = (), kv_length: int = 0
) -> Prepared:
    """Write `src` with its composites inlined and KV windows `windows` added (for a KV length
    of `kv_length`) to `dst`, atomically; nothing is written when nothing changes.

    Only the flatbuffer is read into memory and rebuilt; the weights after it are copied from
    file to file in chunks, so a large model's first load does not hold it in memory twice.
    """
    from agent.runtime.windows import WindowsRefused, add_windows

    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        start = _flatbuffer_end(view)
        model, n = _inline(bytes(view[:start]))
        refused = None

        def read(offset: int, size: int) -> bytes:
            return bytes(view[offset : offset + size])

        try:
            added = add_windows(model, kv_length, windows, read) if windows else ()
        except WindowsRefused as exc:
            added, refused = (), str(exc)
            log.warning("KV windows not added to %s: %s", Path(src).name, exc)
        done = Prepared(n, added, refused)
        if done.changed:
            tmp = Path(dst).with_name(Path(dst).name + ".tmp")
            with open(tmp, "wb") as out:
                _write_packed(model, start, out)
                f.seek(start)
                shutil.copyfileobj(f, out, _CHUNK)
            tmp.replace(dst)
    del model
    give_back_memory()
    log.info(
        "model prepared: %d composites inlined, KV windows %s in %s -> %s",
        n,
        list(added) or "none",
        Path(src).name,
        dst if done.changed else "(unchanged)",
    )
    return done
