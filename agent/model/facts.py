"""What a model directory records about a `.tflite` that only the file itself can say: the
quantization of its weights and its context length (the KV cache's length).

Used by `model import` and the `.litertlm` reader, so that neither a file's name ("q8",
"ekv1280") nor a hand-written metadata file decides what the runtime is told.
"""

from __future__ import annotations

from agent.base.errors import ModelFormatError
from agent.model.tflite.info import ModelFile
from agent.model.tflite.layout import ModelLayout, discover_layout

# Ops whose constant operands are the model's weight matrices (DEQUANTIZE: weight-only
# quantization, the weights are widened to float when the model loads).
_WEIGHT_OPS = frozenset(
    {
        "FULLY_CONNECTED",
        "BATCH_MATMUL",
        "CONV_2D",
        "DEPTHWISE_CONV_2D",
        "EMBEDDING_LOOKUP",
        "GATHER",
        "DEQUANTIZE",
    }
)


def _family(op: str, kind: str) -> str:
    """One weight entry's quantization name, as `agent.model.directory.QUANTIZATIONS` spells it."""
    if op == "DEQUANTIZE":
        if kind == "float16":
            return "fp16"
        return "int8_weight_only" if kind.startswith("int8") else f"weight-only {kind}"
    if kind in ("float32", "float16"):
        return "fp32" if kind == "float32" else "fp16"
    if kind.startswith("int8 "):
        return "int8"
    if kind.startswith("int4 block"):
        return "int4_block" + kind.removeprefix("int4 block")
    return kind


def quantization_of(model: ModelFile) -> str:
    """The quantization name of a model file, read from its weight tensors.

    One kind of weight matrix throughout gives its name (``fp32``, ``fp16``, ``int8``,
    ``int8_weight_only``, ``int4_block32/64/128``); more than one kind (int8 with float
    embeddings, int4 with int8, ...) or a kind without a name of its own is ``mixed``.
    """
    from agent.model.directory import QUANTIZATIONS

    families = {_family(op, kind) for op, kind, _, _ in model.weights if op in _WEIGHT_OPS}
    if not families:
        raise ModelFormatError(f"{model.path}: no weight tensors found")
    if len(families) == 1:
        (only,) = families
        if only in QUANTIZATIONS:
            return only
    return "mixed"


def context_length_of(model: ModelFile, hint: int | None = None) -> tuple[int, ModelLayout]:
    """The KV length of an exported LLM (and its layout), from the decode signature's KV shape.

    K and V of one shape ``[1, a, b, b]`` are either the default layout with ``a`` rows or the
    transposed one with ``b``: there `hint` (a length the bundle or config names) or else the
    decode mask's length decides, and a file where neither does is refused, not guessed.
    Elsewhere the shape alone decides and `hint` is not used (a bundle may cap its context
    below the KV length).
    """
    layout = discover_layout(model, None)
    k, v = layout.kv.k_shape, layout.kv.v_shape
    if k == v and k[2] == k[3] and k[1] != k[2]:
        mask = layout.decode.mask_shape
        candidates = (hint, mask[-1] if layout.decode.has_mask and mask else None)
        chosen = next((c for c in candidates if c in (k[1], k[2])), None)
        if chosen is None:
            raise ModelFormatError(
                f"{model.path}: the KV shape {list(k)} holds either {k[1]} rows (default "
                f"layout) or {k[2]} (transposed layout), and nothing in the model tells which"
            )
        layout = discover_layout(model, chosen)
    return layout.context_length, layout
