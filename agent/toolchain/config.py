"""Architecture of the decoders the toolchain builds, independent of torch.

`DecoderSpec` is a small, JSON-serializable description (saved next to checkpoints);
`to_model_config` turns it into litert-torch's `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DecoderSpec:
    """A Llama-style decoder: RMSNorm, RoPE, GQA attention, gated SiLU FFN, untied lm_head."""

    vocab_size: int = 4096
    num_layers: int = 4
    embedding_dim: int = 256
    num_heads: int = 4
    num_query_groups: int = 1
    intermediate_size: int = 768
    max_seq_len: int = 1024
    rotary_base: int = 10_000
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.embedding_dim // self.num_heads

    def __post_init__(self) -> None:
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"embedding_dim {self.embedding_dim} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_query_groups:
            raise ValueError(
                f"num_heads {self.num_heads} is not divisible by "
                f"num_query_groups {self.num_query_groups}"
            )

    def param_count(self) -> int:
        """Trainable parameters (norm weights included, they are tiny)."""
        d, h = self.embedding_dim, self.head_dim
        qkv = d * (self.num_heads + 2 * self.num_query_groups) * h
        out = self.num_heads * h * d
        ff = 3 * d * self.intermediate_size
        per_layer = qkv + out + ff + 2 * d
        return 2 * self.vocab_size * d + self.num_layers * per_layer + d

    def quantizable_input_dims(self) -> dict[str, int]:
        """Input (reduction) dimension of every weight matrix, by role.

        Blockwise quantization splits this dimension into blocks, so it must be divisible by
        the block size.
        """
        return {
            "qkv_projection": self.embedding_dim,
            "output_projection": self.num_heads * self.head_dim,
            "ff_w1_w3": self.embedding_dim,
            "ff_w2": self.intermediate_size,
            "lm_head": self.embedding_dim,
            "embedding": self.embedding_dim,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DecoderSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> DecoderSpec:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


#: The demo model (FACTS.md: ~5.1M parameters, ~5,100 tokens/s training on 2 cores).
DEMO_SPEC = DecoderSpec()

#: A tiny random-weight decoder for tests: every block size (32/64/128) divides its dims.
TINY_SPEC = DecoderSpec(
    vocab_size=256,
    num_layers=2,
    embedding_dim=128,
    num_heads=4,
    num_query_groups=1,
    intermediate_size=256,
    max_seq_len=1024,
)

#: SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M config.json: 30 layers, width 576, 9 heads
#: over 3 KV groups, FFN 1536, vocabulary 49,152), with random weights: the "larger model" of
#: the benchmarks (issues 4 and 7). Our decoder unties the lm_head, so it has ~163M parameters.
SMOLLM_135M_SPEC = DecoderSpec(
    vocab_size=49_152,
    num_layers=30,
    embedding_dim=576,
    num_heads=9,
    num_query_groups=3,
    intermediate_size=1536,
    max_seq_len=2048,
)

PRESETS = {"demo": DEMO_SPEC, "tiny": TINY_SPEC, "smollm-135m": SMOLLM_135M_SPEC}


def to_model_config(spec: DecoderSpec, *, enable_hlfb: bool = True, kv_max: int | None = None):
    """litert-torch `ModelConfig` for `spec` (imports litert_torch)."""
    import litert_torch.generative.layers.model_config as cfg

    from agent import toolchain  # noqa: F401  (installs the tensorflow shim)

    max_seq_len = max(spec.max_seq_len, kv_max or 0)
    attn = cfg.AttentionConfig(
        num_heads=spec.num_heads,
        head_dim=spec.head_dim,
        num_query_groups=spec.num_query_groups,
        rotary_base=spec.rotary_base,
        rotary_percentage=1.0,
    )
    ff = cfg.FeedForwardConfig(
        type=cfg.FeedForwardType.GATED,
        activation=cfg.ActivationConfig(cfg.ActivationType.SILU),
        intermediate_size=spec.intermediate_size,
    )
    norm = cfg.NormalizationConfig(
        type=cfg.NormalizationType.RMS_NORM, epsilon=spec.norm_eps, enable_hlfb=enable_hlfb
    )
    block = cfg.TransformerBlockConfig(
        attn_config=attn,
        ff_config=ff,
        pre_attention_norm_config=norm,
        post_attention_norm_config=norm,
    )
    return cfg.ModelConfig(
        vocab_size=spec.vocab_size,
        num_layers=spec.num_layers,
        max_seq_len=max_seq_len,
        embedding_dim=spec.embedding_dim,
        block_configs=block,
        final_norm_config=norm,
        lm_head_share_weight_with_embedding=False,
        enable_hlfb=enable_hlfb,
    )
