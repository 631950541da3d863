"""A prepared copy written as an overlay on the original flatbuffer's bytes (`Overlay`): a small
new flatbuffer holding only the tables that changed, pointing forward into the original's
unchanged bytes, so that nothing but what changes is unpacked into Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, BinaryIO, Final

import flatbuffers
import numpy as np

from agent.base.errors import ModelFormatError
from agent.model.tflite import fbread
from agent.model.tflite.fbread import U64, ints, tables
from agent.model.tflite.schema import schema

ALIGN: Final = 4096  # the weights move by a multiple of this: every buffer's alignment is kept
_HEAD_ALIGN: Final = 16  # the original's bytes start at a multiple of this in the copy
_BUFFER_OFFSET_SLOT: Final = 1  # Buffer fields: data, offset, size


class Old:
    """An unchanged table of the original, referenced where it is: packing it writes nothing
    and returns its place relative to the end of the new flatbuffer, which the original's bytes
    follow."""

    __slots__ = ("pos",)

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def Pack(self, builder: Any) -> int:
        return -self.pos


def operator(buf: Any, pos: int) -> Any:
    """An object-API copy of the operator at `pos` whose options are the original's tables
    (`Old`): only its operand lists are new, for the caller to change."""
    v = schema.Operator()
    v.Init(buf, pos)
    new = schema.OperatorT()
    new.opcodeIndex = v.OpcodeIndex()
    new.inputs = v.InputsAsNumpy().tolist() if v.InputsLength() else None
    new.outputs = v.OutputsAsNumpy().tolist() if v.OutputsLength() else None
    new.builtinOptionsType = v.BuiltinOptionsType()
    new.builtinOptions = Old(at) if (at := fbread.table(buf, pos, 4)) else None
    if v.CustomOptionsLength():
        new.customOptions = np.array(v.CustomOptionsAsNumpy(), dtype=np.uint8)
    new.customOptionsFormat = v.CustomOptionsFormat()
    if v.MutatingVariableInputsLength():
        new.mutatingVariableInputs = v.MutatingVariableInputsAsNumpy().tolist()
    new.intermediates = v.IntermediatesAsNumpy().tolist() if v.IntermediatesLength() else None
    new.largeCustomOptionsOffset = v.LargeCustomOptionsOffset()
    new.largeCustomOptionsSize = v.LargeCustomOptionsSize()
    new.builtinOptions2Type = v.BuiltinOptions2Type()
    new.builtinOptions2 = Old(at) if (at := fbread.table(buf, pos, 12)) else None
    new.debugMetadataIndex = v.DebugMetadataIndex()
    return new


@dataclass(slots=True)
class Graph:
    """A graph of the copy: its tensors and operators are `Old` tables or object-API ones."""

    tensors: list[Any]
    operators: list[Any]
    inputs: list[int]
    outputs: list[int]
    name: bytes
    debug_metadata_index: int = -1

    def Pack(self, builder: Any) -> int:
        tensors = vector(builder, self.tensors)
        operators = vector(builder, self.operators)
        inputs = builder.CreateNumpyVector(np.asarray(self.inputs, dtype=np.int32))
        outputs = builder.CreateNumpyVector(np.asarray(self.outputs, dtype=np.int32))
        name = builder.CreateString(self.name)
        schema.SubGraphStart(builder)
        schema.SubGraphAddTensors(builder, tensors)
        schema.SubGraphAddInputs(builder, inputs)
        schema.SubGraphAddOutputs(builder, outputs)
        schema.SubGraphAddOperators(builder, operators)
        schema.SubGraphAddName(builder, name)
        schema.SubGraphAddDebugMetadataIndex(builder, self.debug_metadata_index)
        return int(schema.SubGraphEnd(builder))


def vector(builder: Any, items: list[Any]) -> int:
    """A vector of tables: the new ones are packed first, then every reference is written in
    one block (a graph lists thousands of tensors, most of them `Old`)."""
    offsets = np.array([item.Pack(builder) for item in items], dtype=np.int64)
    n = len(offsets)
    builder.StartVector(4, n, 4)  # room for the n offsets, aligned: no padding among them
    # element k is written at `Offset() + 4 * (n - k)` bytes from the end; a uoffset is the
    # distance from where it is written to the table (at `offset` bytes from the end)
    at = builder.Offset() + 4 * (n - np.arange(n, dtype=np.int64))
    rel = at - offsets
    if n and (rel.min() <= 0 or rel.max() >= 1 << 32):
        raise ModelFormatError("a flatbuffer offset out of range")
    builder.head -= 4 * n
    builder.Bytes[builder.head : builder.head + 4 * n] = rel.astype("<u4").tobytes()
    return int(builder.EndVector())


@dataclass(slots=True)
class Overlay:
    """The model being prepared: the original's bytes (`buf`, its flatbuffer up to `end`) and
    what the copy lists instead of the original's vectors.

    The copy the CPU path runs (`agent.runtime.prepare.inline`, `agent.runtime.prepare.windows`)
    changes a few tables of a model and adds some: the signature graphs get new operator lists, KV
    windows add graphs in which a few hundred tensors have new shapes. Everything else (the other
    tensors, their quantization tables, names, operator options, buffers, the decomposition graphs)
    is the same. So the copy is the original flatbuffer, unchanged, after a small new one: a new
    root table, the graphs and vectors that changed, and the new tables, whose references to
    unchanged tables point forward into the original's bytes (flatbuffer offsets are relative, so
    the original's tables stay valid wherever its bytes start). Nothing is unpacked into Python
    objects but what changes (unpacking and re-serialising the whole graph is a large part of a
    first load: docs/PERFORMANCE.md, "Notes from the code"). The weights a large model stores
    after its flatbuffer follow, their absolute offsets shifted by a multiple of `ALIGN`.
    """

    buf: Any
    end: int
    root: schema.Model
    subgraphs: list[Any]  # `Old` (unchanged) or `Graph`
    buffers: list[Any]  # `Old` or `schema.BufferT` (new, data inside the flatbuffer)
    signatures: list[Any]  # `Old` or `schema.SignatureDefT`
    old_buffers: list[int] = field(default_factory=list)  # the original's Buffer tables
    codes: list[int] = field(default_factory=list)  # builtin operator of each opcode index

    @classmethod
    def open(cls, buf: Any, end: int) -> Overlay:
        root = schema.Model.GetRootAs(buf, 0)
        pos = root._tab.Pos
        if root.ExternalBufferGroupsLength() or root.ExternalBuffersLength():
            raise ModelFormatError("the model has external buffer groups")
        buffers = tables(buf, pos, 4)
        codes = [root.OperatorCodes(i) for i in range(root.OperatorCodesLength())]
        return cls(
            buf,
            end,
            root,
            [Old(p) for p in tables(buf, pos, 2)],
            [Old(p) for p in buffers],
            [Old(p) for p in tables(buf, pos, 7)],
            buffers,
            [max(c.BuiltinCode(), c.DeprecatedBuiltinCode()) for c in codes],
        )

    def graph(self, index: int) -> Graph:
        """Subgraph `index` as a `Graph` the caller may change (its lists are new)."""
        sg = self.subgraphs[index]
        if isinstance(sg, Graph):
            return sg
        view = schema.SubGraph()
        view.Init(self.buf, sg.pos)
        return Graph(
            [Old(p) for p in tables(self.buf, sg.pos, 0)],
            [Old(p) for p in tables(self.buf, sg.pos, 3)],
            ints(self.buf, sg.pos, 1),
            ints(self.buf, sg.pos, 2),
            view.Name() or b"",
            view.DebugMetadataIndex(),
        )

    def signature(self, index: int) -> schema.SignatureDefT:
        """Signature `index` as a new object-API table (a copy)."""
        sig = self.signatures[index]
        if isinstance(sig, Old):
            return schema.SignatureDefT.InitFromBuf(self.buf, sig.pos)
        return sig

    def write(self, out: BinaryIO) -> int:
        """Write the copy's flatbuffer and then the original's; the shift of the weights stored
        after it (the caller copies them from byte `end` of the original)."""
        root, buf = self.root, self.buf
        builder = flatbuffers.Builder(1 << 20)
        builder.Prep(_HEAD_ALIGN, 0)  # the builder aligns from its end: start the original there
        pos = root._tab.Pos
        codes = vector(builder, [Old(p) for p in tables(buf, pos, 1)])
        subgraphs = vector(builder, self.subgraphs)
        buffers = vector(builder, self.buffers)
        signatures = vector(builder, self.signatures)
        metadata = vector(builder, [Old(p) for p in tables(buf, pos, 6)])
        meta_buffers = builder.CreateNumpyVector(np.asarray(ints(buf, pos, 5), dtype=np.int32))
        text = root.Description()
        description = builder.CreateString(text) if text is not None else None
        schema.ModelStart(builder)
        schema.ModelAddVersion(builder, root.Version())
        schema.ModelAddOperatorCodes(builder, codes)
        schema.ModelAddSubgraphs(builder, subgraphs)
        if description is not None:
            schema.ModelAddDescription(builder, description)
        schema.ModelAddBuffers(builder, buffers)
        schema.ModelAddMetadataBuffer(builder, meta_buffers)
        schema.ModelAddMetadata(builder, metadata)
        schema.ModelAddSignatureDefs(builder, signatures)
        builder.Finish(schema.ModelEnd(builder), file_identifier=b"TFL3")
        head = memoryview(builder.Bytes)[builder.Head() :]
        if len(head) % _HEAD_ALIGN:
            raise ModelFormatError(f"overlay head of {len(head)} bytes is not aligned")
        outside = [  # the offset fields of the buffers stored after the flatbuffer
            at
            for pos in self.old_buffers
            if (at := fbread.field(buf, pos, _BUFFER_OFFSET_SLOT))
            and U64.unpack_from(buf, at)[0] > 1
        ]
        pad = -len(head) % ALIGN if outside else 0
        shift = len(head) + pad
        old = bytearray(buf[: self.end])
        for at in outside:  # the weights after the flatbuffer move by `shift`
            U64.pack_into(old, at, U64.unpack_from(old, at)[0] + shift)
        out.write(head)
        out.write(old)
        out.write(b"\0" * pad)
        return shift
