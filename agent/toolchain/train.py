"""Train a small litert-torch `DecoderOnlyModel` on a token stream (CPU, fp32).

Pitfalls handled here (FACTS.md):

* `DecoderOnlyModel.forward` runs under `torch.inference_mode`: training goes through the
  embedding, the transformer blocks, the final norm and the lm_head directly.
* RMSNorm weights are created with ``requires_grad=False``: they are switched on.
* The model is built with composites off (``enable_hlfb=False``): the composite attention
  rejects ``mask=None``, and without a mask the plain path uses PyTorch's causal SDPA.
  The state dict loads unchanged into a composite model for conversion.
* The lm_head is untied from the embedding (``lm_head_share_weight_with_embedding=False``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from agent import toolchain  # noqa: F401  (installs the tensorflow shim)
from agent.toolchain.config import DecoderSpec


@dataclass
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    steps: int | None = None  # fixed step count (reproducible); else a time budget:
    minutes: float = 20.0  # the cosine schedule follows elapsed/budget (adapts to a busy CPU)
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 200
    seed: int = 0
    threads: int = 2


def init_weights(model, spec: DecoderSpec) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.02
                if name.endswith(("output_projection.weight", "ff.w2.weight")):
                    std = 0.02 / math.sqrt(2 * spec.num_layers)
                p.normal_(0.0, std)
            elif "norm" in name:
                p.fill_(1.0)


def train_forward(model, tokens):
    """Logits [B, T, vocab] for `tokens` [B, T] (positions 0..T-1, causal)."""
    import torch

    _, t = tokens.shape
    input_pos = torch.arange(t, dtype=torch.int32)
    attn = model.config.block_config(0).attn_config
    n_elem = int(attn.rotary_percentage * attn.head_dim)
    rope = model.config.build_rope(input_pos, n_elem, attn.rotary_base)
    x = model.tok_embedding(tokens)
    for block in model.transformer_blocks:
        x = block(x, rope, None, input_pos, None)
    x = model.final_norm(x)
    return model.lm_head(x)


class Batches:
    """Random windows of ``seq_len + 1`` tokens from a token stream (seeded)."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if len(stream) <= seq_len + 1:
            raise ValueError(f"token stream of {len(stream)} is shorter than seq_len {seq_len}")
        self.stream = stream.astype(np.int64)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)

    def next(self):
        import torch

        starts = self.rng.integers(0, len(self.stream) - self.seq_len - 1, self.batch_size)
        win = np.stack([self.stream[s : s + self.seq_len + 1] for s in starts])
        w = torch.from_numpy(win)
        return w[:, :-1], w[:, 1:]


def fixed_eval_batches(stream: np.ndarray, seq_len: int, batch_size: int, n: int):
    """Deterministic, evenly spaced eval windows."""
    import torch

    total = batch_size * n
    span = len(stream) - seq_len - 1
    starts = np.linspace(0, max(span, 0), total).astype(np.int64)
    win = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    w = torch.from_numpy(win)
    return [
        (w[i : i + batch_size, :-1], w[i : i + batch_size, 1:]) for i in range(0, total, batch_size)
    ]


def evaluate(model, batches) -> float:
    """Mean cross-entropy (nats/token) over `batches`."""
    import torch
    import torch.nn.functional as F

    model.eval()
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            logits = train_forward(model, x)
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )
            tot += float(loss)
            cnt += y.numel()
    model.train()
    return tot / cnt


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warmup (by steps), then cosine decay to ``min_lr_ratio`` over `progress` 0..1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(0.0, progress))
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def save_checkpoint(path: Path, model, spec: DecoderSpec, stats: dict) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {k: v for k, v in model.state_dict().items() if "mask_cache" not in k}
    torch.save({"spec": spec.to_dict(), "state_dict": state, "stats": stats}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path):
    """(spec, state_dict, stats) of a checkpoint written by `save_checkpoint`."""
    import torch

    ck = torch.load(path, map_location="cpu", weights_only=True)
    return DecoderSpec.from_dict(ck["spec"]), ck["state_dict"], ck.get("stats", {})


def train(
    spec: DecoderSpec,
    train_stream: np.ndarray,
    eval_stream: np.ndarray,
    out_path: Path,
    cfg: TrainConfig,
    log=print,
) -> dict:
    """Train and write a checkpoint to `out_path`; returns training statistics."""
    import torch
    import torch.nn.functional as F
    from litert_torch.generative.utilities import model_builder

    from agent.toolchain.config import to_model_config

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mcfg = to_model_config(spec, enable_hlfb=False)
    model = model_builder.DecoderOnlyModel(mcfg, mask_cache_size=0)
    for p in model.parameters():
        p.requires_grad_(True)
    init_weights(model, spec)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters; spec {spec.to_dict()}")
    log(f"train config: {asdict(cfg)}")
    log(f"train tokens {len(train_stream):,}, eval tokens {len(eval_stream):,}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=1e-8,
    )
    batches = Batches(train_stream, cfg.seq_len, cfg.batch_size, cfg.seed)
    eval_batches = fixed_eval_batches(eval_stream, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    tokens_per_step = cfg.seq_len * cfg.batch_size

    budget = cfg.minutes * 60
    total = cfg.steps if cfg.steps is not None else 10**9
    history = []
    t0 = time.monotonic()
    eval_time = 0.0
    step = 0
    loss_ema = None
    while step < total:
        if cfg.steps is not None:
            progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        else:
            progress = (time.monotonic() - t0 - eval_time) / budget
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, cfg)
        x, y = batches.next()
        logits = train_forward(model, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        lv = float(loss.detach())
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
        elapsed = time.monotonic() - t0 - eval_time
        if cfg.steps is None and elapsed >= budget:
            total = step  # time is up: final eval + checkpoint below
        if step % 20 == 0 or step == total:
            shown_total = total if total < 10**9 else "?"
            rate = step * tokens_per_step / max(elapsed, 1e-9)
            log(
                f"step {step}/{shown_total} loss {lv:.3f} (ema {loss_ema:.3f}) "
                f"lr {opt.param_groups[0]['lr']:.2e} gnorm {float(gnorm):.2f} "
                f"{rate:,.0f} tok/s elapsed {elapsed / 60:.1f} min"
            )
        if step % cfg.eval_every == 0 or step == total:
            te = time.monotonic()
            ev = evaluate(model, eval_batches)
            eval_time += time.monotonic() - te
            history.append({"step": step, "train_loss_ema": loss_ema, "eval_loss": ev})
            log(f"eval step {step}: held-out loss {ev:.4f} (ppl {math.exp(ev):.2f})")
        if step % cfg.checkpoint_every == 0 or step == total:
            stats = {
                "steps": step,
                "tokens": step * tokens_per_step,
                "train_seconds": time.monotonic() - t0 - eval_time,
                "params": n_params,
                "history": history,
                "config": asdict(cfg),
                "final_train_loss_ema": loss_ema,
            }
            save_checkpoint(out_path, model, spec, stats)
    stats["wall_seconds"] = time.monotonic() - t0
    save_checkpoint(out_path, model, spec, stats)
    (out_path.parent / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    minutes = stats["train_seconds"] / 60
    log(f"done: {step} steps, {step * tokens_per_step:,} tokens, {minutes:.1f} min")
    return stats
