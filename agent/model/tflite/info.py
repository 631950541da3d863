"""What a `.tflite` file holds, as edge-agent reads it without running it: its signatures'
tensors, its ops and its weights (`ModelFile`). Reading a file into one is
`agent.model.tflite.file.read_model_file`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_DTYPE_BITS = {
    "float32": 32,
    "float16": 16,
    "int32": 32,
    "uint8": 8,
    "int64": 64,
    "bool": 8,
    "int16": 16,
    "int8": 8,
    "float64": 64,
    "int4": 4,
    "bfloat16": 16,
    "uint4": 4,
    "uint32": 32,
    "uint16": 16,
    "int2": 2,
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= max(d, 1)
        return (n * _DTYPE_BITS.get(self.dtype, 32) + 7) // 8


@dataclass(frozen=True, slots=True)
class SignatureIO:
    key: str
    subgraph_index: int
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    # peak bytes of intermediate tensors alive at once, in operator order: what an arena that
    # reuses memory between tensors with disjoint lifetimes (TFLite's, XNNPACK's) must hold
    activation_bytes: int

    def input(self, name: str) -> TensorInfo | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorInfo | None:
        return next((t for t in self.outputs if t.name == name), None)


@dataclass(frozen=True, slots=True)
class ModelFile:
    path: Path
    size: int
    signatures: tuple[SignatureIO, ...]
    op_counts: tuple[tuple[str, int], ...]  # over the signature subgraphs
    composites: tuple[tuple[str, int], ...]  # STABLEHLO_COMPOSITE names and counts
    weights: tuple[tuple[str, str, int, int], ...]  # (op, weight kind, tensors, bytes)
    weight_bytes: int

    @property
    def fused(self) -> bool:
        return bool(self.composites)

    def signature(self, key: str) -> SignatureIO | None:
        return next((s for s in self.signatures if s.key == key), None)
