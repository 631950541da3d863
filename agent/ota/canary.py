"""The canary a new model must pass before it serves: it loads (the caller built the engine),
its first logits are finite, greedy tokens are in the vocabulary, and it matches the manifest's
expectation when there is one (the expected greedy tokens, or a checksum of the rounded first
logits)."""

from __future__ import annotations

import hashlib

import numpy as np

from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

DEFAULT_PROMPT = "def main():"
DEFAULT_TOKENS = 4


def logits_digest(logits: np.ndarray, decimals: int) -> str:
    """sha256 of float32 logits rounded to `decimals` (what a manifest's canary may pin)."""
    rounded = np.round(logits.astype(np.float64), decimals).astype(np.float32)
    return hashlib.sha256(rounded.tobytes()).hexdigest()


def expected_tokens(engine: Engine, prompt: str, n: int) -> list[int]:
    """The greedy tokens the canary compares with (`update make --canary-tokens` uses this)."""
    request = GenerateRequest(prompt, max_tokens=n, sampling=SamplingParams(0.0), stop=())
    return list(engine.complete(request).token_ids)


def check(engine: Engine, canary: opb.Canary | None) -> str | None:
    """None if `engine` passes, else the reason. Call before the engine serves: the first
    step runs on its runner directly."""
    prompt = canary.prompt if canary is not None and canary.prompt else DEFAULT_PROMPT
    want = list(canary.expected_tokens) if canary is not None else []
    runner, vocab = engine.loaded.runner, engine.tokenizer.vocab_size
    ids = engine.encode_prompt(GenerateRequest(prompt))
    kv = runner.new_kv()
    if len(ids) > 1:
        runner.prefill(kv, ids[:-1], 0)
    first = np.asarray(runner.decode(kv, ids[-1], len(ids) - 1))[:vocab]
    if not np.isfinite(first).all():
        bad = int((~np.isfinite(first)).sum())
        return f"the first logits have {bad} non-finite values"
    if canary is not None and canary.logits_sha256:
        digest = logits_digest(first, canary.logits_decimals or 3)
        if digest != canary.logits_sha256:
            want_digest = canary.logits_sha256[:12]
            return f"first-step logits checksum {digest[:12]}… != expected {want_digest}…"
    tokens = expected_tokens(engine, prompt, max(len(want), DEFAULT_TOKENS))
    if any(not 0 <= t < vocab for t in tokens):
        return f"generated tokens outside the vocabulary of {vocab}: {tokens}"
    if want and tokens[: len(want)] != want:
        return f"greedy tokens {tokens[: len(want)]} != expected {want}"
    return None
