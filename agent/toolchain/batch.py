"""Batched decode signatures: ``decode_batch_<B>`` runs one decode step for B sequences in one
pass over the weights, each row at its own position over its own KV cache.

Why this shape (issue 37, item 1):

* **Each row binds its own KV tensors** (``r<b>_kv_cache_k_<i>`` / ``r<b>_kv_cache_v_<i>``, in
  and out, shaped exactly like ``decode``'s), not one [B, ...] KV input. A request keeps the
  buffers it owns: the runner binds row b to that request's buffers, so nothing is copied when
  the set of rows changes, and sessions, tiers, spills and KV windows work on the same buffers
  as single-row decode. The cost is inputs: B x layers x 2 KV tensors (240 for a 30-layer model
  at B=4), bound once per set of rows (the capsule maps are cached like decode's).
* **The weight matmuls run over all rows at once** (embedding lookup, QKV and output
  projections, FFN, lm_head on [B, 1, dim]): that is the one pass over the weights the batch
  exists for. Decode is bandwidth-bound, so B rows cost little more than one.
* **Everything position-dependent runs per row, with decode's own ops and shapes**: RoPE from
  the row's ``input_pos``, its causal mask, the KV update (DYNAMIC_UPDATE_SLICE at its
  position) and attention over its own cache. Rows at different positions never share a mask.
* ``tokens`` [B, 1] int32, ``input_pos`` [B] int32 (row b's position), with
  ``mask_as_input`` a ``mask`` [B, 1, 1, kv_len]; ``logits`` [B, 1, vocab].

A row's logits must equal single-row ``decode``'s bit for bit, or batching would change a
request's tokens; the runtime checks that at the first load (`agent.runtime.batchcheck`).
Files without these signatures decode one request at a time, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BATCH_PREFIX = "decode_batch_"


def row_kv_name(row: int, name: str) -> str:
    """The batch signature's input/output name of row `row`'s KV tensor `name`
    (``kv_cache_k_0`` -> ``r1_kv_cache_k_0``)."""
    return f"r{row}_{name}"


def _batched_decoder(model: Any, rows: int, export_config: Any) -> Any:
    """A module running `model`'s decode step for `rows` rows (see the module docstring)."""
    import torch
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.layers import rotary_position_embedding as rotary
    from litert_torch.generative.layers import sdpa_with_kv_update

    config = model.config

    class BatchedDecode(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def _mask(self, pos: Any, kv_len: int) -> Any:
            # what `export._decoder_class` computes for one position
            cols = torch.arange(kv_len, dtype=pos.dtype)
            allowed = cols.unsqueeze(0) <= pos.unsqueeze(1)
            zero = torch.zeros((), dtype=torch.float32)
            blocked = torch.full((), config.causal_mask_value, dtype=torch.float32)
            return torch.where(allowed, zero, blocked).unsqueeze(0).unsqueeze(0)

        def forward(self, tokens: Any, input_pos: Any, mask: Any = None, **kvs: Any) -> Any:
            caches = [kvs[f"r{b}_kv_cache"] for b in range(rows)]
            kv_len = caches[0].get_max_seq_len()
            attn0 = config.block_config(0).attn_config
            n_elem = int(attn0.rotary_percentage * attn0.head_dim)
            pos = [input_pos[b : b + 1] for b in range(rows)]
            ropes = [config.build_rope(p, n_elem, attn0.rotary_base) for p in pos]
            if mask is None:
                masks = [self._mask(p, kv_len) for p in pos]
            else:
                masks = [mask[b : b + 1] for b in range(rows)]
            x = self.model.tok_embedding(tokens)  # [B, 1, dim]
            if config.embedding_scale is not None:
                x = x * config.embedding_scale
            new_entries: list[list[Any]] = [[] for _ in range(rows)]
            for i, block in enumerate(self.model.transformer_blocks):
                if block.config.parallel_residual:
                    raise ValueError("batched decode: parallel residual blocks are not supported")
                atten = block.atten_func
                acfg = atten.config
                x_norm = block.pre_atten_norm(x)
                qkv = atten.qkv_projection(x_norm)  # all rows: one pass over the weights
                q_per_kv = acfg.num_heads // acfg.num_query_groups
                if acfg.qkv_transpose_before_split:
                    qkv = qkv.view(rows, 1, -1, acfg.head_dim)
                    groups = acfg.num_query_groups
                    q, k, v = qkv.split((q_per_kv * groups, groups, groups), dim=-2)
                else:
                    qkv = qkv.view(rows, 1, acfg.num_query_groups, -1)
                    q, k, v = qkv.split(
                        (q_per_kv * acfg.head_dim, acfg.head_dim, acfg.head_dim), dim=-1
                    )
                q = atten.query_norm(q).reshape(rows, 1, -1, acfg.head_dim)
                k = atten.key_norm(k).reshape(rows, 1, -1, acfg.head_dim)
                v = atten.value_norm(v).reshape(rows, 1, -1, acfg.head_dim)
                outs = []
                for b in range(rows):  # per row: decode's own ops at the row's position
                    qb, kb, vb = q[b : b + 1], k[b : b + 1], v[b : b + 1]
                    cos, sin = ropes[b]
                    if cos is not None:
                        qb, kb = rotary.apply_rope_inline(qb, kb, cos, sin)
                    out, entry = sdpa_with_kv_update.sdpa_with_kv_update(
                        qb,
                        kb,
                        vb,
                        caches[b].caches[i],
                        pos[b],
                        masks[b],
                        acfg,
                        atten.enable_hlfb,
                    )
                    outs.append(out)
                    new_entries[b].append(entry)
                x = x + atten.output_projection(torch.cat(outs, dim=0))
                x = x + block.ff(block.post_atten_norm(x))
            logits = self.model.lm_head(self.model.final_norm(x))  # [B, 1, vocab]
            result: dict[str, Any] = {"logits": logits}
            for b in range(rows):
                result[f"r{b}_kv_cache"] = kv_utils.KVCache(tuple(new_entries[b]))
            return result

    del export_config  # the layout is carried by the KV caches passed in
    return BatchedDecode().eval()


def check_supported(model: Any) -> None:
    """Refuse, naming why, a decoder whose blocks the batched step does not reproduce."""
    cfg = model.config
    for i in range(cfg.num_layers):
        block = cfg.block_config(i)
        if block.parallel_residual:
            raise ValueError(f"batched decode: block {i} uses a parallel residual")
        if block.attn_config.use_alibi:
            raise ValueError(f"batched decode: block {i} uses ALiBi")
        if block.attn_config.logit_softcap is not None:
            raise ValueError(f"batched decode: block {i} uses a logit softcap")


def add_batch_signatures(
    conv: Any,
    model: Any,
    export_config: Any,
    sizes: Sequence[int],
    kv_len: int,
    prefix: str = "",
) -> None:
    """Add ``<prefix>decode_batch_<B>`` for each B in `sizes` to litert-torch converter `conv`,
    over KV caches of `kv_len` rows in `export_config`'s layout."""
    import torch
    from litert_torch.generative.layers import kv_cache as kv_utils

    check_supported(model)
    for rows in sizes:
        mod = _batched_decoder(model, rows, export_config)
        sample: dict[str, Any] = {
            "tokens": torch.zeros((rows, 1), dtype=torch.int),
            "input_pos": torch.zeros((rows,), dtype=torch.int),
        }
        if export_config.mask_as_input:
            sample["mask"] = torch.zeros((rows, 1, 1, kv_len), dtype=torch.float32)
        for b in range(rows):
            sample[f"r{b}_kv_cache"] = kv_utils.KVCache.from_model_config(
                kv_len, model.config, kv_layout=export_config.kvcache_layout
            )
        conv.add_signature(f"{prefix}{BATCH_PREFIX}{rows}", mod, sample_kwargs=sample)
