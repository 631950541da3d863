"""Give a single-length export KV windows at load time: its decode, prefill and verify graphs
cloned over shorter KV lengths, sharing every weight, so that a cache runs in the smallest
window that holds it. The rewrite refuses where the KV length cannot be told apart from
another quantity (`add_windows`).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from agent.base.errors import ModelFormatError
from agent.model.tflite.fbread import I8, U8, U32, ints, scalar, table
from agent.model.tflite.layout import window_prefills
from agent.model.tflite.schema import schema
from agent.runtime.prepare.overlay import Graph, Old, Overlay

SHAPE_OPERAND_MAX: Final = 8  # an int32 constant this short holding L is a shape operand
_PREFILL = re.compile(r"^prefill(?:_(\d+))?$")
_VERIFY = re.compile(r"^verify(?:_(\d+))?$")
_BATCH = re.compile(r"^decode_batch_\d+$")  # batched decode (`agent.runtime.batch`)
_T = schema.TensorType
_INTEGER: Final = frozenset({_T.INT32, _T.INT64})
_DTYPES: Final = {
    _T.FLOAT32: np.float32,
    _T.FLOAT16: np.float16,
    _T.INT32: np.int32,
    _T.INT64: np.int64,
    _T.INT8: np.int8,
    _T.UINT8: np.uint8,
    _T.BOOL: np.bool_,
}
Reader = Callable[[int, int], bytes]  # (offset, size) -> bytes of a buffer stored after the graph
_CALLS: Final = frozenset(
    getattr(schema.BuiltinOperator, name, -1)
    for name in ("WHILE", "IF", "CALL", "CALL_ONCE", "STABLEHLO_COMPOSITE", "STABLEHLO_WHILE")
)


_OPTION_NAMES: Final = {v: k for k, v in vars(schema.BuiltinOptions).items() if isinstance(v, int)}


class WindowsRefused(ModelFormatError):
    """The graph cannot be given KV windows safely; the message says why."""


def _key(raw: bytes | None) -> str:
    return raw.decode() if raw else ""


def _dims(v: Any) -> list[int]:
    return [] if v is None else [int(d) for d in v]


@dataclass(frozen=True, slots=True)
class _Tensor:
    """What a window needs of one tensor of the graph it clones."""

    shape: list[int]
    signature: list[int] | None  # its shape signature
    type: int
    buffer: int
    ref: Any  # the tensor: `Old` or object-API
    ov: Overlay

    @property
    def name(self) -> str:
        if isinstance(self.ref, Old):
            at = table(self.ov.buf, self.ref.pos, 3)
            return (
                bytes(self.ov.buf[at + 4 : at + 4 + U32.unpack_from(self.ov.buf, at)[0]]).decode(
                    errors="replace"
                )
                if at
                else ""
            )
        raw = self.ref.name
        return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")

    @property
    def quantized(self) -> bool:
        """It has quantization scales."""
        if isinstance(self.ref, Old):
            q = table(self.ov.buf, self.ref.pos, 4)
            return bool(q) and bool(ints(self.ov.buf, q, 2))
        q = self.ref.quantization
        return q is not None and q.scale is not None and len(q.scale) > 0


def _tensor(ov: Overlay, ref: Any) -> _Tensor:
    if isinstance(ref, Old):  # read from the bytes: ~28,000 tensors in a SmolLM-shaped model
        buf, pos = ov.buf, ref.pos
        sig = ints(buf, pos, 7) if table(buf, pos, 7) else None
        return _Tensor(
            ints(buf, pos, 0), sig, scalar(buf, pos, 1, I8), scalar(buf, pos, 2, U32), ref, ov
        )
    sig = None if ref.shapeSignature is None else _dims(ref.shapeSignature)
    return _Tensor(_dims(ref.shape), sig, ref.type, ref.buffer, ref, ov)


def _constant(ov: Overlay, b: int, read: Reader) -> Callable[[], bytes] | None:
    """The bytes of a tensor's constant value (read when called), or None for a computed
    tensor."""
    if not 0 < b < len(ov.buffers):
        return None
    buf = ov.buffers[b]
    if isinstance(buf, Old):
        view = schema.Buffer()
        view.Init(ov.buf, buf.pos)
        if view.DataLength() > 0:
            return lambda: bytes(view.DataAsNumpy().tobytes())
        offset, size = view.Offset(), view.Size()
        return (lambda: read(offset, size)) if offset > 1 else None
    if buf.data is not None and len(buf.data) > 0:
        return lambda: bytes(bytearray(buf.data))
    return None


def _tokens(ov: Overlay, index: int) -> int:
    """Tokens per call of signature `index` (the last dimension of its ``tokens`` input)."""
    sig = ov.signature(index)
    sg = ov.graph(sig.subgraphIndex)
    for t in sig.inputs or []:
        if _key(t.name) == "tokens":
            shape = _tensor(ov, sg.tensors[t.tensorIndex]).shape
            return shape[-1] if shape else 1
    raise WindowsRefused(f"signature {_key(sig.signatureKey)} has no tokens input")


def _window_constant(
    t: _Tensor, raw: Callable[[], bytes], length: int, window: int
) -> bytes | None:
    """A constant's value in window `window`, or None when it stays as it is: a positional
    table (an ``arange`` over the KV positions, a causal mask) is cut to its first `window`
    entries along each axis of length `length`; a short integer shape operand has the value
    `length` replaced by `window`."""
    dtype, shape, name = _DTYPES.get(t.type), t.shape, t.name
    if length not in shape and t.type not in _INTEGER:
        return None  # read nothing: most constants are weights, stored after the graph
    data = raw()
    if length in shape:
        if dtype is None or t.quantized:
            raise WindowsRefused(
                f"weight {name} {shape} has a dimension equal to the KV length {length}"
            )
        value: np.ndarray[Any, Any] = np.frombuffer(data, dtype=dtype).reshape(shape)
        cut = tuple(slice(0, window) if d == length else slice(None) for d in shape)
        return np.ascontiguousarray(value[cut]).tobytes()
    values: np.ndarray[Any, Any] = np.frombuffer(data, dtype=_DTYPES[t.type])
    if length not in values:
        return None
    if values.size > SHAPE_OPERAND_MAX:
        raise WindowsRefused(
            f"integer constant {name} ({values.size} values) holds the KV length {length}"
        )
    return np.where(values == length, window, values).astype(values.dtype).tobytes()


@functools.cache
def _options(kind: int) -> tuple[str | None, bool]:
    """For a builtin options type: the field naming a graph it calls (or None), and whether
    it has vector fields (which may hold L)."""
    name = _OPTION_NAMES.get(kind)
    if name is None or kind == 0:
        return None, False
    fields = vars(getattr(schema, f"{name}T")())
    calls = next((f for f in fields if f.endswith("SubgraphIndex")), None)
    return calls, any(m.endswith("Length") for m in dir(getattr(schema, name)))


def _window_op(ov: Overlay, ref: Any, index: int, length: int, window: int) -> Any:
    """Operator `ref` of subgraph `index` in window `window`: itself, or a copy whose options
    have L replaced."""
    if isinstance(ref, Old):
        code_index = scalar(ov.buf, ref.pos, 0, U32)
        kind = scalar(ov.buf, ref.pos, 3, U8)
    else:
        code_index, kind = ref.opcodeIndex, ref.builtinOptionsType
    builtin = ov.codes[code_index]
    if builtin in _CALLS:
        raise WindowsRefused(f"subgraph {index} calls another graph (op {builtin})")
    calls, vectors = _options(kind)
    if calls is not None:
        raise WindowsRefused(f"subgraph {index} calls another graph ({calls})")
    if not vectors:
        return ref
    if isinstance(ref, Old):
        new = schema.OperatorT.InitFromBuf(ov.buf, ref.pos)
    else:
        new = copy.copy(ref)
        new.builtinOptions = copy.copy(ref.builtinOptions)
    opts = new.builtinOptions
    changed = False
    for attr, value in (vars(opts) if opts is not None else {}).items():
        if isinstance(value, (list, np.ndarray)) and length in _dims(value):
            setattr(opts, attr, [window if d == length else d for d in _dims(value)])
            changed = True
    return new if changed else ref


def _clone(
    ov: Overlay, index: int, length: int, window: int, shared: dict[bytes, int], read: Reader
) -> Graph:
    """Subgraph `index` with KV length `length` replaced by `window`: its unchanged tensors
    and operators are the same tables; new shape constants go to `ov.buffers` (one buffer per
    distinct value, kept in `shared`)."""
    source = ov.graph(index)
    tensors: list[Any] = []
    for ref in source.tensors:
        t = _tensor(ov, ref)
        buffer = None
        raw = _constant(ov, t.buffer, read)
        if raw is not None:
            data = _window_constant(t, raw, length, window)
            if data is not None:
                if data not in shared:
                    new = schema.BufferT()
                    new.data = np.frombuffer(data, dtype=np.uint8).copy()
                    ov.buffers.append(new)
                    shared[data] = len(ov.buffers) - 1
                buffer = shared[data]
        sig = t.signature
        if buffer is None and length not in t.shape and (sig is None or length not in sig):
            tensors.append(ref)  # the same table
            continue
        c = schema.TensorT.InitFromBuf(ov.buf, ref.pos) if isinstance(ref, Old) else copy.copy(ref)
        c.shape = [window if d == length else d for d in t.shape]
        if sig is not None:
            c.shapeSignature = [window if d == length else d for d in sig]
        if buffer is not None:
            c.buffer = buffer
        tensors.append(c)
    ops = [_window_op(ov, ref, index, length, window) for ref in source.operators]
    name = f"kv{window}_".encode() + (source.name or b"")
    return Graph(
        tensors, ops, list(source.inputs), list(source.outputs), name, source.debug_metadata_index
    )


def add_windows(
    ov: Overlay, length: int, windows: tuple[int, ...], read: Reader
) -> tuple[int, ...]:
    """Add ``kv<W>_decode``, ``kv<W>_prefill_<N>`` (N from `window_prefills`), a
    ``kv<W>_verify_<N>`` for each verify signature shorter than W and a ``kv<W>_decode_batch_<B>``
    for each batched decode signature to `ov` (the copy being
    prepared, `agent.runtime.prepare.overlay`) for each W in `windows`; the windows added. `read`
    returns the bytes of a buffer stored after the flatbuffer (a large model's). Raises
    `WindowsRefused` (nothing changed) when the graph cannot be rewritten safely.

    A file exported with windows (`agent.toolchain.export`, ``decode_windows``) holds
    ``kv<W>_decode`` and ``kv<W>_prefill_<N>`` beside the full-length signatures, and the runtime
    runs each cache in the smallest window that holds it: decode attention reads W rows instead of
    the whole KV length (docs/PERFORMANCE.md). Compared op by op, the converter's window graphs
    differ from the full-length ones only in the KV length L (SmolLM-135M shape, KV 1024 against
    256, decode and prefill): in tensor shapes, in the int32 shape operands of RESHAPE, and in the
    positional constant our export builds its causal mask from (an ``arange`` over the L positions,
    whose window copy holds the first W). Everything else, weights included, is the same. So a
    window is the full-length graph with L replaced by W in those places.

    Where L cannot be told apart from another quantity, the rewrite refuses rather than guesses: a
    quantized weight with a dimension equal to L (a model dimension that happens to equal the KV
    length), a long integer constant holding the value L, or an op that calls another graph (control
    flow, a composite left in place). Other constants with a dimension L are taken for positional
    tables (an ``arange``, a causal-mask cache, RoPE tables) and cut to their first W entries; a
    float weight taken for one by mistake makes a wrong graph, which the runtime's check on the
    first load finds (`RunnerBase.check_windows` compares every new signature with the full length)
    before the windows are used.
    """
    windows = tuple(sorted(w for w in windows if 1 < w < length))
    if not windows:
        return ()
    sigs = {_key(ov.signature(i).signatureKey): i for i in range(len(ov.signatures))}
    if "decode" not in sigs:
        raise WindowsRefused("no decode signature")
    if any(k.startswith("kv") for k in sigs):
        raise WindowsRefused("the file already has KV windows")
    prefill = {k: _tokens(ov, i) for k, i in sigs.items() if _PREFILL.match(k)}
    verify = {k: _tokens(ov, i) for k, i in sigs.items() if _VERIFY.match(k)}
    batch = sorted(k for k in sigs if _BATCH.match(k))
    subgraphs, buffers = list(ov.subgraphs), list(ov.buffers)
    added: list[Any] = []
    shared: dict[bytes, int] = {}
    try:
        for w in windows:
            lengths = window_prefills(prefill.values(), w)
            chosen = [sorted(k for k, m in prefill.items() if m == n)[0] for n in lengths]
            fits = sorted(k for k, m in verify.items() if m < w)  # every verify length
            for key in ("decode", *chosen, *fits, *batch):
                sig = ov.signature(sigs[key])  # a copy
                ov.subgraphs.append(_clone(ov, sig.subgraphIndex, length, w, shared, read))
                sig.subgraphIndex = len(ov.subgraphs) - 1
                sig.signatureKey = f"kv{w}_{key}".encode()
                added.append(sig)
    except WindowsRefused:
        ov.subgraphs, ov.buffers = subgraphs, buffers
        raise
    ov.signatures = [*ov.signatures, *added]
    return windows
