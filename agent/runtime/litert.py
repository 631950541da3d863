"""The only module that imports LiteRT: load an exported LLM, bind its KV cache, run it.

Two execution paths behind one interface (`Runner`):

* ``CompiledModel`` (primary): the runtime creates each session's KV buffers once; the same
  buffer is bound as the input *and* the output of a signature, so the model updates the cache
  in place and nothing is copied per token.
* ``Interpreter`` (fallback, and the path for TFLite external delegates): the session's KV
  lives in our arrays; before a signature runs its input tensors are loaded (only when another
  session or signature wrote since), and after it runs only the rows it wrote are copied back.
  The KV cache never travels through a signature runner.

Which path and which accelerator come from the profile's ordered chain; a link that fails
falls back to the next one with one warning naming the reason.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from agent.errors import AcceleratorError, BudgetError, ModelFormatError, RuntimeFailure
from agent.profile import DeviceProfile
from agent.runtime import check
from agent.runtime.cpufeatures import aarch64_without_lse
from agent.runtime.layout import (
    ModelLayout,
    Signature,
    Window,
    auto_windows,
    discover_layout,
    window_prefill,
)
from agent.runtime.memory import give_back_memory, keep_large_buffers_mapped
from agent.runtime.modelfile import ModelFile, read_model_file

log = logging.getLogger(__name__)

Logits = npt.NDArray[np.float32]
_NEG = np.float32(-np.inf)
MIB = 1 << 20
# <weight cache dir>/<cache key> of the models this process runs, with how many runners run
# each: their files outlive loads of other models into the directory (`weight_cache_path`)
_in_use: dict[Path, int] = {}
_in_use_lock = threading.Lock()

_K = TypeVar("_K")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What loading a model costs, counted before anything is allocated."""

    weights: int  # the mapped model file
    packed_weights: int  # XNNPACK repacks weights once, into a weight cache all signatures share
    activations: int  # per signature, the peak of its intermediate tensors alive at once
    kv_per_session: int
    sessions: int  # runtime KV caches (running requests and bound sessions)
    budget: int
    spilled: int = 0  # the host KV tier and the prefix cache, at their byte budgets

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.packed_weights
            + self.activations
            + self.kv_per_session * self.sessions
            + self.spilled
        )

    def describe(self) -> str:
        text = (
            f"{self.total / MIB:.1f} MiB = weights {self.weights / MIB:.1f} + packed weights "
            f"{self.packed_weights / MIB:.1f} + activations {self.activations / MIB:.1f} + KV "
            f"{self.kv_per_session / MIB:.2f} x {self.sessions} session(s)"
        )
        if self.spilled:
            text += f" + host KV tier and prefix cache {self.spilled / MIB:.1f}"
        return text


class KVCache(Protocol):
    """One session's KV cache as the runner holds it (opaque above the runtime)."""

    @property
    def nbytes(self) -> int: ...


class Runner(Protocol):
    """What the engine needs from a runtime."""

    layout: ModelLayout
    accelerator: str

    def new_kv(self) -> KVCache: ...
    def reserve(self, kv: KVCache, rows: int, keep: int) -> None: ...
    def read_rows(self, kv: KVCache, rows: int) -> dict[str, npt.NDArray[Any]]: ...
    def write_rows(self, kv: KVCache, arrays: Mapping[str, npt.NDArray[Any]]) -> None: ...
    def prefill(self, kv: KVCache, tokens: Sequence[int], start: int) -> None: ...
    def decode(self, kv: KVCache, token: int, pos: int) -> Logits:
        """The next token's logits: the runner's own array, which its next call overwrites
        (copy it to keep it)."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- plans


@dataclass(frozen=True, slots=True)
class Call:
    """One signature call of a prefill plan: `count` real tokens padded to `signature.length`."""

    signature: Signature
    offset: int  # index into the tokens being prefilled
    count: int


# What one signature call costs beyond its tokens, in tokens: a call reads every weight once
# whatever its length (decode is bandwidth-bound), then each position costs about the same.
# SmolLM-135M shape, int8, 2 threads here: decode ~20 ms, prefill_512 ~1.2 s, so a call's fixed
# part is ~8 positions' worth. Padded positions cost like real ones.
CALL_COST_TOKENS: Final = 8


def plan_prefill(window: Window, n: int, start: int) -> list[Call]:
    """Split `n` tokens starting at position `start` into the cheapest signature calls of one
    KV window.

    A call of a signature of length L costs ``CALL_COST_TOKENS + L`` (padding included), so 63
    tokens go through two 32-token calls rather than one padded 128-token call, and a few last
    tokens through decode. A padded call must not run past the end of the cache (the model's
    DYNAMIC_UPDATE_SLICE would clamp and overwrite valid rows), so near the end only shorter
    signatures, and finally decode, qualify. Ties go to the longer signature first.
    """
    ctx = window.length
    candidates = sorted((*window.prefill, window.decode), key=lambda s: -s.length)
    # best[r]: (cost, signature of the first call) to prefill the last r of the n tokens
    none: tuple[float, Signature | None] = (float("inf"), None)
    best = [(0.0, none[1])] + [none] * n
    for r in range(1, n + 1):
        pos = start + n - r
        for sig in candidates:
            if pos + sig.length > ctx:
                continue
            cost = CALL_COST_TOKENS + sig.length + best[r - min(r, sig.length)][0]
            if cost < best[r][0]:
                best[r] = (cost, sig)
    calls: list[Call] = []
    r = n
    while r > 0:
        first = best[r][1]
        if first is None:
            raise RuntimeFailure(f"no signature fits {r} tokens at position {start + n - r}")
        count = min(r, first.length)
        calls.append(Call(first, n - r, count))
        r -= count
    return calls


def _mask(rows: int, first_pos: int, ctx: int, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """Causal mask: row i may attend to positions <= first_pos + i."""
    cols = np.arange(ctx, dtype=np.int64)[None, :]
    limit = first_pos + np.arange(rows, dtype=np.int64)[:, None]
    m = np.where(cols <= limit, np.float32(0), _NEG).astype(np.float32)
    return m.reshape(shape)


class _RunnerBase(Generic[_K]):
    """Prefill plans, decode and KV rows on top of one `_run(signature, kv, tokens, pos)` per
    path. A cache runs in one KV window at a time (`_window`); a path with windows moves it to
    another in `_switch`."""

    layout: ModelLayout
    accelerator: str
    _kv_type: type[_K]
    _held: Path | None = None  # <weight cache dir>/<cache key> of the files it runs

    def hold_cache_files(self, directory: Path | None, cache_key: str | None) -> None:
        """Keep the files of `cache_key` in weight cache `directory` while this runner is open:
        another load into the directory (an update loaded beside this model) prunes the rest."""
        if directory is None or cache_key is None or self._held is not None:
            return
        self._held = key = directory / cache_key
        with _in_use_lock:
            _in_use[key] = _in_use.get(key, 0) + 1

    def _release_cache_files(self) -> None:
        key, self._held = self._held, None
        if key is None:
            return
        with _in_use_lock:
            left = _in_use.pop(key, 0) - 1
            if left > 0:
                _in_use[key] = left

    def _run(self, sig: Signature, kv: _K, tokens: Sequence[int], pos: int) -> None:
        raise NotImplementedError

    def _logits(self, sig: Signature) -> Logits:
        """The logits output of decode signature `sig` after its run."""
        raise NotImplementedError

    def _own(self, kv: KVCache) -> _K:
        """A KV handle is only valid with the runner that made it."""
        if not isinstance(kv, self._kv_type):
            raise TypeError(f"KV cache {type(kv).__name__} does not belong to this runner")
        return kv

    def new_kv(self) -> _K:
        raise NotImplementedError

    def _window(self, kv: _K) -> Window:
        """The KV window a cache is in now."""
        return self.layout.full

    def _switch(self, kv: _K, window: int, keep: int) -> None:
        """Move a cache to window `window` (index into `all_windows`), keeping `keep` rows."""
        raise NotImplementedError

    def _full(self, kv: _K, name: str) -> npt.NDArray[Any]:
        """One KV tensor of a cache as a host array (a copy or a view)."""
        raise NotImplementedError

    def _store(self, kv: _K, name: str, array: npt.NDArray[Any]) -> None:
        """Replace one KV tensor of a cache."""
        raise NotImplementedError

    def _seq_axis(self, name: str) -> int:
        kv = self.layout.kv
        return kv.k_seq_axis if "_k_" in name else kv.v_seq_axis

    def _seq_index(self, name: str, rows: int) -> tuple[Any, ...]:
        """Index of the first `rows` cache rows of one KV tensor."""
        index: list[Any] = [slice(None)] * len(self.layout.kv.k_shape)
        index[self._seq_axis(name)] = slice(0, rows)
        return tuple(index)

    def reserve(self, kv: KVCache, rows: int, keep: int) -> None:
        """Put a cache in the smallest KV window that holds `rows` rows, keeping its first
        `keep` rows (copied when it moves). Without windows there is nothing to do."""
        self._reserve(self._own(kv), rows, keep)

    def _reserve(self, own: _K, rows: int, keep: int) -> None:
        if self.layout.windows:
            target = self.layout.window_for(rows)
            if self.layout.all_windows()[target].length != self._window(own).length:
                self._switch(own, target, min(keep, rows))

    def _grow(self, own: _K, rows: int, keep: int) -> None:
        """`reserve`, but only ever up: a running request outgrowing its window."""
        if rows > self._window(own).length:
            self._reserve(own, rows, keep)

    def read_rows(self, kv: KVCache, rows: int) -> dict[str, npt.NDArray[Any]]:
        """A copy of the first `rows` cache rows of every KV tensor: what a spill keeps."""
        own = self._own(kv)
        # Always a copy: `_full` of a host cache is the live array, and a slice of it can be
        # contiguous already (one KV head), where ascontiguousarray would return a view that
        # the next user of the cache overwrites.
        return {
            name: np.array(self._full(own, name)[self._seq_index(name, rows)], order="C")
            for name in self.layout.kv.names()
        }

    def write_rows(self, kv: KVCache, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
        """Put rows saved by `read_rows` back at the start of a cache; later rows are zeroed
        (the causal mask hides them either way)."""
        own = self._own(kv)
        if set(arrays) != set(self.layout.kv.names()):
            raise ModelFormatError("saved KV rows do not match this model's KV tensors")
        some = next(iter(arrays))
        self._reserve(own, arrays[some].shape[self._seq_axis(some)], 0)  # rows from `arrays`
        self._put_rows(own, arrays)

    def _put_rows(self, own: _K, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
        layout = self._window(own).kv
        for name, rows in arrays.items():
            shape = layout.k_shape if "_k_" in name else layout.v_shape
            full = np.zeros(shape, dtype=np.float32)
            index = self._seq_index(name, rows.shape[self._seq_axis(name)])
            try:
                full[index] = rows
            except ValueError as exc:
                raise ModelFormatError(f"saved KV rows of {name} do not fit: {exc}") from exc
            self._store(own, name, full)

    def prefill(self, kv: KVCache, tokens: Sequence[int], start: int) -> None:
        own = self._own(kv)
        self._grow(own, start + len(tokens), start)
        for call in plan_prefill(self._window(own), len(tokens), start):
            chunk = tokens[call.offset : call.offset + call.count]
            self._run(call.signature, own, chunk, start + call.offset)

    def check_windows(self, tolerance: float = 1e-3) -> str | None:
        """Run every signature of each KV window, then one decode step, on the same tokens as
        the full length's signature of the same length; the first failure, or difference in
        the logits beyond `tolerance` (relative to the largest logit), as text, or None.
        Measured on the SmolLM-shaped int8 and int4 files: the logits are bit-identical."""
        windows = self.layout.all_windows()
        top = len(windows) - 1
        longest = max((p.length for w in windows[:-1] for p in w.prefill), default=0)
        tokens = [(7919 * i + 11) % self.layout.vocab_size for i in range(longest + 1)]

        def logits(index: int, n: int) -> Logits:
            """Prefill `n` tokens with window `index`'s signature of that length, then decode."""
            window = windows[index]
            kv = self.new_kv()
            if self._window(kv).length != window.length:
                self._switch(kv, index, 0)
            if n:
                self._run(next(p for p in window.prefill if p.length == n), kv, tokens[:n], 0)
            self._run(window.decode, kv, [tokens[n]], n)
            return self._logits(window.decode).copy()

        want: dict[int, Logits] = {}
        for index, window in enumerate(windows[:-1]):
            for n in (0, *(p.length for p in window.prefill)):
                if n not in want:
                    want[n] = logits(top, n)
                try:
                    got = logits(index, n)
                except RuntimeFailure as exc:
                    return f"window kv{window.length} after {n} prefilled tokens: {exc}"
                scale = max(1.0, float(np.max(np.abs(want[n]))))
                err = float(np.max(np.abs(got - want[n])))
                if not err <= tolerance * scale:  # NaN fails too
                    return (
                        f"window kv{window.length} after {n} prefilled tokens: logits differ "
                        f"from the full length by {err:.3g} (largest logit {scale:.3g})"
                    )
        return None

    def decode(self, kv: KVCache, token: int, pos: int) -> Logits:
        own = self._own(kv)
        self._grow(own, pos + 1, pos)
        sig = self._window(own).decode
        self._run(sig, own, [token], pos)
        return self._logits(sig)


# ----------------------------------------------------------------------------- CompiledModel


@dataclass(slots=True)
class _BoundKV:
    buffers: dict[str, Any]
    nbytes: int
    window: Window
    # per signature: the (inputs, outputs) capsule maps binding these buffers, built once
    maps: dict[str, tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=dict)


def _aligned_floats(size: int) -> Logits:
    """A float32 array at a 64-byte boundary: a host-memory TensorBuffer over any other
    address would be a copy the runtime writes to instead."""
    raw = np.zeros(size + 16, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // raw.itemsize
    return raw[skip : skip + size]


@dataclass(slots=True)
class _SigIO:
    tokens: Any
    input_pos: Any
    mask: Any | None
    logits: Any | None  # a TensorBuffer over `logits_array`: the runtime writes there
    logits_array: Logits
    token_array: npt.NDArray[np.int32]  # reused host arrays for the small inputs
    pos_array: npt.NDArray[np.int32]
    pos_base: npt.NDArray[np.int32]


class _CompiledRunner(_RunnerBase[_BoundKV]):
    """CompiledModel with runtime-created KV buffers bound in place."""

    _kv_type = _BoundKV

    def __init__(
        self,
        path: Path,
        layout: ModelLayout,
        accelerator: str,
        threads: int,
        cache_dir: str | None,
        npu_library: str | None,
    ) -> None:
        from ai_edge_litert.compiled_model import CompiledModel
        from ai_edge_litert.cpu_kernel_mode import CpuKernelMode
        from ai_edge_litert.cpu_options import CpuOptions
        from ai_edge_litert.environment import Environment
        from ai_edge_litert.hardware_accelerator import HardwareAccelerator as HW
        from ai_edge_litert.options import Options

        self.layout = layout
        kernel = CpuKernelMode.BUILTIN if accelerator == "cpu" else CpuKernelMode.XNNPACK
        hw = {"npu": HW.NPU | HW.CPU, "gpu": HW.GPU | HW.CPU}.get(accelerator, HW.CPU)
        cpu = CpuOptions(
            num_threads=threads, kernel_mode=kernel, xnnpack_weight_cache_path=cache_dir or ""
        )
        env = Environment.create(dispatch_library_path=npu_library) if npu_library else None
        self._model = CompiledModel.from_file(
            str(path), options=Options(hardware_accelerators=hw, cpu_options=cpu), environment=env
        )
        self.accelerator = accelerator
        if accelerator == "npu" and not self._model.is_fully_accelerated():
            self.accelerator = "npu+cpu"
        self._io = {s.key: self._make_io(s) for w in layout.all_windows() for s in w.signatures}

    def _make_io(self, sig: Signature) -> _SigIO:
        from ai_edge_litert.tensor_buffer import TensorBuffer

        m = self._model
        logits, array = None, np.zeros(0, dtype=np.float32)
        if sig.has_logits:
            # Bound as the output, so a decode step writes its logits where the engine reads
            # them: no copy and no 196 KB allocation per token (SmolLM's vocabulary).
            array = _aligned_floats(int(np.prod(sig.logits_shape)))
            logits = TensorBuffer.create_from_host_memory(array)
        return _SigIO(
            tokens=m.create_input_buffer_by_name(sig.key, "tokens"),
            input_pos=m.create_input_buffer_by_name(sig.key, "input_pos"),
            mask=m.create_input_buffer_by_name(sig.key, "mask") if sig.has_mask else None,
            logits=logits,
            logits_array=array,
            token_array=np.zeros((1, sig.length), dtype=np.int32),
            pos_array=np.zeros(sig.length, dtype=np.int32),
            pos_base=np.arange(sig.length, dtype=np.int32),
        )

    def _buffers(self, window: Window) -> dict[str, Any]:
        # Fresh buffers are not zeroed: a NaN in a masked row would still poison attention.
        # One zero array per shape, not per buffer: its pages are touched once, not 60 times.
        zeros = {
            "k": np.zeros(window.kv.k_shape, dtype=np.float32),
            "v": np.zeros(window.kv.v_shape, dtype=np.float32),
        }
        buffers = {}
        for name in window.kv.names():
            buf = self._model.create_input_buffer_by_name(window.decode.key, name)
            buf.write(zeros["k" if "_k_" in name else "v"])
            buffers[name] = buf
        return buffers

    def new_kv(self) -> _BoundKV:
        window = self.layout.all_windows()[0]
        return _BoundKV(self._buffers(window), window.kv.bytes_per_session, window)

    def _window(self, kv: _BoundKV) -> Window:
        return kv.window

    def _switch(self, kv: _BoundKV, window: int, keep: int) -> None:
        rows = self.read_rows(kv, keep) if keep else None
        target = self.layout.all_windows()[window]
        kv.maps.clear()
        kv.buffers = {}  # the old buffers are freed with their last reference, before the new
        kv.buffers = self._buffers(target)
        kv.window, kv.nbytes = target, target.kv.bytes_per_session
        if rows is not None:
            self._put_rows(kv, rows)
        log.debug("KV moved to window %d keeping %d rows", target.length, keep)

    def _full(self, kv: _BoundKV, name: str) -> npt.NDArray[Any]:
        layout = kv.window.kv
        shape = layout.k_shape if "_k_" in name else layout.v_shape
        flat: npt.NDArray[Any] = kv.buffers[name].read(int(np.prod(shape)), np.float32)
        return flat.reshape(shape)

    def _store(self, kv: _BoundKV, name: str, array: npt.NDArray[Any]) -> None:
        kv.buffers[name].write(array)

    def _run(self, sig: Signature, kv: _BoundKV, tokens: Sequence[int], pos: int) -> None:
        io = self._io[sig.key]
        n = sig.length
        io.token_array.fill(0)
        io.token_array[0, : len(tokens)] = tokens
        io.tokens.write(io.token_array)
        io.pos_array[:] = io.pos_base
        io.pos_array += pos
        io.input_pos.write(io.pos_array)
        if io.mask is not None:
            io.mask.write(_mask(n, pos, kv.window.length, sig.mask_shape))
        bound = kv.maps.get(sig.key)
        if bound is None:
            inputs = {"tokens": io.tokens, "input_pos": io.input_pos, **kv.buffers}
            if io.mask is not None:
                inputs["mask"] = io.mask
            outputs = dict(kv.buffers)  # the same buffers: the update happens in place
            if io.logits is not None:
                outputs["logits"] = io.logits
            # The wrapper's own call with capsules resolved once: `run_by_name` rebuilds
            # both maps on every call, a measurable share of a sub-millisecond decode step.
            bound = kv.maps[sig.key] = (
                {k: b.capsule for k, b in inputs.items()},
                {k: b.capsule for k, b in outputs.items()},
            )
        try:
            self._model._model.RunByName(sig.key, bound[0], bound[1])
        except RuntimeError as exc:
            raise RuntimeFailure(f"{sig.key} failed: {exc}") from exc

    def _logits(self, sig: Signature) -> Logits:
        io = self._io[sig.key]
        assert io.logits is not None  # discover_layout checked that decode outputs logits
        return io.logits_array

    def close(self) -> None:
        self._io.clear()
        self._model.close()
        self._release_cache_files()


# ----------------------------------------------------------------------------- Interpreter


@dataclass(slots=True)
class _HostKV:
    arrays: dict[str, npt.NDArray[np.float32]]
    nbytes: int
    version: int = 0
    # which signature's input tensors hold which version of this cache
    loaded: dict[str, int] = field(default_factory=dict)


class _InterpreterRunner(_RunnerBase[_HostKV]):
    """Classic Interpreter: views of the KV input tensors, copy back only the new rows."""

    _kv_type = _HostKV

    def __init__(
        self,
        path: Path,
        layout: ModelLayout,
        accelerator: str,
        threads: int,
        delegate: tuple[str, dict[str, str]] | None,
        backend: str = "ai-edge-litert",
    ) -> None:
        if backend == LEGACY_BACKEND:
            from tflite_runtime.interpreter import Interpreter, OpResolverType, load_delegate
        else:
            from ai_edge_litert.interpreter import Interpreter, OpResolverType, load_delegate

        # KV windows are for the CompiledModel path: the Interpreter allocates every signature's
        # KV inputs in its arena, so each window would cost its KV once per signature.
        self.layout = replace(layout, windows=())
        delegates = []
        if delegate is not None:
            delegates.append(load_delegate(delegate[0], delegate[1]))
        resolver = (
            OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
            if accelerator == "cpu"
            else OpResolverType.AUTO
        )
        self._it = Interpreter(
            model_path=str(path),
            num_threads=threads,
            experimental_delegates=delegates or None,
            experimental_op_resolver_type=resolver,
        )
        self.accelerator = accelerator
        self._w = self._it._interpreter  # the wrapper: per-subgraph tensors without a runner
        defs = self._it._get_full_signature_list()
        self._sub: dict[str, int] = {}
        self._in: dict[str, dict[str, int]] = {}
        self._out: dict[str, dict[str, int]] = {}
        for sig in (layout.decode, *layout.prefill):
            sub = self._w.GetSubgraphIndexFromSignature(sig.key)
            self._w.AllocateTensors(sub)
            self._sub[sig.key] = sub
            self._in[sig.key] = dict(defs[sig.key]["inputs"])
            self._out[sig.key] = dict(defs[sig.key]["outputs"])
        self._owner: dict[str, int] = {}  # signature -> id() of the cache in its tensors

    def _view(self, key: str, index: int) -> npt.NDArray[Any]:
        view: npt.NDArray[Any] = self._w.tensor(self._w, index, self._sub[key])
        return view

    def new_kv(self) -> _HostKV:
        kv = self.layout.kv
        arrays = {
            n: np.zeros(kv.k_shape if "_k_" in n else kv.v_shape, dtype=np.float32)
            for n in kv.names()
        }
        return _HostKV(arrays, kv.bytes_per_session)

    def _full(self, kv: _HostKV, name: str) -> npt.NDArray[Any]:
        return kv.arrays[name]

    def _store(self, kv: _HostKV, name: str, array: npt.NDArray[Any]) -> None:
        kv.arrays[name][...] = array
        kv.version += 1  # the signatures' input tensors hold an older copy now

    def _rows(self, name: str) -> int:
        kv = self.layout.kv
        return kv.k_seq_axis if "_k_" in name else kv.v_seq_axis

    def _run(self, sig: Signature, kv: _HostKV, tokens: Sequence[int], pos: int) -> None:
        key, n = sig.key, sig.length
        ins, outs = self._in[key], self._out[key]
        if self._owner.get(key) != id(kv) or kv.loaded.get(key) != kv.version:
            for name, arr in kv.arrays.items():
                self._view(key, ins[name])[...] = arr
        padded = np.zeros((1, n), dtype=np.int32)
        padded[0, : len(tokens)] = tokens
        self._view(key, ins["tokens"])[...] = padded
        self._view(key, ins["input_pos"])[...] = np.arange(pos, pos + n, dtype=np.int32)
        if sig.has_mask:
            self._view(key, ins["mask"])[...] = _mask(
                n, pos, self.layout.context_length, sig.mask_shape
            )
        try:
            self._w.Invoke(self._sub[key])
        except (RuntimeError, ValueError) as exc:
            raise RuntimeFailure(f"{key} failed: {exc}") from exc
        rows = slice(pos, pos + len(tokens))
        for name, arr in kv.arrays.items():
            axis = self._rows(name)
            index: list[Any] = [slice(None)] * arr.ndim
            index[axis] = rows
            new = self._view(key, outs[name])[tuple(index)]
            arr[tuple(index)] = new
            self._view(key, ins[name])[tuple(index)] = new
        kv.version += 1
        kv.loaded[key] = kv.version
        self._owner[key] = id(kv)

    def _logits(self, sig: Signature) -> Logits:
        logits: Logits = self._view(sig.key, self._out[sig.key]["logits"]).reshape(-1).copy()
        return logits

    def close(self) -> None:
        self._owner.clear()
        self._release_cache_files()


# ----------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A runner plus what was decided while loading it."""

    runner: Runner
    model_file: ModelFile
    memory: MemoryPlan
    accelerator: str
    path_kind: str  # "compiled" | "interpreter"
    fallbacks: tuple[str, ...]  # one line per accelerator that was skipped, with the reason
    prepared: str = "none"  # what runs instead of the file: "none", "inlined ...", "refused, ..."


def plan_memory(
    model: ModelFile, layout: ModelLayout, profile: DeviceProfile, sessions: int = 1
) -> MemoryPlan:
    """Count weights, packed weights, activations and KV against the profile's budget."""
    xnnpack = "xnnpack" in profile.runtime.accelerators
    return MemoryPlan(
        weights=model.size,
        packed_weights=model.weight_bytes if xnnpack else 0,
        activations=sum(s.activation_bytes for s in model.signatures),
        kv_per_session=layout.kv.bytes_per_session,
        sessions=sessions,
        budget=profile.runtime.max_num_bytes,
    )


def check_budget(plan: MemoryPlan, profile: DeviceProfile, path: Path) -> None:
    """Refuse a plan that does not fit the profile's `max_num_bytes`, with the numbers."""
    if plan.total > plan.budget:
        raise BudgetError(
            f"{path.name} needs {plan.describe()}, but profile {profile.name} "
            f"({profile.source}) allows runtime.max_num_bytes = {plan.budget} "
            f"({plan.budget / MIB:.1f} MiB)"
        )


def load(
    path: Path,
    profile: DeviceProfile,
    *,
    context_length: int | None = None,
    prefer_interpreter: bool = False,
    cache_key: str | None = None,
    kv_windows: bool = True,
) -> LoadedModel:
    """Load `path` under `profile`: check format and budget, then walk the accelerator chain.

    `cache_key` (the model's sha256) names the persistent XNNPACK weight cache file when the
    profile sets `xnnpack_weight_cache_dir`; without both, the cache lives in memory.
    `kv_windows=False` runs only the full-length signatures of a file that has KV windows.
    """
    keep_large_buffers_mapped()
    model = read_model_file(path, parse_cache(profile, cache_key))
    try:
        layout = discover_layout(model, context_length)
    except ModelFormatError as exc:  # say which file: a directory holds several
        raise ModelFormatError(f"{path}: {exc}") from exc
    if not kv_windows:
        layout = replace(layout, windows=())
    source = str(profile.source)
    if profile.runtime.require_fused and not model.fused:
        raise ModelFormatError(
            f"{path.name}: profile {profile.name} ({source}) sets runtime.require_fused = true, "
            "but the model has no fused STABLEHLO_COMPOSITE ops; export it with composites on "
            "(enable_hlfb) or set require_fused = false"
        )
    if profile.runtime.backend == LEGACY_BACKEND:
        check_legacy_compatible(model, path, layout)
        prefer_interpreter = True  # tflite-runtime has no CompiledModel
    elif not prefer_interpreter and aarch64_without_lse():
        # CompiledModel's environment loads a LiteRT library that aborts without LSE atomics
        log.info(
            "this CPU has no LSE atomics (e.g. Cortex-A72/A53): running %s on the "
            "Interpreter, not CompiledModel (agent/runtime/cpufeatures.py)",
            path.name,
        )
        prefer_interpreter = True
    plan = plan_memory(model, layout, profile)
    check_budget(plan, profile, path)
    chain = list(profile.runtime.accelerators)
    prepared, cpu = _prepare(
        path, model, layout, plan, profile, cache_key, chain, kv_windows, prefer_interpreter
    )
    checks = _Checks(path, model, layout, profile, cache_key)
    fallbacks: list[str] = []
    for i, acc in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else "nothing"
        use_layout, use_plan = (layout, plan) if acc == "npu" else cpu
        if acc != "npu" and prepared.fresh:
            checks.reference()  # now: its runner is closed before the copy's opens
        try:
            try:
                runner, kind = _open(path, use_layout, profile, acc, prefer_interpreter, prepared)
            except (OSError, RuntimeError, ValueError) as exc:
                if acc == "npu" or not prepared.windows:
                    raise
                log.warning("KV windows not used: %s cannot run them (%s)", acc, _first_line(exc))
                prepared.path.unlink(missing_ok=True)  # our copy: the next load makes it again
                prepared, cpu = _prepare(
                    path, model, layout, plan, profile, cache_key, chain, False, prefer_interpreter
                )
                use_layout, use_plan = cpu
                runner, kind = _open(path, use_layout, profile, acc, prefer_interpreter, prepared)
            if acc != "npu":
                runner, kind, prepared = checks.run(runner, kind, acc, prepared, prefer_interpreter)
                use_plan = cpu[1] if prepared.path != path else plan
        except (OSError, RuntimeError, ValueError, AcceleratorError) as exc:
            reason = f"{acc}: {_first_line(exc)}"
            log.warning("accelerator %s unavailable (%s); falling back to %s", acc, reason, nxt)
            fallbacks.append(reason)
            continue
        log.info(
            "model loaded: %s on %s via %s, %s",
            path.name,
            runner.accelerator,
            kind,
            use_plan.describe(),
        )
        return LoadedModel(
            runner,
            model,
            use_plan,
            runner.accelerator,
            kind,
            tuple(fallbacks),
            checks.refused or prepared.describe(path),
        )
    raise AcceleratorError(
        f"no accelerator of profile {profile.name} could run {path.name}: " + "; ".join(fallbacks)
    )


class _Checks:
    """The first-load checks of one load (`agent.runtime.check`): a fresh prepared copy, and the
    builtin-kernel ``cpu`` link of a fused model, against the original file on XNNPACK. The
    reference is computed once, before the runner it checks is needed again, and its runner
    closed before anything else is opened."""

    def __init__(
        self,
        path: Path,
        model: ModelFile,
        layout: ModelLayout,
        profile: DeviceProfile,
        cache_key: str | None,
    ) -> None:
        self.path, self.model, self.layout, self.profile = path, model, layout, profile
        self.cache_key = cache_key
        self._probe: check.Probe | str | None = None  # the reference, or why there is none
        self.refused: str | None = None  # the prepared copy's refusal, as status shows it

    def reference(self) -> check.Probe | str:
        """What the original file computes on XNNPACK (computed once), or why it could not
        be had. Its runner packs the weights in memory and is closed before this returns, so
        a first load's peak holds one packed model, not two."""
        if self._probe is None:
            rt = self.profile.runtime
            try:
                ref = _InterpreterRunner(
                    self.path, self.layout, "xnnpack", rt.num_threads, None, rt.backend
                )
                try:
                    self._probe = check.reference(ref, self.model)
                finally:
                    ref.close()
                    del ref
            except (OSError, RuntimeError, ValueError) as exc:
                self._probe = f"the original file did not run on XNNPACK: {_first_line(exc)}"
            except check.NonFiniteReference as exc:
                self._probe = str(exc)
            give_back_memory()
        return self._probe

    def run(
        self, runner: Runner, kind: str, acc: str, prepared: PreparedModel, interpreter: bool
    ) -> tuple[Runner, str, PreparedModel]:
        """`runner` if it computes what the original file does; else the original file opened
        on `acc` (a refused copy) or AcceleratorError (the cpu link)."""
        if prepared.fresh:
            prepared = _check_new_windows(runner, prepared)  # a failure here drops only windows
            problem = self._problem(runner, "the prepared copy")
            if problem is None:
                if prepared.path.exists():  # not dropped with its windows
                    prepared = _keep_checked(prepared)
                return runner, kind, self._cpu(runner, kind, acc, prepared, interpreter)
            runner.close()
            del runner
            give_back_memory()
            self.refused = _refuse(prepared, self.cache_key, problem, self.path)
            prepared = PreparedModel(self.path, self.cache_key)
            runner, kind = _open(self.path, self.layout, self.profile, acc, interpreter, prepared)
        return runner, kind, self._cpu(runner, kind, acc, prepared, interpreter)

    def _cpu(
        self, runner: Runner, kind: str, acc: str, prepared: PreparedModel, interpreter: bool
    ) -> PreparedModel:
        """The builtin kernels run a composite through its decomposition, which is not always
        what the composite means: a fused model runs there only once checked."""
        if acc != "cpu" or not self.model.fused:
            return prepared
        problem = self._problem(runner, "LiteRT's builtin kernels")
        if problem is not None:
            runner.close()
            raise AcceleratorError(
                f"the builtin CPU kernels do not compute what {self.path.name} computes on "
                f"XNNPACK ({problem})"
            )
        return prepared

    def _problem(self, runner: Runner, what: str) -> str | None:
        want = self.reference()
        if isinstance(want, str):
            return want
        problem = check.compare(runner, want)
        give_back_memory()
        if problem is None:
            log.info("%s checked against %s: logits within %g", what, self.path, want.tolerance)
        return problem


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _affordable_windows(
    model: ModelFile, layout: ModelLayout, plan: MemoryPlan
) -> tuple[tuple[int, ...], int]:
    """The KV windows to add at load (`auto_windows`) whose signatures fit the budget, and the
    activation bytes they add at most: a window's copy of a signature needs at most the
    activations of the full-length one."""
    acts = {s.key: s.activation_bytes for s in model.signatures}
    chosen: list[int] = []
    extra = 0
    for w in auto_windows(layout.context_length):
        n = window_prefill((p.length for p in layout.prefill), w)
        sigs = (layout.decode, *(p for p in layout.prefill if p.length == n))
        cost = sum(acts.get(s.key, 0) for s in sigs)
        if plan.total + extra + cost > plan.budget:
            log.info("KV window %d not added: its activations would exceed the budget", w)
            break
        extra += cost
        chosen.append(w)
    return tuple(chosen), extra


def _adds_windows(
    profile: DeviceProfile, layout: ModelLayout, kv_windows: bool, interpreter: bool
) -> bool:
    """Whether a load gives this model KV windows: a single-length model on the CompiledModel
    CPU path (the Interpreter would allocate each window's KV once per signature) with a weight
    cache directory to keep the prepared copy in, unless the profile or the caller turns them
    off."""
    return (
        kv_windows
        and profile.runtime.kv_windows
        and profile.runtime.xnnpack_weight_cache_dir is not None
        and profile.runtime.backend != LEGACY_BACKEND
        and bool({"xnnpack", "cpu"} & set(profile.runtime.accelerators))
        and not layout.windows
        and not interpreter
    )


def expected_plan(model: ModelFile, layout: ModelLayout, profile: DeviceProfile) -> MemoryPlan:
    """What `load` will plan for this model, counted without loading it: `plan_memory` plus the
    activations of the KV windows the load would add (at most; the windows' own signatures
    need no more than the full-length ones)."""
    plan = plan_memory(model, layout, profile)
    if not _adds_windows(profile, layout, kv_windows=True, interpreter=False):
        return plan
    _windows, extra = _affordable_windows(model, layout, plan)
    return replace(plan, activations=plan.activations + extra)


def _prepare(
    path: Path,
    model: ModelFile,
    layout: ModelLayout,
    plan: MemoryPlan,
    profile: DeviceProfile,
    cache_key: str | None,
    chain: list[str],
    kv_windows: bool,
    interpreter: bool,
) -> tuple[PreparedModel, tuple[ModelLayout, MemoryPlan]]:
    """The file the CPU links run, and its layout and memory plan.

    XNNPACK cannot take a composite: each one splits the delegated graph (6-10% of a decode
    step, docs/PERFORMANCE.md); LiteRT-LM inlines them when it compiles, so do we. A
    single-length model also gets KV windows (`agent.runtime.windows`) on the CompiledModel
    path (the Interpreter would allocate each window's KV once per signature), unless the profile
    sets ``kv_windows = false``.
    """
    unchanged = PreparedModel(path, cache_key), (layout, plan)
    if profile.runtime.backend == LEGACY_BACKEND or not {"xnnpack", "cpu"} & set(chain):
        return unchanged
    windows: tuple[int, ...] = ()
    if _adds_windows(profile, layout, kv_windows, interpreter):
        windows, _extra = _affordable_windows(model, layout, plan)
    if not (model.fused or windows):
        return unchanged
    n = layout.context_length
    prepared = prepared_model(path, profile, cache_key, model.fused, windows, n)
    if not prepared.windows:
        return prepared, (layout, plan)
    made = read_model_file(prepared.path, parse_cache(profile, prepared.cache_key))
    made_layout = discover_layout(made, n)
    made_plan = plan_memory(made, made_layout, profile)
    if made_plan.total > made_plan.budget:
        log.warning("KV windows not used: with them %s", made_plan.describe())
        return prepared_model(path, profile, cache_key, model.fused, (), n), (layout, plan)
    return prepared, (made_layout, made_plan)


def _check_new_windows(runner: Runner, prepared: PreparedModel) -> PreparedModel:
    """Compare the windows just added to a model with its full length before using them (the
    copy is named only once this and the check against the original file pass). On a
    difference the model runs its full length only, the copy is dropped and the outcome is
    remembered, so later loads do not rewrite the model for windows again."""
    if not isinstance(runner, _CompiledRunner) or not prepared.windows:
        return prepared
    problem = runner.check_windows()
    give_back_memory()
    if problem is None:
        log.info("KV windows %s added and checked", list(prepared.windows))
        return prepared
    log.warning("KV windows not used: %s; running the full length only", problem)
    runner.layout = replace(runner.layout, windows=())
    prepared.path.unlink(missing_ok=True)
    prepared.path.with_name(f"{prepared.cache_key}{PARSE_SUFFIX}").unlink(missing_ok=True)
    _remember_no_windows(prepared.path.parent, prepared.cache_key, problem)
    return replace(prepared, windows=())


LEGACY_BACKEND: Final = "tflite-runtime"
# ops that take int8 weights directly in a dynamic-range graph (weight-only graphs feed them
# float weights from DEQUANTIZE)
_HYBRID_OPS: Final = frozenset(
    {"FULLY_CONNECTED", "EMBEDDING_LOOKUP", "BATCH_MATMUL", "CONV_2D", "DEPTHWISE_CONV_2D"}
)


def check_legacy_compatible(model: ModelFile, path: Path, layout: ModelLayout) -> None:
    """tflite-runtime 2.14 cannot run fused (STABLEHLO_COMPOSITE) graphs or int4 weights, and
    its dynamic-range int8 kernels (quantized weights fed straight into FULLY_CONNECTED or
    EMBEDDING_LOOKUP) compute zeros (measured: docs/PROFILES.md). Refuse such a model before
    the interpreter sees it, saying what to export instead; weight-only int8 (weights
    dequantized at load) runs correctly."""
    problems = []
    if model.fused:
        problems.append("it has fused STABLEHLO_COMPOSITE ops")
    if layout.kv.name != "transposed":  # its prefill disagrees with its decode there (measured)
        problems.append(f"its KV layout is {layout.kv.name!r}, not 'transposed'")
    kinds = [(op, kind) for op, kind, _n, _b in model.weights]
    if any("int4" in kind for _op, kind in kinds):
        problems.append("it has int4 weights")
    hybrid = sorted({op for op, kind in kinds if kind.startswith("int8") and op in _HYBRID_OPS})
    if hybrid:
        problems.append(f"it has dynamic-range int8 weights in {', '.join(hybrid)}")
    if problems:
        raise ModelFormatError(
            f"{path.name}: backend tflite-runtime cannot run this model: "
            + "; ".join(problems)
            + ". Export a variant with composites off, the transposed KV layout and weight-only "
            "int8 (scripts/build_model.py --no-composites --layout transposed --quant "
            "int8_weight_only), or use ai-edge-litert"
        )


# XNNPACK's in-memory weight cache (a memfd). Without any weight cache XNNPACK packs the weights
# once per signature: 3x the packed bytes for a model with 4 signatures (docs/PERFORMANCE.md).
IN_MEMORY_WEIGHT_CACHE: Final = ":memory:"
WEIGHT_CACHE_SUFFIX: Final = ".xnnpack"
MODEL_SUFFIX: Final = ".tflite"
UNCHECKED_SUFFIX: Final = ".unchecked"  # a prepared copy before its first-load check
NO_WINDOWS_SUFFIX: Final = ".nowindows"  # why a model's windows were refused or failed
REFUSED_SUFFIX: Final = ".refused"  # why a model's prepared copy failed its first-load check
PARSE_SUFFIX: Final = ".parse.json"  # what reading a model file found (`read_model_file`)
# files the runtime keeps in a weight cache directory: <sha256>[.<variant>].xnnpack|.tflite,
# <sha256>.<variant>.tflite.unchecked, <sha256>.p<format>.nowindows,
# <sha256>[.<variant>].parse.json; and what a load killed while writing one leaves:
# <name>.tmp (a prepared copy), <name><mkstemp's 8 characters>.tmp (a reading)
_CACHE_FILE = re.compile(
    r"^[0-9a-f]{64}(\.[a-z0-9-]+)?\.(xnnpack|tflite|tflite\.unchecked|nowindows|refused|parse\.json)"
    r"(([a-z0-9_]{8})?\.tmp)?$"
)

# Bumped whenever `prepare_file` writes a different file for the same input, so that a copy
# an older edge-agent left in the weight cache directory is made again, not reused. 4: the
# attention composite is no longer inlined (p3 copies of one-KV-head default-layout models
# computed something else), and every copy is checked against the original file.
PREPARED_FORMAT: Final = 4


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """The file the CPU path runs: the model itself, or a copy made for XNNPACK."""

    path: Path
    cache_key: str | None  # names its packed weights
    windows: tuple[int, ...] = ()  # KV windows added to it
    fresh: bool = False  # written by this load: `path` is unchecked until `checked_path`
    inlined: bool = False  # its composites (but `inline.KEPT_COMPOSITES`) are inlined
    refused: str | None = None  # why an earlier load refused this model's copy

    @property
    def checked_path(self) -> Path:
        return self.path.with_name(f"{self.cache_key}{MODEL_SUFFIX}")

    def describe(self, original: Path) -> str:
        """What runs instead of `original`, as status shows it."""
        if self.refused is not None:
            return check.describe_refusal(original, self.refused)
        if self.path == original:
            return "none"
        parts = (["composites inlined"] if self.inlined else []) + (
            [f"KV windows {', '.join(map(str, self.windows))}"] if self.windows else []
        )
        return ", ".join(parts) + f" ({self.path.name})"


def _keep_checked(prepared: PreparedModel) -> PreparedModel:
    """Give a copy that passed its first-load check the name later loads trust."""
    try:
        prepared.path.replace(prepared.checked_path)
    except OSError as exc:  # it serves; the next start makes and checks it again
        log.warning("checked copy not kept (%s)", exc)
        return prepared
    return replace(prepared, path=prepared.checked_path, fresh=False)


def _refuse(prepared: PreparedModel, cache_key: str | None, problem: str, original: Path) -> str:
    """Drop a copy that failed its check, and remember why: the same file and prepare format
    give the same copy, so later loads serve the original without making it again."""
    directory = prepared.path.parent
    for name in (
        prepared.path.name,
        f"{prepared.cache_key}{WEIGHT_CACHE_SUFFIX}",
        f"{prepared.cache_key}{PARSE_SUFFIX}",
    ):
        (directory / name).unlink(missing_ok=True)
    try:
        (directory / _refused_name(cache_key)).write_text(problem + "\n")
    except OSError as exc:
        log.warning("cannot remember that the prepared copy was refused (%s)", exc)
    shown = check.describe_refusal(original, problem)
    log.warning("prepared copy of %s %s", original.name, shown)
    return shown


def _keep_files(cache_key: str) -> set[str]:
    """The files of the model named `cache_key` (``<sha256>.<variant>``) in the directory."""
    model = f"{cache_key}{MODEL_SUFFIX}"
    return {
        f"{cache_key}{WEIGHT_CACHE_SUFFIX}",
        model,
        model + UNCHECKED_SUFFIX,
        _no_windows_name(cache_key),
        _refused_name(cache_key),
        f"{cache_key}{PARSE_SUFFIX}",
        f"{cache_key.split('.', 1)[0]}{PARSE_SUFFIX}",  # the model file's own
    }


def parse_cache(profile: DeviceProfile, cache_key: str | None) -> Path | None:
    """Where a reading of the file named `cache_key` is kept: beside its packed weights."""
    directory = profile.runtime.xnnpack_weight_cache_dir
    if directory is None or cache_key is None:
        return None
    return directory / f"{cache_key}{PARSE_SUFFIX}"


def _refused_name(cache_key: str | None) -> str:
    """``<sha256>.p<format>.refused``: a prepared copy that failed its first-load check."""
    sha = (cache_key or "").split(".", 1)[0]
    return f"{sha}.p{PREPARED_FORMAT}{REFUSED_SUFFIX}"


def _no_windows_name(cache_key: str | None) -> str:
    """``<sha256>.p<format>.nowindows``: one per model file and prepare format."""
    sha = (cache_key or "").split(".", 1)[0]
    return f"{sha}.p{PREPARED_FORMAT}{NO_WINDOWS_SUFFIX}"


def _remember_no_windows(directory: Path, cache_key: str | None, reason: str) -> None:
    """Keep why this model gets no windows: the outcome is the same for the same file and
    format, and finding it again would cost a rewrite (and a check) at every start."""
    try:
        (directory / _no_windows_name(cache_key)).write_text(reason + "\n")
    except OSError as exc:
        log.warning("cannot remember that KV windows failed (%s)", exc)


def _variant(fused: bool, windows: tuple[int, ...]) -> str:
    """Names what was done to a prepared copy: ``p3-inlined-kv256-512``."""
    parts = [f"p{PREPARED_FORMAT}"] + (["inlined"] if fused else [])
    if windows:
        parts.append("kv" + "-".join(str(w) for w in windows))
    return "-".join(parts)


def prepared_model(
    path: Path,
    profile: DeviceProfile,
    cache_key: str | None,
    fused: bool,
    windows: tuple[int, ...] = (),
    kv_length: int = 0,
) -> PreparedModel:
    """The model to give XNNPACK: `path` with its composites inlined (`agent.runtime.inline`)
    and KV windows added (`agent.runtime.windows`), kept beside the packed weights as
    ``<sha256>.<variant>.tflite`` when the profile has a weight cache directory; else `path`
    itself. A copy made by an earlier load is reused."""
    directory = profile.runtime.xnnpack_weight_cache_dir
    unchanged = PreparedModel(path, cache_key)
    if directory is None or cache_key is None:
        log.info("model not prepared for XNNPACK: the profile sets no xnnpack_weight_cache_dir")
        return unchanged
    refused = directory / _refused_name(cache_key)
    if refused.exists():
        reason = refused.read_text(errors="replace").strip()
        log.warning("model not prepared for XNNPACK: an earlier load refused its copy (%s)", reason)
        return replace(unchanged, refused=reason)
    no_windows = directory / _no_windows_name(cache_key)
    if windows and no_windows.exists():
        reason = no_windows.read_text(errors="replace").strip()
        log.warning("KV windows not added: an earlier load found %s", reason)
        windows = ()
    key = f"{cache_key}.{_variant(fused, windows)}"
    target = directory / f"{key}{MODEL_SUFFIX}"
    # a copy is named `target` only once its first load has checked it against `path`
    write = target.with_name(target.name + UNCHECKED_SUFFIX)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if target.exists():  # made (and checked) by an earlier load
            return PreparedModel(target, key, windows, inlined=fused)
        from agent.runtime.inline import prepare_file  # the flatbuffer schema: only to write

        done = prepare_file(path, write, windows, kv_length)
    except (OSError, ModelFormatError, ValueError, AttributeError) as exc:
        log.warning("model not prepared for XNNPACK (%s); loading %s as it is", exc, path.name)
        return unchanged
    if not done.changed:
        return unchanged
    if done.windows != windows:  # refused: the file holds only the inlined graph
        _remember_no_windows(directory, cache_key, done.refused or "the windows were refused")
        key = f"{cache_key}.{_variant(fused, done.windows)}"
        write = write.replace(directory / f"{key}{MODEL_SUFFIX}{UNCHECKED_SUFFIX}")
    return PreparedModel(write, key, done.windows, fresh=True, inlined=bool(done.inlined))


def weight_cache_path(profile: DeviceProfile, cache_key: str | None) -> str:
    """The XNNPACK weight cache for a model: a file in the profile's directory, else memory.

    `CpuOptions.xnnpack_weight_cache_path` is a file (a directory makes XNNPACK log an error and
    run without a cache). Files of other models (and other variants of this one) in the
    directory are removed: one model's packed weights are as large as the model, and an update
    leaves the old ones unused. Kept: the files of models this process still runs (an update
    loaded beside the serving model must not take the files a rollback would start from).
    """
    directory = profile.runtime.xnnpack_weight_cache_dir
    if directory is None or cache_key is None:
        return IN_MEMORY_WEIGHT_CACHE
    target = directory / f"{cache_key}{WEIGHT_CACHE_SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK) and not target.exists():
            raise PermissionError(f"{directory} is not writable")
        prune_weight_cache(directory, cache_key)
    except OSError as exc:
        log.warning("XNNPACK weight cache dir unusable (%s); packing weights in memory", exc)
        return IN_MEMORY_WEIGHT_CACHE
    return str(target)


def prune_weight_cache(directory: Path, loading: str | None = None) -> None:
    """Remove from weight cache `directory` the files (named like the runtime's) of every model
    that no runner of this process runs, except those of the model `loading` names: what
    updates left behind, once the model they replaced is closed. Raises OSError."""
    with _in_use_lock:
        running = {k.name for k in _in_use if k.parent == directory}
    if loading is not None:
        running.add(loading)
    # their packed weights, their copies, their windows' outcomes
    keep = set().union(*map(_keep_files, running))
    for old in directory.iterdir():
        if _CACHE_FILE.match(old.name) and old.name not in keep:
            old.unlink(missing_ok=True)
            log.info("weight cache removed: %s (another model or variant)", old)


def _open(
    path: Path,
    layout: ModelLayout,
    profile: DeviceProfile,
    acc: str,
    prefer_interpreter: bool,
    prepared: PreparedModel,
) -> tuple[Runner, str]:
    npu = profile.npu
    threads = profile.runtime.num_threads
    backend = profile.runtime.backend
    if acc == "npu":
        if npu is None:
            raise AcceleratorError("no [npu] section in the profile")
        if not os.path.exists(npu.library):
            raise AcceleratorError(f"{npu.library} does not exist")
        if npu.kind == "external_delegate":
            opts = npu.options_as_strings()
            return _InterpreterRunner(
                path, layout, "npu", threads, (npu.library, opts), backend
            ), "interpreter"
        if backend == LEGACY_BACKEND:
            raise AcceleratorError("a dispatch-library NPU needs ai-edge-litert's CompiledModel")
        return _CompiledRunner(path, layout, "npu", threads, None, npu.library), "compiled"
    path = prepared.path
    cache = weight_cache_path(profile, prepared.cache_key) if acc == "xnnpack" else None
    if prefer_interpreter:
        runner = _InterpreterRunner(path, layout, acc, threads, None, profile.runtime.backend)
        runner.hold_cache_files(profile.runtime.xnnpack_weight_cache_dir, prepared.cache_key)
        return runner, "interpreter"
    packing = cache not in (None, IN_MEMORY_WEIGHT_CACHE) and not os.path.exists(str(cache))
    compiled = _CompiledRunner(path, layout, acc, threads, cache, None)
    if packing and os.path.exists(str(cache)):
        # XNNPACK keeps the buffers it packed into for the model's lifetime and writes the file
        # for the next load; reopening maps the file instead (~the packed size less RSS).
        compiled.close()
        del compiled
        give_back_memory()
        log.info("weights packed to %s; model reopened to map them", cache)
        compiled = _CompiledRunner(path, layout, acc, threads, cache, None)
    compiled.hold_cache_files(profile.runtime.xnnpack_weight_cache_dir, prepared.cache_key)
    return compiled, "compiled"
