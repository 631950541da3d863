"""Rollout gates, pure (docs/ROLLOUTS.md, "Gates"): whether a settled, soaked wave's updated
devices run the target model worse than the old one ran on the same board class.

For each board class (profile/arch) of the devices updated so far, `judge` compares the target
model's figures on them (their health's `run`) with the old model's on that class: the updated
devices' own figures before the update (their `previous`) and those of the class's devices
still on another model (their `run`). Each gate decides once both sides have enough samples
(waiting for them up to `Gates.wait_s` after the wave settled, and for the health of a committed
device that still shows the old model up to the wave timeout); one failing gate on one class
halts the whole rollout. No MQTT, no clock: `plan.step` calls it
with what `RolloutView` heard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.operator.rollout.figures import Check, DeviceRuns, Figures, Gates, Override, worse_by
from agent.operator.rollout.state import Device, Rollout, RolloutError, State, Status, Wave

HALTING = ("fail", "undecided")


@dataclass(frozen=True, slots=True)
class Judgement:
    # "pass" (the wave may end) | "wait" (for samples) | "halt" | "hold" (the wave may end,
    # but classes failed: `held`; the rollout halts at its last wave instead of completing)
    decision: str
    reason: str  # why it halts or holds ("" otherwise)
    checks: tuple[Check, ...]  # every gate on every class, figures beside the threshold


def judge(
    runs: Mapping[str, DeviceRuns], r: Rollout, wave: Wave, devices: Mapping[str, Device],
    now: float,
) -> Judgement:  # fmt: skip
    """The gates' decision on the devices committed so far (every wave's), at `now`."""
    g = r.spec.gates
    if not g.thresholds:
        return Judgement("pass", "", ())
    target = r.spec.target_sha256
    boards: dict[str, list[str]] = {}
    for d in devices.values():
        if d.status == Status.COMMITTED:
            dr = runs.get(d.device_id)
            boards.setdefault(dr.board if dr else "?/?", []).append(d.device_id)
    overridden = {o.metric for o in r.overrides}
    waited_out = now >= wave.settled_unix + g.wait_s  # for samples
    lag_out = now >= wave.settled_unix + r.spec.wave_timeout_s  # for a committed device's health
    peers: dict[str, list[tuple[str, DeviceRuns]]] = {}  # devices on another model, by class
    for i, x in runs.items():
        if x.run is not None and x.run.sha256 != target and x.board in boards:
            peers.setdefault(x.board, []).append((i, x))
    checks: list[Check] = []
    for board, ids in sorted(boards.items()):
        measured = [runs[i] for i in ids if i in runs and runs[i].run is not None]
        if not measured:
            why = f"{len(ids)} updated devices report no figures (agents without them)"
            checks.append(Check(r.wave, board, "all", "unmeasured", 0.0, note=why))
            continue
        after = [x.run for x in measured if x.run is not None and x.run.sha256 == target]
        lagging = len(measured) - len(after)  # committed, but no health of the target yet
        before = [x.previous for x in measured if x.previous and x.previous.sha256 != target]
        mine = set(ids)
        before += [x.run for i, x in peers.get(board, ()) if i not in mine and x.run is not None]
        for metric, threshold in g.thresholds:
            c = _check(g, metric, threshold, before, after, lag_out or not lagging)
            c = dataclasses.replace(c, wave=r.wave, board=board)
            if c.verdict == "wait" and waited_out and (lag_out or not lagging):
                c = dataclasses.replace(c, verdict="undecided")
            if c.verdict in (*HALTING, "wait") and ({metric, "all"} & overridden):
                c = dataclasses.replace(c, verdict="overridden")
            checks.append(c)
    failed = [c for c in checks if c.verdict == "fail"]
    if failed and g.scope == "rollout":
        return Judgement("halt", _why("gate failed", failed), tuple(checks))
    if any(c.verdict == "wait" for c in checks):
        return Judgement("wait", "", tuple(checks))
    if failed:  # --gate-scope class: the wave ends; these classes get no more offers
        why = _why("gate failed; not offered to its class any more", failed)
        return Judgement("hold", why, tuple(checks))
    short = [c for c in checks if c.verdict == "undecided"]
    if short and g.undecided == "halt":
        return Judgement("halt", _why("gate undecided (too few samples)", short), tuple(checks))
    return Judgement("pass", "", tuple(checks))


def _why(what: str, checks: list[Check]) -> str:
    return f"{what}: " + "; ".join(f"{c.metric} on {c.board}: {c.describe()}" for c in checks)


def _check(
    g: Gates, metric: str, threshold: float, before: list[Figures], after: list[Figures],
    settled: bool,
) -> Check:  # fmt: skip
    """One gate on one class: `settled` when no updated device's health is still to come."""
    probe = ""
    if metric == "nll":
        ids = Counter(f.probe_id for f in after if f.probe_id)
        probe = ids.most_common(1)[0][0] if ids else ""
    b, nb = figure(g, metric, before, probe)
    a, na = figure(g, metric, after, probe)
    enough = na >= g.min_devices and nb >= 1
    if not enough or not settled:
        need = "a probe" if metric == "nll" else f"{g.min_samples} samples"
        note = (
            f"needs {g.min_devices} updated devices and 1 before with {need}"
            + (" under the same probe id" if metric == "nll" else "")
            if not enough else "updated devices' health still to come"
        )  # fmt: skip
        return Check(0, "", metric, "wait", threshold, b, a, nb, na, note)
    worse = worse_by(metric, b, a)
    verdict = "fail" if worse is not None and worse > threshold else "pass"
    return Check(0, "", metric, verdict, threshold, b, a, nb, na)


def figure(g: Gates, metric: str, figs: list[Figures], probe_id: str) -> tuple[float | None, int]:
    """The class's figure of `metric` over the devices with enough samples, and how many."""
    if metric == "errors":
        ok = [f for f in figs if f.requests >= g.min_samples]
        total = sum(f.requests for f in ok)
        return (sum(f.errors for f in ok) / total if total else None), len(ok)
    if metric == "nll":
        values = [
            f.nll for f in figs
            if probe_id and f.probe_id == probe_id and f.probe_runs and math.isfinite(f.nll)
        ]  # fmt: skip
    elif metric == "decode_tok_s":
        values = [f.decode_p50 for f in figs if f.samples >= g.min_samples and _ok(f.decode_p50)]
    else:
        values = [f.ttft_p95 for f in figs if f.samples >= g.min_samples and _ok(f.ttft_p95)]
    return (sum(values) / len(values) if values else None), len(values)


def rules(
    runs: Mapping[str, DeviceRuns], r: Rollout
) -> tuple[Callable[[Rollout, Wave, Mapping[str, Device], float], Judgement],
           Callable[[str], bool] | None]:  # fmt: skip
    """What `plan.step` takes: `judge` over what the view heard, and whether a device is of a
    board class the gates hold (None: none is)."""
    boards = held(r)

    def of_held(device_id: str) -> bool:
        x = runs.get(device_id)
        return x is not None and x.board in boards

    return functools.partial(judge, runs), (of_held if boards else None)


def held(r: Rollout) -> frozenset[str]:
    """The board classes a failed gate no override covers holds (`--gate-scope class`): their
    devices are offered no more."""
    if r.spec.gates.scope != "class" or not r.checks:
        return frozenset()
    latest = max(c.wave for c in r.checks)
    off = {o.metric for o in r.overrides}
    return frozenset(
        c.board for c in r.checks
        if c.wave == latest and c.verdict == "fail" and not ({c.metric, "all"} & off)
    )  # fmt: skip


def _ok(value: float) -> bool:
    """A figure to count: positive and finite (a device's NaN or inf never masks the others)."""
    return 0 < value < math.inf


def halting(r: Rollout) -> list[str]:
    """The gates that halted the rollout at its current wave and no override covers yet."""
    if r.state != State.HALTED:
        return []
    off = {o.metric for o in r.overrides}
    found = [c.metric for c in r.checks if c.wave == r.wave and c.verdict in HALTING]
    return sorted({m for m in found if "all" not in off and m not in off})


def override(r: Rollout, asked: Sequence[Override], now: float) -> Rollout:
    """`r` with the operator's overrides recorded (stamped `now`, at its wave); RolloutError
    with no reason given, or when no gate halted it."""
    if any(not o.reason.strip() for o in asked):
        raise RolloutError("--override-gate needs --reason TEXT: it is recorded with the rollout")
    if not halting(r):
        raise RolloutError(f"rollout {r.spec.rollout_id} was not halted by a gate; no override")
    added = tuple(dataclasses.replace(o, at_unix=now, wave=r.wave) for o in asked)
    return dataclasses.replace(r, overrides=r.overrides + added, updated_unix=now)
