"""The first-load check of what the runtime runs instead of a model file as it was exported (a
prepared copy, or an accelerator link that runs the file differently): it must compute what
the original file computes on its reference path. The outcome is kept beside the prepared copy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from agent.base.errors import AgentError
from agent.model.tflite.info import ModelFile
from agent.model.tflite.layout import ModelLayout

log = logging.getLogger(__name__)

DECODE_STEPS = 4  # decode steps after the prefill, each compared
PROBE_PREFILL = 32  # at most this many prompt tokens go through one prefill call

# Largest difference allowed between two runs of the same computation, relative to the
# largest reference logit (at least 1), by the kind of the file's weights. The same kernels on
# the same graph are bit-identical (measured: windows, inlined RMSNorm); what is allowed is
# what a different but exact op order can move: float rounding, and with dynamic-range
# quantization an activation that lands on the other side of a rounding step. What the
# one-KV-head decomposition does (2.3-9.3 on logits of size ~4) is 100x beyond every entry.
TOLERANCE = {"float": 1e-4, "int8": 2e-2, "int4": 3e-2}


class _Runs(Protocol):
    """The part of `agent.runtime.runner.Runner` a check needs."""

    layout: ModelLayout

    def new_kv(self) -> Any: ...
    def reserve(self, kv: Any, rows: int, keep: int) -> None: ...
    def prefill(self, kv: Any, tokens: Sequence[int], start: int) -> None: ...
    def decode(self, kv: Any, token: int, pos: int) -> npt.NDArray[np.float32]: ...


@dataclass(frozen=True, slots=True)
class Probe:
    """A prompt, the greedy tokens that follow it and the logits of each decode step, as the
    original file computes them."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # the decode steps' inputs: the prompt's last, then greedy picks
    logits: tuple[npt.NDArray[np.float32], ...]
    tolerance: float


def tolerance(model: ModelFile) -> float:
    """The allowed relative difference for a file, from the kinds of its weights."""
    kinds = {kind for _op, kind, _n, _b in model.weights}
    if any("int4" in k for k in kinds):
        return TOLERANCE["int4"]
    if any(k.startswith("int8") for k in kinds):
        return TOLERANCE["int8"]
    return TOLERANCE["float"]


def probe_prompt(layout: ModelLayout) -> list[int]:
    """A fixed prompt that fills the shortest prefill signature (up to `PROBE_PREFILL`) and
    leaves room for the decode steps, spread over the vocabulary."""
    n = min(layout.prefill[0].length if layout.prefill else 1, PROBE_PREFILL)
    n = max(1, min(n, layout.context_length - DECODE_STEPS - 1))
    return [(7919 * i + 11) % layout.vocab_size for i in range(n + 1)]


def _steps(runner: _Runs, prompt: list[int], feed: Sequence[int] | None) -> Probe:
    """Prefill `prompt[:-1]`, then decode `DECODE_STEPS` tokens starting with `prompt[-1]`:
    the next inputs are `feed` when given (the reference's tokens), else the greedy picks."""
    kv = runner.new_kv()
    head = prompt[:-1]
    runner.reserve(kv, len(prompt) + DECODE_STEPS, 0)
    if head:
        runner.prefill(kv, head, 0)
    token, pos = prompt[-1], len(head)
    tokens, logits = [], []
    for step in range(DECODE_STEPS):
        tokens.append(token)
        out = np.array(runner.decode(kv, token, pos), dtype=np.float32, copy=True)
        logits.append(out)
        pos += 1
        token = int(np.argmax(out)) if feed is None else feed[min(step + 1, len(feed) - 1)]
    return Probe(tuple(prompt), tuple(tokens), tuple(logits), 0.0)


def reference(runner: _Runs, model: ModelFile) -> Probe:
    """What the original file computes on the probe prompt (`runner` runs the original file
    on the reference path).

    A prepared copy (composites inlined, KV windows added: `agent.runtime.prepare.inline`) or a link
    of the accelerator chain that runs the file differently from its reference path (``cpu``:
    LiteRT's builtin kernels, which run every composite through its decomposition subgraph) must
    compute what the original file computes. The reference is the original file on XNNPACK (a
    CompiledModel with the in-memory weight cache; on the Interpreter path, the classic Interpreter
    with its default delegate: bit-identical logits), which runs the
    ``odml.scaled_dot_product_attention`` composite itself: it matches the float torch model,
    while the composite's decomposition subgraph, exported by litert-torch for one KV head in the
    default KV layout, folds K's transpose into a RESHAPE and is far off in the logits
    (docs/PERFORMANCE.md, "Notes from the code").
    """
    p = _steps(runner, probe_prompt(runner.layout), None)
    bad = [i for i, lg in enumerate(p.logits) if not np.isfinite(lg).all()]
    if bad:
        raise NonFiniteReference(
            f"the model's own logits are not finite (NaN or infinity) at decode step {bad[0]} "
            "of a fixed prompt: the file computes nothing usable"
        )
    return Probe(p.prompt, p.tokens, p.logits, tolerance(model))


def compare(runner: _Runs, want: Probe) -> str | None:
    """Run `want`'s prompt and tokens through `runner`; the first difference beyond the
    tolerance as text, or None. Failures of the runner itself are differences too.

    `reference` runs a fixed prompt through the original file's shortest prefill signature and then
    a few decode steps, teacher-forced with its own greedy tokens; `compare` feeds the same tokens
    through a runner (the `Runner` protocol: new_kv, reserve, prefill, decode) and reports the first
    step whose logits differ by more than the file's tolerance. Both run only on a first load: the
    outcome is kept beside the prepared copy (`agent.runtime.prepare.model`).
    """
    try:
        got = _steps(runner, list(want.prompt), want.tokens)
    except AgentError as exc:
        return f"running the check failed: {exc}"
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        scale = max(1.0, float(np.max(np.abs(w))))
        err = float(np.max(np.abs(g[: w.size] - w)))
        if not err <= want.tolerance * scale:  # NaN fails too
            return (
                f"logits differ from the original file's at decode step {step} after "
                f"{len(want.prompt) - 1} prompt tokens by {err:.3g} (largest logit {scale:.3g}, "
                f"allowed {want.tolerance:g} of it)"
            )
    return None


class NonFiniteReference(AgentError):
    """The original file itself gives NaN or infinite logits."""


def describe_refusal(path: Path, why: str) -> str:
    """The one line status and logs show for a refused prepared copy."""
    return f"refused, {why} (serving {path.name} as exported)"
