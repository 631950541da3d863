"""The tflite-runtime backend (``runtime.backend = "tflite-runtime"``): which models it can run.

tflite-runtime 2.14 has only the Interpreter (no CompiledModel) and older kernels; a model it
would run wrongly is refused before the interpreter sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from agent.base.errors import ModelFormatError
from agent.model.tflite.info import ModelFile
from agent.model.tflite.layout import ModelLayout

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
