"""The GEMV chain: SmolLM-135M's weight matrices as our export writes them, converted with
litert-torch and quantized with the toolchain's `quantize_bytes`, built once and cached."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks._report import ROOT

GEMV_DIR = ROOT / ".cache" / "models" / "gemv"
QUANTS = ("int8", "int4_block32")
DIM = 576
Q, KV = 576, 192  # q's and each of k's and v's outputs
LAYER_SHAPES = {  # name: (in, out), as in SmolLM-135M exported by the toolchain
    "qkv": (576, Q + 2 * KV),
    "o": (576, 576),
    "gate": (576, 1536),
    "up": (576, 1536),
    "down": (1536, 576),
}
LAYERS = 30
VOCAB = 49152
SEED = 0


def _chain_module(layers: int) -> Any:
    """The torch module: per layer ``q, k, v = qkv(x)``, ``x = o(q + cat(k, v, k))``, then
    ``x = down(gate(x) + up(x))``; ``logits = head(x)``. Every weight is used once."""
    import torch
    from torch import nn

    def linear(shape: tuple[int, int], summed: bool) -> nn.Linear:
        fan_in, fan_out = shape
        lin = nn.Linear(fan_in, fan_out, bias=False)
        # unit-variance activations through the chain (two summed branches: half each)
        std = (fan_in * (2 if summed else 1)) ** -0.5
        with torch.no_grad():
            lin.weight.normal_(0.0, std)
        return lin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.ModuleDict(
                {n: linear(s, summed=n not in ("o", "down")) for n, s in LAYER_SHAPES.items()}
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.w
            q, k, v = w["qkv"](x).split([Q, KV, KV], dim=-1)
            x = w["o"](q + torch.cat([k, v, k], dim=-1))
            return w["down"](w["gate"](x) + w["up"](x))  # type: ignore[no-any-return]

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = linear((DIM, VOCAB), summed=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)  # type: ignore[no-any-return]

    torch.manual_seed(SEED)
    return Chain().eval()


def param_count(layers: int = LAYERS) -> int:
    per_layer = sum(i * o for i, o in LAYER_SHAPES.values())
    return layers * per_layer + DIM * VOCAB


def _install_toolchain_shim() -> None:
    """Importing `agent.toolchain` puts the tensorflow stand-in litert-torch needs on the path."""
    from agent import toolchain  # noqa: F401


def _convert_fp32(out: Path, layers: int) -> Path:
    """The float `.tflite` (cached): litert-torch's conversion of the chain."""
    if out.exists():
        return out
    _install_toolchain_shim()
    import litert_torch
    import torch

    t0 = time.monotonic()
    model = _chain_module(layers)
    edge = litert_torch.convert(model, (torch.zeros(1, DIM, dtype=torch.float32),))
    _write_atomic(out, edge.model_content())
    print(f"[gemv] converted {out.name}: {out.stat().st_size / 1e6:.1f} MB "
          f"in {time.monotonic() - t0:.1f}s", flush=True)  # fmt: skip
    return out


def _write_atomic(out: Path, data: bytes) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)


def model_path(quant: str, out_dir: Path, layers: int = LAYERS) -> Path:
    return out_dir / f"gemv_qkv_l{layers}_{quant}.tflite"


def build(quant: str, out_dir: Path, layers: int = LAYERS) -> Path:
    """The `quant` variant of the GEMV chain in `out_dir` (built once, then cached)."""
    out = model_path(quant, out_dir, layers)
    if out.exists():
        return out
    from agent.toolchain.quantize import quantize_bytes

    fp32 = _convert_fp32(out_dir / f"gemv_qkv_l{layers}_fp32.tflite", layers)
    t0 = time.monotonic()
    _write_atomic(out, quantize_bytes(fp32.read_bytes(), quant))
    print(f"[gemv] quantized {out.name}: {out.stat().st_size / 1e6:.1f} MB "
          f"in {time.monotonic() - t0:.1f}s", flush=True)  # fmt: skip
    return out
