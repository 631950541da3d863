"""Post-conversion weight quantization of a float `.tflite` with ai-edge-quantizer.

litert-torch itself quantizes the same way: it converts to float, translates its generative
recipe (`quant_recipes.full_dynamic_recipe`) into an ai-edge-quantizer recipe and runs
`ai_edge_quantizer.Quantizer` on the flatbuffer. Doing it here, after one float conversion,
lets every variant of a model share a single (slow) conversion and gives access to block 64
and to custom (mixed) recipes that litert-torch's `quantize=` names do not cover.

Quantization names (as in `agent.model.directory.QUANTIZATIONS`):

* ``fp32``: no quantization.
* ``int8``: dynamic-range int8 weights, per output channel (litert-torch ``dynamic_int8``).
* ``int4_block32`` / ``int4_block64`` / ``int4_block128``: dynamic-range int4 weights,
  blockwise along the input dimension (the input dims must be divisible by the block).
* ``mixed``: int8 per channel everywhere except the token embedding and the attention
  output projections, which stay float32 (see `MIXED_FLOAT_RULES`).
* ``int8_weight_only``: int8 weights per output channel, dequantized to float when the model
  loads (``DEQUANTIZE`` ops, float compute): the int8 variant the legacy tflite-runtime
  backend runs correctly (its dynamic-range per-channel FULLY_CONNECTED computes zeros).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent import toolchain  # noqa: F401  (installs the tensorflow shim)
from agent.model.directory import QUANTIZATIONS
from agent.toolchain.config import DecoderSpec

#: Regexes (matched by ai-edge-quantizer against op output tensor names, last match wins) of the
#: ops that the ``mixed`` recipe keeps float. litert-torch names tensors after the module path:
#: ``.../Embedding_tok_embedding/...`` for the embedding lookup and
#: ``.../CausalSelfAttention_atten_func/Linear_output_projection/...`` for the attention output
#: projection.
MIXED_FLOAT_RULES = (
    r"Embedding_tok_embedding",
    r"Linear_output_projection",
)


def block_size(quantization: str) -> int | None:
    if quantization.startswith("int4_block"):
        return int(quantization.removeprefix("int4_block"))
    return None


def check_block_divides(spec: DecoderSpec, quantization: str) -> None:
    """Raise ValueError if a blockwise quantization does not fit the model's dims."""
    block = block_size(quantization)
    if block is None:
        return
    bad = {k: v for k, v in spec.quantizable_input_dims().items() if v % block}
    if bad:
        raise ValueError(f"{quantization}: block size {block} does not divide the input dims {bad}")


def ai_edge_recipe(quantization: str, spec: DecoderSpec | None = None) -> list[dict[str, Any]]:
    """The ai-edge-quantizer recipe (a list of rules) for a quantization name."""
    from litert_torch.generative.quantize import quant_attrs, quant_recipes
    from litert_torch.quantize import translate_recipe

    if quantization not in QUANTIZATIONS or quantization == "fp32":
        raise ValueError(f"no recipe for {quantization!r}; allowed: {QUANTIZATIONS[1:]}")
    mcfg = None
    if spec is not None:
        from agent.toolchain.config import to_model_config

        check_block_divides(spec, quantization)
        mcfg = to_model_config(spec)
    if quantization in ("int8", "mixed", "int8_weight_only"):
        gran = quant_attrs.Granularity.CHANNELWISE
        dtype = quant_attrs.Dtype.INT8
    else:
        gran = getattr(quant_attrs.Granularity, f"BLOCKWISE_{block_size(quantization)}")
        dtype = quant_attrs.Dtype.INT4
    recipe_of = (
        quant_recipes.full_weight_only_recipe
        if quantization == "int8_weight_only"
        else quant_recipes.full_dynamic_recipe
    )
    qc = recipe_of(mcfg=mcfg, weight_dtype=dtype, granularity=gran)
    recipe = list(translate_recipe.translate_to_ai_edge_recipe(qc.generative_recipe))
    if quantization == "mixed":
        for regex in MIXED_FLOAT_RULES:
            recipe.append(
                {
                    "regex": regex,
                    "operation": "*",
                    "algorithm_key": "no_quantize",
                }
            )
    return recipe


def quantize_bytes(model: bytes, quantization: str, spec: DecoderSpec | None = None) -> bytes:
    """Quantize a float flatbuffer; returns the new flatbuffer."""
    if quantization == "fp32":
        return model
    from ai_edge_quantizer import quantizer

    recipe = ai_edge_recipe(quantization, spec)
    qt = quantizer.Quantizer(bytearray(model), recipe)
    return bytes(qt.quantize().quantized_model)


def quantize_file(
    fp32_path: Path, out_path: Path, quantization: str, spec: DecoderSpec | None = None
) -> Path:
    """Write the `quantization` variant of a float `.tflite` to `out_path`."""
    t0 = time.monotonic()
    data = quantize_bytes(fp32_path.read_bytes(), quantization, spec)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out_path)
    print(
        f"[toolchain] quantized {quantization}: {out_path.name} "
        f"{len(data) / 1e6:.2f} MB in {time.monotonic() - t0:.1f}s",
        flush=True,
    )
    return out_path
