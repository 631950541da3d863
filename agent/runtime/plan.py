"""Plans made before anything runs: what loading a model costs (`MemoryPlan`, checked against
the profile's budget, with the KV windows a load can afford), and how a prefill is split into
signature calls (`plan_prefill`).

Nothing here imports numpy or LiteRT: the engine's stats and the fleet carry a `MemoryPlan`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from agent.base.errors import BudgetError, RuntimeFailure
from agent.model.tflite.info import ModelFile
from agent.model.tflite.layout import ModelLayout, Signature, Window, auto_windows, window_prefills
from agent.profile import DeviceProfile
from agent.runtime.legacy import LEGACY_BACKEND

log = logging.getLogger("agent.runtime.litert")  # moved from litert.py: its lines keep their name

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What loading a model costs, counted before anything is allocated."""

    weights: int  # the mapped model file
    packed_weights: int  # XNNPACK repacks weights once, into a weight cache all signatures share
    activations: int  # per signature, the peak of its intermediate tensors alive at once
    kv_per_session: int
    sessions: int  # runtime KV caches (running requests and bound sessions)
    budget: int
    spilled: int = 0  # the host KV tier and the prefix cache, at their byte budgets

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.packed_weights
            + self.activations
            + self.kv_per_session * self.sessions
            + self.spilled
        )

    def describe(self) -> str:
        text = (
            f"{self.total / MIB:.1f} MiB = weights {self.weights / MIB:.1f} + packed weights "
            f"{self.packed_weights / MIB:.1f} + activations {self.activations / MIB:.1f} + KV "
            f"{self.kv_per_session / MIB:.2f} x {self.sessions} session(s)"
        )
        if self.spilled:
            text += f" + host KV tier and prefix cache {self.spilled / MIB:.1f}"
        return text


@dataclass(frozen=True, slots=True)
class Call:
    """One signature call of a prefill plan: `count` real tokens padded to `signature.length`."""

    signature: Signature
    offset: int  # index into the tokens being prefilled
    count: int


# What one signature call costs beyond its tokens, in tokens: a call reads every weight once
# whatever its length (decode is bandwidth-bound), then each position costs about the same.
# SmolLM-135M shape, int8, 2 threads here: decode ~20 ms, prefill_512 ~1.2 s, so a call's fixed
# part is ~8 positions' worth. Padded positions cost like real ones.
CALL_COST_TOKENS: Final = 8


def plan_prefill(window: Window, n: int, start: int) -> list[Call]:
    """Split `n` tokens starting at position `start` into the cheapest signature calls of one
    KV window (never its verify signatures).

    A call of a signature of length L costs ``CALL_COST_TOKENS + L`` (padding included), so 63
    tokens go through two 32-token calls rather than one padded 128-token call, and a few last
    tokens through decode. Not the runner's measured costs (`agent.runtime.costs`, which the
    speculation policy uses): another split of the same tokens computes the same logits up to
    rounding, so a plan that followed timings would make the tokens of a greedy or seeded
    request depend on how busy the machine was (seen: a constrained request on a random tiny
    model closed its JSON in one run and not in another).
    A padded call must not run past the end of the cache (the model's DYNAMIC_UPDATE_SLICE
    would clamp and overwrite valid rows), so near the end only shorter signatures, and finally
    decode, qualify. Ties go to the longer signature first.
    """
    ctx = window.length
    candidates = sorted((*window.prefill, window.decode), key=lambda s: -s.length)
    # best[r]: (cost, signature of the first call) to prefill the last r of the n tokens
    none: tuple[float, Signature | None] = (float("inf"), None)
    best = [(0.0, none[1])] + [none] * n
    for r in range(1, n + 1):
        pos = start + n - r
        for sig in candidates:
            if pos + sig.length > ctx:
                continue
            cost = CALL_COST_TOKENS + sig.length + best[r - min(r, sig.length)][0]
            if cost < best[r][0]:
                best[r] = (cost, sig)
    calls: list[Call] = []
    r = n
    while r > 0:
        first = best[r][1]
        if first is None:
            raise RuntimeFailure(f"no signature fits {r} tokens at position {start + n - r}")
        count = min(r, first.length)
        calls.append(Call(first, n - r, count))
        r -= count
    return calls


def plan_memory(
    model: ModelFile, layout: ModelLayout, profile: DeviceProfile, sessions: int = 1
) -> MemoryPlan:
    """Count weights, packed weights, activations and KV against the profile's budget."""
    xnnpack = "xnnpack" in profile.runtime.accelerators
    return MemoryPlan(
        weights=model.size,
        packed_weights=model.weight_bytes if xnnpack else 0,
        activations=sum(s.activation_bytes for s in model.signatures),
        kv_per_session=layout.kv.bytes_per_session,
        sessions=sessions,
        budget=profile.runtime.max_num_bytes,
    )


def check_budget(plan: MemoryPlan, profile: DeviceProfile, path: Path) -> None:
    """Refuse a plan that does not fit the profile's `max_num_bytes`, with the numbers."""
    if plan.total > plan.budget:
        raise BudgetError(
            f"{path.name} needs {plan.describe()}, but profile {profile.name} "
            f"({profile.source}) allows runtime.max_num_bytes = {plan.budget} "
            f"({plan.budget / MIB:.1f} MiB)"
        )


def affordable_windows(
    model: ModelFile, layout: ModelLayout, plan: MemoryPlan
) -> tuple[tuple[int, ...], int]:
    """The KV windows to add at load (`auto_windows`) whose signatures fit the budget, and the
    activation bytes they add at most: a window's copy of a signature needs at most the
    activations of the full-length one."""
    acts = {s.key: s.activation_bytes for s in model.signatures}
    chosen: list[int] = []
    extra = 0
    for w in auto_windows(layout.context_length):
        ns = window_prefills((p.length for p in layout.prefill), w)
        sigs = (
            layout.decode,
            *(p for p in layout.prefill if p.length in ns),
            *(v for v in layout.verify if v.length < w),  # cloned too (`add_windows`)
        )
        cost = sum(acts.get(s.key, 0) for s in sigs)
        if plan.total + extra + cost > plan.budget:
            log.info("KV window %d not added: its activations would exceed the budget", w)
            break
        extra += cost
        chosen.append(w)
    return tuple(chosen), extra


def adds_windows(
    profile: DeviceProfile, layout: ModelLayout, kv_windows: bool, interpreter: bool
) -> bool:
    """Whether a load gives this model KV windows: a single-length model on the CompiledModel
    CPU path (the Interpreter would allocate each window's KV once per signature) with a weight
    cache directory to keep the prepared copy in, unless the profile or the caller turns them
    off."""
    return (
        kv_windows
        and profile.runtime.kv_windows
        and profile.runtime.xnnpack_weight_cache_dir is not None
        and profile.runtime.backend != LEGACY_BACKEND
        and bool({"xnnpack", "cpu"} & set(profile.runtime.accelerators))
        and not layout.windows
        and not interpreter
    )


def expected_plan(model: ModelFile, layout: ModelLayout, profile: DeviceProfile) -> MemoryPlan:
    """What `load` will plan for this model, counted without loading it: `plan_memory` plus the
    activations of the KV windows the load would add (at most; the windows' own signatures
    need no more than the full-length ones)."""
    plan = plan_memory(model, layout, profile)
    if not adds_windows(profile, layout, kv_windows=True, interpreter=False):
        return plan
    _windows, extra = affordable_windows(model, layout, plan)
    return replace(plan, activations=plan.activations + extra)
