"""Batched decode signatures: ``decode_batch_<B>`` runs one decode step for B sequences in one
pass over the weights, each row at its own position over its own KV cache.

Why this shape (issue 37, item 1):

* **Each row binds its own KV tensors** (``r<b>_kv_cache_k_<i>`` / ``r<b>_kv_cache_v_<i>``, in
  and out, shaped exactly like ``decode``'s), not one [B, ...] KV input. A request keeps the
  buffers it owns: the runner binds row b to that request's buffers, so nothing is copied when
  the set of rows changes, and sessions, tiers, spills and KV windows work on the same buffers
  as single-row decode. The cost is inputs: B x layers x 2 KV tensors (240 for a 30-layer model
  at B=4; LiteRT takes them), bound on each call (a map of 240 handles: microseconds against a
  step of milliseconds). One [B, ...] KV input would need the rows copied in and out whenever
  the set of running requests changes, and a second KV ownership model beside the sessions'.
* **The weight matmuls run over all rows at once** (embedding lookup, QKV and output
  projections, FFN, lm_head on [B, 1, dim]): that is the one pass over the weights the batch
  exists for.
* **What depends on the position is computed for all rows at once with decode's elementwise
  ops** (RoPE's cos/sin, the causal mask, the KV update's start index), **and only the KV update
  (DYNAMIC_UPDATE_SLICE at the row's position) and attention over the row's own cache run per
  row**, with decode's ops and shapes. Rows at different positions never share a mask.
* ``tokens`` [B, 1] int32, ``input_pos`` [B] int32 (row b's position), with
  ``mask_as_input`` a ``mask`` [B, 1, 1, kv_len]; ``logits`` [B, 1, vocab].

A row's logits must equal single-row ``decode``'s bit for bit, or batching would change a
request's tokens; the runtime checks that at the first load (`agent.runtime.batch`): XNNPACK's
kernels give the same bits (fp32 and dynamic-range int8, both KV layouts, measured), LiteRT's
builtin kernels do not.
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


def _batched_decoder(model: Any, rows: int) -> Any:
    """A module running `model`'s decode step for `rows` rows (see the module docstring)."""
    import torch
    from litert_torch.generative.custom_ops import dynamic_update_slice as dus
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.layers import scaled_dot_product_attention as sdpa
    from litert_torch.generative.layers import sdpa_with_kv_update

    config = model.config

    def rope_rows(x: Any, cos: Any, sin: Any) -> Any:
        """litert-torch's `apply_rope` on [rows, 1, heads, dim] with one position per row:
        the same elementwise ops, cos/sin [rows, 1, 1, half] broadcast over the heads."""
        x = x.transpose(1, 2)
        half = cos.size(-1)
        parts = torch.split(x, half, dim=-1)
        left = parts[0] * cos - parts[1] * sin
        right = parts[1] * cos + parts[0] * sin
        return torch.cat((left, right, *parts[2:]), dim=-1).transpose(1, 2).type_as(x)

    class BatchedDecode(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens: Any, input_pos: Any, mask: Any = None, **kvs: Any) -> Any:
            caches = [kvs[f"r{b}_kv_cache"] for b in range(rows)]
            kv_len = caches[0].get_max_seq_len()
            is_transposed = caches[0].caches[0].kv_layout == kv_utils.KV_LAYOUT_TRANSPOSED
            attn0 = config.block_config(0).attn_config
            n_elem = int(attn0.rotary_percentage * attn0.head_dim)
            # What decode computes from its one position, for all rows at once (elementwise)
            cos = sin = None
            if n_elem > 0:
                cos, sin = config.build_rope(input_pos, n_elem, attn0.rotary_base)  # [1, B, h]
                cos, sin = cos.reshape(rows, 1, 1, -1), sin.reshape(rows, 1, 1, -1)
            if mask is None:  # `export._decoder_class`'s mask, one row per sequence
                cols = torch.arange(kv_len, dtype=input_pos.dtype)
                allowed = cols.unsqueeze(0) <= input_pos.unsqueeze(1)  # [B, kv_len]
                zero = torch.zeros((), dtype=torch.float32)
                blocked = torch.full((), config.causal_mask_value, dtype=torch.float32)
                mask = torch.where(allowed, zero, blocked).reshape(rows, 1, 1, kv_len)
            masks = torch.split(mask, 1, dim=0)
            # the KV update's start indices, once per row (decode computes them per layer)
            at = input_pos.int()
            zero_i = torch.zeros((), dtype=torch.int)
            starts = [at[b : b + 1].reshape(()) for b in range(rows)]
            x = self.model.tok_embedding(tokens)  # [B, 1, dim]
            if config.embedding_scale is not None:
                x = x * config.embedding_scale
            new_entries: list[list[Any]] = [[] for _ in range(rows)]
            for i, block in enumerate(self.model.transformer_blocks):
                atten = block.atten_func
                acfg = atten.config
                x_norm = block.pre_atten_norm(x)
                qkv = atten.qkv_projection(x_norm)  # all rows: one pass over the weights
                q_per_kv = acfg.num_heads // acfg.num_query_groups
                groups = acfg.num_query_groups
                if acfg.qkv_transpose_before_split:
                    qkv = qkv.view(rows, 1, -1, acfg.head_dim)
                    q, k, v = qkv.split((q_per_kv * groups, groups, groups), dim=-2)
                else:
                    qkv = qkv.view(rows, 1, groups, -1)
                    q, k, v = qkv.split(
                        (q_per_kv * acfg.head_dim, acfg.head_dim, acfg.head_dim), dim=-1
                    )
                q = atten.query_norm(q).reshape(rows, 1, -1, acfg.head_dim)
                k = atten.key_norm(k).reshape(rows, 1, -1, acfg.head_dim)
                v = atten.value_norm(v).reshape(rows, 1, -1, acfg.head_dim)
                if cos is not None:
                    q, k = rope_rows(q, cos, sin), rope_rows(k, cos, sin)
                qs, ks, vs = (torch.split(t, 1, dim=0) for t in (q, k, v))
                outs = []
                for b in range(rows):  # per row: its own cache, decode's own ops
                    entry = caches[b].caches[i]
                    if is_transposed:
                        out, entry = _attend_transposed(
                            qs[b], ks[b], vs[b], entry, starts[b], zero_i, masks[b], acfg
                        )
                    else:
                        out, entry = sdpa_with_kv_update.sdpa_with_kv_update(
                            qs[b],
                            ks[b],
                            vs[b],
                            entry,
                            input_pos[b : b + 1],
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

    def _attend_transposed(
        query: Any, key: Any, value: Any, entry: Any, start: Any, zero: Any, mask: Any, acfg: Any
    ) -> Any:
        """litert-torch's `_sdpa_with_kv_update_transposed` for one row of one position, with
        the update's start indices computed once per row."""
        _, seq, n, h = query.shape
        g = n // acfg.num_query_groups
        query = query.permute(0, 2, 1, 3).reshape(1, acfg.num_query_groups, g * seq, h)
        key = key.permute(0, 2, 1, 3).reshape(1, -1, seq, acfg.head_dim)
        value = value.permute(0, 2, 3, 1).reshape(1, -1, acfg.head_dim, seq)
        k_cache = dus.dynamic_update_slice(entry.k_cache, key, [zero, zero, start, zero])
        v_cache = dus.dynamic_update_slice(entry.v_cache, value, [zero, zero, zero, start])
        out = sdpa.scaled_dot_product_attention_transposed(
            query, k_cache, v_cache, acfg.head_dim, mask=mask, softcap=acfg.logit_softcap
        )
        out = out.reshape(1, -1, seq, h).permute(0, 2, 1, 3).reshape(1, seq, -1)
        return out, kv_utils.KVCacheEntry(k_cache, v_cache, entry.kv_layout)

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
        mod = _batched_decoder(model, rows)
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
