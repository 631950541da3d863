"""Reading a `.tflite` flatbuffer into a `ModelFile`: LiteRT's own schema module (lazy, over
an mmap), so that inspecting a model never allocates its weights. Callers use
`agent.model.tflite.file.read_model_file`."""

from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from agent.model.tflite import fbread
from agent.model.tflite.info import ModelFile, SignatureIO, TensorInfo
from agent.model.tflite.schema import schema

_TYPE_NAMES: dict[int, str] = {
    v: k.lower() for k, v in vars(schema.TensorType).items() if isinstance(v, int)
}
_OP_NAMES: dict[int, str] = {
    v: k for k, v in vars(schema.BuiltinOperator).items() if isinstance(v, int)
}
# Constant tensors of these types are indices, shapes or masks, not weights.
_NOT_WEIGHTS = frozenset({"int32", "int64", "bool"})


def _name(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def _opcode(model: schema.Model, index: int) -> str:
    code = model.OperatorCodes(index)
    builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
    if builtin == schema.BuiltinOperator.CUSTOM:
        return "CUSTOM:" + _name(code.CustomCode())
    return _OP_NAMES.get(builtin, f"OP{builtin}")


def _weight_kind(tensor: schema.Tensor) -> str:
    dtype = _TYPE_NAMES.get(tensor.Type(), "?")
    q = tensor.Quantization()
    if q is None or dtype.startswith("float"):
        return dtype
    blockwise = getattr(schema.QuantizationDetails, "BlockwiseQuantization", None)
    if blockwise is not None and q.DetailsType() == blockwise:
        table = q.Details()
        block = schema.BlockwiseQuantization()
        block.Init(table.Bytes, table.Pos)
        return f"{dtype} block{block.BlockSize()}"
    scales = q.ScaleLength()
    if scales <= 1:
        return f"{dtype} per-tensor"
    rank = tensor.ShapeLength()
    shape = [tensor.Shape(i) for i in range(rank)]
    qdim = q.QuantizedDimension()
    # Blockwise as written by ai-edge-quantizer: several scales per channel along the other axis.
    if rank == 2 and scales > shape[qdim]:
        return f"{dtype} block{shape[1 - qdim] * shape[qdim] // scales}"
    return f"{dtype} per-channel"


@dataclass(frozen=True, slots=True)
class _Tensor:
    """What the parse needs of one tensor, read once (the generated accessors cost
    microseconds per field, and a SmolLM-shaped graph with KV windows has ~28,000 tensors)."""

    info: TensorInfo  # its name is left empty: only signature maps need names
    buffer: int
    constant: bool


@dataclass(frozen=True, slots=True)
class _Op:
    opcode: int
    inputs: list[int]
    outputs: list[int]
    pos: int  # where its table is


def parse(path: Path, data: mmap.mmap) -> ModelFile:
    # Tensors and operators are read from the bytes (`agent.model.tflite.fbread`), not through the
    # generated accessors: a SmolLM-shaped graph with KV windows has ~28,000 tensors.
    buf = data
    model = schema.Model.GetRootAs(buf, 0)
    root = model._tab.Pos
    buffer_tables = fbread.tables(buf, root, 4)
    subgraph_tables = fbread.tables(buf, root, 2)
    n_buffers = len(buffer_tables)
    filled: dict[int, bool] = {}

    def is_constant(b: int) -> bool:
        if b <= 0 or b >= n_buffers:
            return False
        if b not in filled:
            pos = buffer_tables[b]
            data_at = fbread.table(buf, pos, 0)
            has_data = bool(data_at) and fbread.U32.unpack_from(buf, data_at)[0] > 0
            filled[b] = has_data or fbread.scalar(buf, pos, 2, fbread.U64) > 0
        return filled[b]

    tables: dict[int, list[_Tensor]] = {}

    def tensors(sg_index: int) -> list[_Tensor]:
        if sg_index not in tables:
            table = []
            for pos in fbread.tables(buf, subgraph_tables[sg_index], 0):
                shape = tuple(fbread.ints(buf, pos, 0))
                dtype = _TYPE_NAMES.get(fbread.scalar(buf, pos, 1, fbread.I8), "?")
                b = fbread.scalar(buf, pos, 2, fbread.U32)
                table.append(_Tensor(TensorInfo("", shape, dtype), b, is_constant(b)))
            tables[sg_index] = table
        return tables[sg_index]

    op_tables: dict[int, list[_Op]] = {}

    def operators(sg_index: int) -> list[_Op]:
        if sg_index not in op_tables:
            op_tables[sg_index] = [
                _Op(
                    fbread.scalar(buf, pos, 0, fbread.U32),
                    fbread.ints(buf, pos, 1),
                    fbread.ints(buf, pos, 2),
                    pos,
                )
                for pos in fbread.tables(buf, subgraph_tables[sg_index], 3)
            ]
        return op_tables[sg_index]

    signatures = []
    signature_subgraphs: set[int] = set()
    for s in range(model.SignatureDefsLength()):
        sd = model.SignatureDefs(s)
        sg_index = sd.SubgraphIndex()
        signature_subgraphs.add(sg_index)
        table = tensors(sg_index)

        def io(
            maps: list[schema.TensorMap], table: list[_Tensor] = table
        ) -> tuple[TensorInfo, ...]:
            return tuple(
                TensorInfo(
                    _name(m.Name()),
                    table[m.TensorIndex()].info.shape,
                    table[m.TensorIndex()].info.dtype,
                )
                for m in maps
            )

        inputs = io([sd.Inputs(i) for i in range(sd.InputsLength())])
        outputs = io([sd.Outputs(i) for i in range(sd.OutputsLength())])
        sg_pos = subgraph_tables[sg_index]
        boundary = set(fbread.ints(buf, sg_pos, 1)) | set(fbread.ints(buf, sg_pos, 2))
        intermediate = {
            i: t.info.nbytes for i, t in enumerate(table) if i not in boundary and not t.constant
        }
        activations = _peak_live_bytes(operators(sg_index), intermediate)
        signatures.append(
            SignatureIO(_name(sd.SignatureKey()), sg_index, inputs, outputs, activations)
        )

    opcodes: dict[int, str] = {}
    ops: Counter[str] = Counter()
    composites: Counter[str] = Counter()
    weights: Counter[tuple[str, str]] = Counter()
    weight_bytes: Counter[tuple[str, str]] = Counter()
    seen_weights: set[int] = set()
    for sg_index in sorted(signature_subgraphs):
        sg = model.Subgraphs(sg_index)
        table = tensors(sg_index)
        for entry in operators(sg_index):
            code = entry.opcode
            if code not in opcodes:
                opcodes[code] = _opcode(model, code)
            name = opcodes[code]
            ops[name] += 1
            if name == "STABLEHLO_COMPOSITE":
                op = schema.Operator()
                op.Init(buf, entry.pos)
                if op.BuiltinOptions2Type() == schema.BuiltinOptions2.StableHLOCompositeOptions:
                    table2 = op.BuiltinOptions2()
                    opts = schema.StableHLOCompositeOptions()
                    opts.Init(table2.Bytes, table2.Pos)
                    composites[_name(opts.Name())] += 1
            for ti in entry.inputs:
                if ti < 0:
                    continue
                t = table[ti]
                if t.buffer in seen_weights or not t.constant or len(t.info.shape) < 2:
                    continue
                if t.info.dtype in _NOT_WEIGHTS:
                    continue
                seen_weights.add(t.buffer)
                key = (name, _weight_kind(sg.Tensors(ti)))
                weights[key] += 1
                weight_bytes[key] += t.info.nbytes
    return ModelFile(
        path=path,
        size=path.stat().st_size,
        signatures=tuple(signatures),
        op_counts=tuple(sorted(ops.items())),
        composites=tuple(sorted(composites.items())),
        weights=tuple(
            (op, kind, n, weight_bytes[(op, kind)]) for (op, kind), n in sorted(weights.items())
        ),
        weight_bytes=sum(weight_bytes.values()),
    )


def _peak_live_bytes(ops: list[_Op], sizes: dict[int, int]) -> int:
    """Largest total size of the tensors in `sizes` that are alive at the same operator, a
    tensor living from the operator that first touches it to the one that last does."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, op in enumerate(ops):
        for t in (*op.inputs, *op.outputs):
            if t in sizes:
                first.setdefault(t, k)
                last[t] = k
    delta = [0] * (len(ops) + 1)
    for t, k in first.items():
        delta[k] += sizes[t]
        delta[last[t] + 1] -= sizes[t]
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak
