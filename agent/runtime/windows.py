"""Give a single-length export KV windows at load time: its ``decode`` graph, one
``prefill_<N>`` graph (two in a window of 512 rows or more: `agent.runtime.layout.window_prefills`)
and its verify graphs cloned over shorter KV lengths, sharing every weight.

A file exported with windows (`agent.toolchain.export`, ``decode_windows``) holds
``kv<W>_decode`` and ``kv<W>_prefill_<N>`` beside the full-length signatures, and the runtime
runs each cache in the smallest window that holds it: decode attention reads W rows instead of
the whole KV length (docs/PERFORMANCE.md). Compared op by op, the converter's window graphs
differ from the full-length ones only in the KV length L (SmolLM-135M shape, KV 1024 against
256, decode and prefill): in tensor shapes, in the int32 shape operands of RESHAPE, and in the
positional constant our export builds its causal mask from (an ``arange`` over the L positions,
whose window copy holds the first W). Everything else, weights included, is the same. So a
window is the full-length graph with L replaced by W in those places.

Where L cannot be told apart from another quantity, the rewrite refuses rather than guesses:
a quantized weight with a dimension equal to L (a model dimension that happens to equal the
KV length), a long integer constant holding the value L, or an op that calls another graph
(control flow, a composite left in place). Other constants with a dimension L are taken for
positional tables (an ``arange``, a causal-mask cache, RoPE tables) and cut to their first W
entries; a float weight taken for one by mistake makes a wrong graph, which the runtime's
check on the first load finds (`RunnerBase.check_windows` compares every new signature with
the full length) before the windows are used.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from agent.errors import ModelFormatError
from agent.runtime.layout import window_prefills
from agent.runtime.schema import schema

SHAPE_OPERAND_MAX: Final = 8  # an int32 constant this short holding L is a shape operand
_PREFILL = re.compile(r"^prefill(?:_(\d+))?$")
_VERIFY = re.compile(r"^verify(?:_(\d+))?$")
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


class WindowsRefused(ModelFormatError):
    """The graph cannot be given KV windows safely; the message says why."""


def _key(sig: Any) -> str:
    raw = sig.signatureKey
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _dims(v: Any) -> list[int]:
    return [] if v is None else [int(d) for d in v]


def _constant(model: Any, tensor: Any) -> Any | None:
    """The buffer holding a tensor's constant value, or None for a computed tensor."""
    if not 0 < tensor.buffer < len(model.buffers):
        return None
    buf = model.buffers[tensor.buffer]
    inline = buf.data is not None and len(buf.data) > 0
    return buf if inline or buf.offset > 1 else None


def _tokens(model: Any, sig: Any) -> int:
    """Tokens per call of a signature (the last dimension of its ``tokens`` input)."""
    sg = model.subgraphs[sig.subgraphIndex]
    for t in sig.inputs or []:
        name = t.name.decode() if isinstance(t.name, bytes) else t.name
        if name == "tokens":
            shape = _dims(sg.tensors[t.tensorIndex].shape)
            return shape[-1] if shape else 1
    raise WindowsRefused(f"signature {_key(sig)} has no tokens input")


def _window_constant(
    t: Any,
    buf: Any,
    name: str,
    shape: list[int],
    length: int,
    window: int,
    read: Reader,
) -> bytes | None:
    """A constant's value in window `window`, or None when it stays as it is: a positional
    table (an ``arange`` over the KV positions, a causal mask) is cut to its first `window`
    entries along each axis of length `length`; a short integer shape operand has the value
    `length` replaced by `window`."""
    dtype = _DTYPES.get(t.type)
    if length not in shape and t.type not in _INTEGER:
        return None  # read nothing: most constants are weights, stored after the graph
    raw = bytes(bytearray(buf.data)) if buf.offset <= 1 else read(buf.offset, buf.size)
    if length in shape:
        q = t.quantization
        if dtype is None or (q is not None and q.scale is not None and len(q.scale)):
            raise WindowsRefused(
                f"weight {name} {shape} has a dimension equal to the KV length {length}"
            )
        value: np.ndarray[Any, Any] = np.frombuffer(raw, dtype=dtype).reshape(shape)
        cut = tuple(slice(0, window) if d == length else slice(None) for d in shape)
        return np.ascontiguousarray(value[cut]).tobytes()
    values: np.ndarray[Any, Any] = np.frombuffer(raw, dtype=_DTYPES[t.type])
    if length not in values:
        return None
    if values.size > SHAPE_OPERAND_MAX:
        raise WindowsRefused(
            f"integer constant {name} ({values.size} values) holds the KV length {length}"
        )
    return np.where(values == length, window, values).astype(values.dtype).tobytes()


def _copy_graph(source: Any) -> Any:
    """A copy of a subgraph that `_clone` may change: new tensor and operator objects (and
    builtin options), sharing everything `_clone` only reassigns or never touches (names,
    quantization tables, operand lists). A deep copy also copied every weight's quantization
    tables, a third of a rewrite's time (measured)."""
    sg = copy.copy(source)
    sg.tensors = [copy.copy(t) for t in source.tensors]
    sg.operators = [copy.copy(op) for op in source.operators or []]
    for op in sg.operators:
        if op.builtinOptions is not None:
            op.builtinOptions = copy.copy(op.builtinOptions)
    return sg


def _clone(
    model: Any, index: int, length: int, window: int, shared: dict[bytes, int], read: Reader
) -> Any:
    """Subgraph `index` with KV length `length` replaced by `window`; new shape constants go
    to `model.buffers` (one buffer per distinct value, kept in `shared`)."""
    source = model.subgraphs[index]
    sg = _copy_graph(source)
    for t in sg.tensors:
        name = t.name.decode(errors="replace") if isinstance(t.name, bytes) else str(t.name)
        shape = _dims(t.shape)
        buf = _constant(model, t)
        if buf is not None:
            data = _window_constant(t, buf, name, shape, length, window, read)
            if data is not None:
                if data not in shared:
                    new = schema.BufferT()
                    new.data = np.frombuffer(data, dtype=np.uint8).copy()
                    model.buffers.append(new)
                    shared[data] = len(model.buffers) - 1
                t.buffer = shared[data]
        t.shape = [window if d == length else d for d in shape]
        if t.shapeSignature is not None:
            t.shapeSignature = [window if d == length else d for d in _dims(t.shapeSignature)]
    for op in sg.operators or []:
        code = model.operatorCodes[op.opcodeIndex]
        if max(code.builtinCode, code.deprecatedBuiltinCode) in _CALLS:
            raise WindowsRefused(f"subgraph {index} calls another graph (op {code.builtinCode})")
        opts = op.builtinOptions
        for attr, value in (vars(opts) if opts is not None else {}).items():
            if attr.endswith("SubgraphIndex"):
                raise WindowsRefused(f"subgraph {index} calls another graph ({attr})")
            if isinstance(value, (list, np.ndarray)) and length in _dims(value):
                setattr(opts, attr, [window if d == length else d for d in _dims(value)])
    sg.name = f"kv{window}_".encode() + (source.name or b"")
    return sg


def add_windows(model: Any, length: int, windows: tuple[int, ...], read: Reader) -> tuple[int, ...]:
    """Add ``kv<W>_decode``, ``kv<W>_prefill_<N>`` (N from `window_prefills`) and a
    ``kv<W>_verify_<N>`` for each verify signature shorter than W to `model` (the
    flatbuffer object API) for each W in `windows`; the windows added. `read` returns the bytes of a
    buffer stored after the flatbuffer (a large model's). Raises `WindowsRefused` (nothing
    changed) when the graph cannot be rewritten safely."""
    windows = tuple(sorted(w for w in windows if 1 < w < length))
    if not windows:
        return ()
    sigs = {_key(s): s for s in model.signatureDefs or []}
    if "decode" not in sigs:
        raise WindowsRefused("no decode signature")
    if any(k.startswith("kv") for k in sigs):
        raise WindowsRefused("the file already has KV windows")
    prefill = {k: _tokens(model, s) for k, s in sigs.items() if _PREFILL.match(k)}
    verify = {k: _tokens(model, s) for k, s in sigs.items() if _VERIFY.match(k)}
    subgraphs, buffers = list(model.subgraphs), list(model.buffers)
    added: list[Any] = []
    shared: dict[bytes, int] = {}
    try:
        for w in windows:
            lengths = window_prefills(prefill.values(), w)
            chosen = [sorted(k for k, m in prefill.items() if m == n)[0] for n in lengths]
            fits = sorted(k for k, m in verify.items() if m < w)  # every verify length
            for key in ("decode", *chosen, *fits):
                sig = copy.deepcopy(sigs[key])
                model.subgraphs.append(
                    _clone(model, sigs[key].subgraphIndex, length, w, shared, read)
                )
                sig.subgraphIndex = len(model.subgraphs) - 1
                sig.signatureKey = f"kv{w}_{key}".encode()
                added.append(sig)
    except WindowsRefused:
        model.subgraphs, model.buffers = subgraphs, buffers
        raise
    model.signatureDefs = [*model.signatureDefs, *added]
    return windows
