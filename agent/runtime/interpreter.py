"""The fallback execution path, and the path for TFLite external delegates: the classic
``Interpreter`` (ai-edge-litert's, or tflite-runtime's for ``runtime.backend =
"tflite-runtime"``).

The session's KV lives in our arrays; before a signature runs its input tensors are loaded
(only when another session or signature wrote since), and after it runs only the rows it wrote
are copied back. The KV cache never travels through a signature runner.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from agent.base.errors import RuntimeFailure
from agent.model.tflite.layout import ModelLayout, Signature
from agent.runtime.legacy import LEGACY_BACKEND
from agent.runtime.runner import Logits, RunnerBase, causal_mask

log = logging.getLogger("agent.runtime.litert")  # a load's lines keep the front door's name

# The Interpreter holds every signature's KV inputs and outputs in that signature's arena: a
# verify signature costs twice a session's KV (94 MiB on the SmolLM-135M shape at KV 1024).
# Beyond this much for all of them, the verify signatures are not opened (no speculation).
VERIFY_ARENA_MAX: Final = 32 << 20


@dataclass(slots=True)
class _HostKV:
    arrays: dict[str, npt.NDArray[np.float32]]
    nbytes: int
    version: int = 0
    # which signature's input tensors hold which version of this cache
    loaded: dict[str, int] = field(default_factory=dict)


class InterpreterRunner(RunnerBase[_HostKV]):
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

        super().__init__()
        # KV windows are for the CompiledModel path: the Interpreter allocates every signature's
        # KV inputs in its arena, so each window would cost its KV once per signature.
        self.layout = replace(layout, windows=())
        arena = 2 * layout.kv.bytes_per_session * len(layout.verify)
        if arena > VERIFY_ARENA_MAX:
            log.info(
                "verify signatures not opened on the Interpreter: their KV arenas would take "
                "%.0f MiB (speculation is off on this path for this model)",
                arena / (1 << 20),
            )
            self.layout = replace(self.layout, verify=())
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
        for sig in self.layout.full.signatures:
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
            self._view(key, ins["mask"])[...] = causal_mask(
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
