"""Held-out perplexity of a converted `.tflite`, by teacher forcing through ``decode``.

Every token of a window is fed to the ``decode`` signature at its position, the updated KV
cache is fed back, and the log-probability of the next true token is read from ``logits``.
That exercises exactly the graph the runtime runs (quantized kernels, KV layout, mask).

Windows: the held-out token stream is cut into documents at ``BOS`` and every document into
consecutive chunks of `window` tokens; `heldout_windows` picks chunks evenly spaced over the
whole set, so a small token budget still samples every part of the held-out data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from agent.toolchain.tokenizer import BOS_ID


def heldout_windows(
    stream: np.ndarray, *, window: int = 512, max_tokens: int = 4096, bos_id: int = BOS_ID
) -> list[np.ndarray]:
    """Deterministic evaluation windows with about `max_tokens` predicted tokens in total."""
    stream = np.asarray(stream, dtype=np.int64)
    starts = np.flatnonzero(stream == bos_id).tolist() or [0]
    if starts[0] != 0:
        starts.insert(0, 0)
    bounds = [*starts[1:], len(stream)]
    chunks = []
    for s, e in zip(starts, bounds, strict=True):
        for c in range(s, e, window):
            chunk = stream[c : min(c + window, e)]
            if len(chunk) >= 2:
                chunks.append(chunk)
    chunks = [c for c in chunks if len(c) == window] or chunks  # prefer full windows
    n = min(len(chunks), max(1, math.ceil(max_tokens / (window - 1))))
    idx = np.linspace(0, len(chunks) - 1, n).round().astype(int)
    out, total = [], 0
    for i in idx:
        c = chunks[i]
        if total + len(c) - 1 > max_tokens:
            c = c[: max_tokens - total + 1]
        if len(c) >= 2:
            out.append(c)
            total += len(c) - 1
        if total >= max_tokens:
            break
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class DecodeRunner:
    """Teacher-forcing helper over a `.tflite`'s ``decode`` signature (Interpreter API)."""

    def __init__(self, path: Path, *, num_threads: int = 2) -> None:
        from ai_edge_litert.interpreter import Interpreter

        self.interp = Interpreter(model_path=str(path), num_threads=num_threads)
        self.runner = self.interp.get_signature_runner("decode")
        details = self.runner.get_input_details()
        self.kv_names = sorted(n for n in details if n.startswith("kv_cache_"))
        self.kv_shapes = {n: tuple(details[n]["shape"]) for n in self.kv_names}
        self.mask_shape = tuple(details["mask"]["shape"]) if "mask" in details else None
        # default layout: K [1, kv_max, heads, dim]; transposed: K [1, heads, kv_max, dim]
        k0 = self.kv_shapes["kv_cache_k_0"]
        self.kv_max = max(k0[1], k0[2])

    def fresh_kv(self) -> dict[str, np.ndarray]:
        return {n: np.zeros(s, np.float32) for n, s in self.kv_shapes.items()}

    def step(self, token: int, pos: int, kv: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        feed = {
            "tokens": np.array([[token]], np.int32),
            "input_pos": np.array([pos], np.int32),
            **kv,
        }
        if self.mask_shape is not None:
            mask = np.full(self.mask_shape, -np.inf, np.float32)
            mask[..., : pos + 1] = 0.0
            feed["mask"] = mask
        out = self.runner(**feed)
        return out["logits"].reshape(-1), {n: out[n] for n in self.kv_names}

    def window_logits(self, window: Sequence[int]) -> np.ndarray:
        """Logits [len(window)-1, vocab] predicting window[1:] from window[:-1]."""
        if len(window) > self.kv_max:
            raise ValueError(f"window of {len(window)} tokens exceeds kv_max {self.kv_max}")
        kv = self.fresh_kv()
        rows = []
        for pos, tok in enumerate(window[:-1]):
            logits, kv = self.step(int(tok), pos, kv)
            rows.append(logits)
        return np.stack(rows)


def tflite_perplexity(
    path: Path, windows: Sequence[np.ndarray], *, num_threads: int = 2
) -> dict[str, float]:
    """``{"ppl", "nll" (nats/token), "tokens"}`` of `path` on `windows`."""
    dr = DecodeRunner(path, num_threads=num_threads)
    nll, n = 0.0, 0
    for w in windows:
        lp = _log_softmax(dr.window_logits(w))
        tgt = np.asarray(w[1:], dtype=np.int64)
        nll -= float(lp[np.arange(len(tgt)), tgt].sum())
        n += len(tgt)
    return {"ppl": math.exp(nll / n), "nll": nll / n, "tokens": n}


def torch_logits(spec, state_dict, window: Sequence[int]) -> np.ndarray:
    """Logits [len(window)-1, vocab] from the torch model (training forward, float32)."""
    import torch
    from litert_torch.generative.utilities import model_builder

    from agent.toolchain.config import to_model_config
    from agent.toolchain.train import train_forward

    model = model_builder.DecoderOnlyModel(to_model_config(spec, enable_hlfb=False), 0)
    model.load_state_dict(dict(state_dict), strict=False)
    model.eval()
    x = torch.tensor(np.asarray(window[:-1], dtype=np.int64))[None]
    with torch.no_grad():
        return train_forward(model, x)[0].numpy()


def check_tflite_matches_torch(
    fp32_path: Path, spec, state_dict, window: Sequence[int], *, num_threads: int = 2
) -> dict[str, float]:
    """Compare the float `.tflite` (decode, teacher forcing) with torch on one window."""
    window = np.asarray(window, dtype=np.int64)
    a = torch_logits(spec, state_dict, window)
    b = DecodeRunner(fp32_path, num_threads=num_threads).window_logits(window)
    tgt = window[1:]

    def ppl(logits: np.ndarray) -> float:
        lp = _log_softmax(logits)
        return math.exp(-float(lp[np.arange(len(tgt)), tgt].mean()))

    return {
        "tokens": len(tgt),
        "max_abs_diff": float(np.abs(a - b).max()),
        "max_logit": float(np.abs(a).max()),
        "torch_ppl": ppl(a),
        "tflite_ppl": ppl(b),
    }


def sample_tflite(
    path: Path,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 120,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    num_threads: int = 2,
) -> list[int]:
    """Sample a continuation through ``decode`` only (a reference loop for docs and checks)."""
    dr = DecodeRunner(path, num_threads=num_threads)
    rng = np.random.default_rng(seed)
    kv = dr.fresh_kv()
    ids = list(prompt_ids)
    logits = None
    for pos, tok in enumerate(ids):
        logits, kv = dr.step(int(tok), pos, kv)
    out: list[int] = []
    while len(out) < max_new_tokens and len(ids) < dr.kv_max:
        assert logits is not None
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            z = logits.astype(np.float64) / temperature
            if top_k:
                kth = np.partition(z, -top_k)[-top_k]
                z = np.where(z < kth, -np.inf, z)
            p = np.exp(z - z.max())
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        if nxt in stop_ids:
            break
        out.append(nxt)
        logits, kv = dr.step(nxt, len(ids), kv)
        ids.append(nxt)
    return out
