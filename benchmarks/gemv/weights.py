"""What a GEMV chain file holds: its op counts and the bytes of its FULLY_CONNECTED weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _block_scales(sg: Any, tensor: Any) -> tuple[int, int, str] | None:
    """(scale count, block size, scale dtype) of a blockwise-quantized weight, else None.
    ai-edge-quantizer writes block scales as a separate [out, in/block] tensor."""
    from agent.model.tflite.schema import schema

    q = tensor.Quantization()
    kind = getattr(schema.QuantizationDetails, "BlockwiseQuantization", None)
    if q is None or kind is None or q.DetailsType() != kind:
        return None
    table = q.Details()
    details = schema.BlockwiseQuantization()
    details.Init(table.Bytes, table.Pos)
    st = sg.Tensors(details.Scales())
    dtype = {v: k for k, v in vars(schema.TensorType).items() if isinstance(v, int)}[st.Type()]
    return int(np.prod(st.ShapeAsNumpy())), details.BlockSize(), dtype.lower()


def inspect_model(path: Path) -> dict[str, Any]:
    """Op counts and the bytes of the FULLY_CONNECTED weights, read from the file's tensors.

    ``weight_bytes``: the quantized weight tensors (int8: 1 byte a parameter; int4: 2 a byte)
    plus, for blockwise weights, 2 bytes per block scale (the file holds them as an fp16
    tensor [out, in/32]; XNNPACK's blockwise kernels read 16-bit scales too). Per-channel
    scales (int8: one fp32 per output channel, ~0.6% more) are not counted, as in the
    roofline of bench_peer (`benchmarks/peer/roofline.py`).
    """
    from agent.model.tflite.file import read_model_file
    from agent.model.tflite.schema import schema

    info = read_model_file(path)
    model = schema.Model.GetRootAs(path.read_bytes(), 0)
    tensor_bytes = params = scales = 0
    kinds: set[str] = set()
    for s in range(model.SubgraphsLength()):
        sg = model.Subgraphs(s)
        for o in range(sg.OperatorsLength()):
            op = sg.Operators(o)
            code = model.OperatorCodes(op.OpcodeIndex())
            opcode = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
            if opcode != schema.BuiltinOperator.FULLY_CONNECTED:
                continue
            t = sg.Tensors(op.Inputs(1))
            n = int(np.prod(t.ShapeAsNumpy()))
            bits = {schema.TensorType.INT4: 4, schema.TensorType.INT8: 8}.get(t.Type(), 32)
            params += n
            tensor_bytes += n * bits // 8
            block = _block_scales(sg, t)
            if block is not None:
                scales += block[0]
                kinds.add(f"int{bits} block{block[1]}, {block[2]} scales")
            else:
                q = t.Quantization()
                per_channel = q is not None and q.ScaleLength() > 1
                kinds.add(f"int{bits} per-channel" if per_channel else f"{bits}-bit")
    return {
        "ops": dict(info.op_counts),
        "params": params,
        "weight_kinds": sorted(kinds),
        "weight_tensor_bytes": tensor_bytes,
        "block_scales": scales,
        "weight_bytes": tensor_bytes + 2 * scales,
        "file_bytes": info.size,
    }
