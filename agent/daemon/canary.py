"""The update canary's `Model` built from an engine: agent.ota.canary takes callables and never
imports the engine, so the daemon builds them here. The daemon checks a new model with it
before it serves, and a serving one after an update; `update make` borrows it to record and
check a canary (docs/UPDATES.md, the canary)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.ota.canary import Model, Step


def engine_model(engine: Engine) -> Model:
    """The canary's view of `engine`: its tokenizer's vocabulary, its prompt encoding, its greedy
    completion, and its runner driven directly (the first logits after a prompt, one decode
    step at a time on a fresh KV)."""

    def encode(text: str) -> list[int]:
        return engine.encode_prompt(GenerateRequest(text))

    def greedy(prompt: str, n: int) -> tuple[list[int], str]:
        request = GenerateRequest(prompt, max_tokens=n, sampling=SamplingParams(0.0), stop=())
        done = engine.complete(request)
        return list(done.token_ids), done.text

    def first_logits(ids: Sequence[int]) -> npt.NDArray[np.float32]:
        runner = engine.loaded.runner
        kv = runner.new_kv()
        if len(ids) > 1:
            runner.prefill(kv, ids[:-1], 0)
        return runner.decode(kv, ids[-1], len(ids) - 1)

    def steps(n: int) -> Step:
        runner = engine.loaded.runner
        kv = runner.new_kv()
        runner.reserve(kv, n, 0)
        return lambda token, pos: runner.decode(kv, token, pos)

    return Model(
        vocab_size=engine.tokenizer.vocab_size,
        encode=encode,
        greedy=greedy,
        first_logits=first_logits,
        steps=steps,
    )
