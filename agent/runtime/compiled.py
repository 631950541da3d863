"""The primary execution path: LiteRT's ``CompiledModel`` with runtime-created KV buffers.

The runtime creates each session's KV buffers once; the same buffer is bound as the input *and*
the output of a signature, so the model updates the cache in place and nothing is copied per
token. A cache with KV windows moves between them (`agent.runtime.prepare.windows`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.base.errors import RuntimeFailure
from agent.model.tflite.layout import ModelLayout, Signature, Window
from agent.runtime.batch import BatchSignature, discover_batch, row_kv_name
from agent.runtime.runner import Logits, RunnerBase, causal_mask

log = logging.getLogger("agent.runtime.litert")  # moved from litert.py: its lines keep their name


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


def _aligned_ints(size: int) -> npt.NDArray[np.int32]:
    raw = np.zeros(size + 16, dtype=np.int32)
    skip = (-raw.ctypes.data % 64) // raw.itemsize
    return raw[skip : skip + size]


@dataclass(slots=True)
class _SigIO:
    tokens: Any
    input_pos: Any
    mask: Any | None
    logits: Any | None  # a TensorBuffer over `logits_array`: the runtime writes there
    logits_array: Logits
    token_array: npt.NDArray[np.int32]  # reused host arrays for the small inputs, flat
    pos_array: npt.NDArray[np.int32]
    pos_base: npt.NDArray[np.int32]
    tokens_capsule: Any  # what the wrapper's write takes, resolved once
    pos_bound: bool  # `input_pos` is a host-memory buffer over `pos_array`: no write


class CompiledRunner(RunnerBase[_BoundKV]):
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

        super().__init__()
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
        self._find_batch()
        from ai_edge_litert import tensor_buffer

        self._write = tensor_buffer._tb.WriteTensorBuffer  # (capsule, flat array, dtype name)

    def _make_io(self, sig: Signature) -> _SigIO:
        from ai_edge_litert.tensor_buffer import TensorBuffer

        m = self._model
        logits, array = None, np.zeros(0, dtype=np.float32)
        if sig.has_logits:
            # Bound as the output, so a decode step writes its logits where the engine reads
            # them: no copy and no 196 KB allocation per token (SmolLM's vocabulary).
            array = _aligned_floats(int(np.prod(sig.logits_shape)))
            logits = TensorBuffer.create_from_host_memory(array)
        pos = _aligned_ints(sig.length)
        # A 1-D `input_pos` (as exported) reads the positions from `pos` itself, like the
        # logits; a host-memory buffer is 1-D, so `tokens` ([1, N]) is written each call.
        shape = list(m.get_input_tensor_details(sig.key)["input_pos"]["shape"])
        pos_bound = shape == [sig.length]
        tokens = m.create_input_buffer_by_name(sig.key, "tokens")
        return _SigIO(
            tokens=tokens,
            input_pos=(
                TensorBuffer.create_from_host_memory(pos)
                if pos_bound
                else m.create_input_buffer_by_name(sig.key, "input_pos")
            ),
            mask=m.create_input_buffer_by_name(sig.key, "mask") if sig.has_mask else None,
            logits=logits,
            logits_array=array,
            token_array=np.zeros(sig.length, dtype=np.int32),
            pos_array=pos,
            pos_base=np.arange(sig.length, dtype=np.int32),
            tokens_capsule=tokens.capsule,
            pos_bound=pos_bound,
        )

    def _find_batch(self) -> None:
        """The file's batch signatures that fit its layout (`agent.runtime.batch`), with
        their inputs and logits bound once like decode's; a malformed one is logged and left
        out."""
        m = self._model

        def details(key: str) -> tuple[dict[str, Any], dict[str, Any]]:
            return m.get_input_tensor_details(key), m.get_output_tensor_details(key)

        self._batch_io: dict[str, _SigIO] = {}
        try:
            found, problems = discover_batch(m.get_signature_list(), details, self.layout)
            for problem in problems:
                log.warning("batch signature not used: %s", problem)
            self._batch_io = {s.key: self._make_batch_io(s) for v in found.values() for s in v}
        except (RuntimeError, ValueError, KeyError) as exc:  # never a reason not to load
            log.warning("batched decode off: its signatures cannot be opened (%s)", exc)
            self._batch_io.clear()
            self.batch_problem = f"its signatures cannot be opened: {exc}"
            return
        self._batch = found
        self.batch_problem = None if found else "the file has no batch signatures"

    def _make_batch_io(self, sig: BatchSignature) -> _SigIO:
        from ai_edge_litert.tensor_buffer import TensorBuffer

        m = self._model
        array = _aligned_floats(sig.rows * sig.vocab)
        pos = _aligned_ints(sig.rows)
        tokens = m.create_input_buffer_by_name(sig.key, "tokens")
        return _SigIO(
            tokens=tokens,
            input_pos=TensorBuffer.create_from_host_memory(pos),  # [B], 1-D like decode's
            mask=m.create_input_buffer_by_name(sig.key, "mask") if sig.has_mask else None,
            logits=TensorBuffer.create_from_host_memory(array),
            logits_array=array,
            token_array=np.zeros(sig.rows, dtype=np.int32),
            pos_array=pos,
            pos_base=pos,
            tokens_capsule=tokens.capsule,
            pos_bound=True,
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
        # The wrapper's own write (`TensorBuffer.write` checks and converts its argument
        # first): the inputs of a decode step cost ~0.4 us instead of ~5.
        if n == 1:
            io.token_array[0] = tokens[0]
            io.pos_array[0] = pos
        else:
            io.token_array.fill(0)
            io.token_array[: len(tokens)] = tokens
            np.add(io.pos_base, pos, out=io.pos_array)
        self._write(io.tokens_capsule, io.token_array, "int32")
        if not io.pos_bound:
            self._write(io.input_pos.capsule, io.pos_array, "int32")
        if io.mask is not None:
            io.mask.write(causal_mask(n, pos, kv.window.length, sig.mask_shape))
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

    def _run_batch(
        self,
        sig: BatchSignature,
        owns: Sequence[_BoundKV],
        tokens: Sequence[int],
        positions: Sequence[int],
    ) -> None:
        io = self._batch_io[sig.key]
        io.token_array[:] = tokens
        io.pos_array[:] = positions
        self._write(io.tokens_capsule, io.token_array, "int32")
        inputs = {"tokens": io.tokens_capsule, "input_pos": io.input_pos.capsule}
        if io.mask is not None:
            io.mask.write(
                np.concatenate(
                    [causal_mask(1, p, sig.window, (1, 1, 1, sig.window)) for p in positions]
                )
            )
            inputs["mask"] = io.mask.capsule
        assert io.logits is not None
        outputs = {"logits": io.logits.capsule}
        # Each row binds its session's own buffers, in and out: the update happens in place.
        for b, own in enumerate(owns):
            if own.window.length != sig.window:
                raise ValueError(f"{sig.key} runs KV window {sig.window}, not {own.window.length}")
            for name, buf in own.buffers.items():
                inputs[row_kv_name(b, name)] = outputs[row_kv_name(b, name)] = buf.capsule
        try:
            self._model._model.RunByName(sig.key, inputs, outputs)
        except RuntimeError as exc:
            raise RuntimeFailure(f"{sig.key} failed: {exc}") from exc

    def _batch_logits(self, sig: BatchSignature) -> Logits:
        return self._batch_io[sig.key].logits_array

    def _logits(self, sig: Signature) -> Logits:
        io = self._io[sig.key]
        assert io.logits is not None  # discover_layout checked that decode outputs logits
        return io.logits_array

    def close(self) -> None:
        self._io.clear()
        self._batch_io.clear()
        self._model.close()
        self._release_cache_files()
