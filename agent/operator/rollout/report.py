"""A rollout's report: per wave, devices offered / committed / failed (by reason) / timed out,
when it started and ended, and per board class (profile/arch) each gate's before and after
figures beside its threshold; whether and why the rollout halted, and the gates an operator
overrode (docs/ROLLOUTS.md, "Report" and "Gates").

Pure: built from the persisted `Rollout` alone, so `rollout status` shows it without a broker.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from agent.operator.rollout.figures import (
    NO_GATES,
    Check,
    Gates,
    Override,
    check_to_json,
    gates_to_json,
    override_to_json,
)
from agent.operator.rollout.state import Rollout, State, Status
from agent.operator.rollout.threshold import tally


@dataclass(frozen=True, slots=True)
class WaveReport:
    index: int  # 1-based, as people count waves
    percent: float  # cumulative share of the target devices
    state: str  # "pending" | "running" | "soaking" | "ended" | "halted"
    offered: int  # devices this wave offered the update to (every attempt's device once)
    committed: int
    failed: int
    failed_by_reason: tuple[tuple[str, int], ...]
    timed_out: int
    in_progress: int
    already: int  # found on the target before any offer
    started_unix: float
    ended_unix: float
    halted_unix: float = 0.0  # when the rollout halted in this wave (0: it did not)

    @property
    def duration_s(self) -> float:
        """From its start to its end, or to the halt; 0 while it runs."""
        end = self.ended_unix or self.halted_unix
        return end - self.started_unix if end and self.started_unix else 0.0


@dataclass(frozen=True, slots=True)
class RolloutReport:
    rollout_id: str
    update_id: str
    target: str
    state: str
    reason: str
    halted: bool
    halts: tuple[str, ...]
    waves: tuple[WaveReport, ...]
    offered: int
    committed: int
    failed: int
    already: int
    failure_rate: float  # over the devices counted against the threshold
    devices: tuple[dict[str, Any], ...]  # per device: id, wave, attempt, status, reason, phase
    skipped: tuple[str, ...] = ()  # target devices never online while it ran (once completed)
    # named target devices (`--target DEV`) not committed nor already on the target, with why
    not_updated: tuple[tuple[str, str], ...] = ()
    gates: Gates = NO_GATES
    checks: tuple[Check, ...] = ()  # per wave judged, per board class, per gate
    overrides: tuple[Override, ...] = ()

    @property
    def succeeded(self) -> bool:
        """Completed, and every named target device updated (or already on the target)."""
        return self.state == State.COMPLETED and not self.not_updated

    def to_json(self) -> dict[str, Any]:
        waves = [
            {
                "wave": w.index, "percent": w.percent, "state": w.state,
                "offered": w.offered, "committed": w.committed, "failed": w.failed,
                "failed_by_reason": dict(w.failed_by_reason), "timed_out": w.timed_out,
                "in_progress": w.in_progress, "already": w.already,
                "started_unix": w.started_unix or None, "ended_unix": w.ended_unix or None,
                "halted_unix": w.halted_unix or None,
                "duration_s": round(w.duration_s, 3) if w.duration_s else None,
            }
            for w in self.waves
        ]  # fmt: skip
        return {
            "rollout_id": self.rollout_id,
            "update_id": self.update_id,
            "target": self.target,
            "state": self.state,
            "reason": self.reason,
            "halted": self.halted,
            "halts": list(self.halts),
            "offered": self.offered,
            "committed": self.committed,
            "failed": self.failed,
            "already": self.already,
            "failure_rate": round(self.failure_rate, 4),
            "waves": waves,
            "devices": list(self.devices),
            "skipped": list(self.skipped),
            "not_updated": dict(self.not_updated),
            "gates": gates_to_json(self.gates),
            "checks": [
                {**check_to_json(c), "wave": c.wave + 1, "change": c.change} for c in self.checks
            ],
            "overrides": [{**override_to_json(o), "wave": o.wave + 1} for o in self.overrides],
        }

    def lines(self) -> list[str]:
        """The report for people."""
        out = [
            f"rollout {self.rollout_id} (update {self.update_id}, target {self.target}): "
            f"{self.state.upper()}" + (f" - {self.reason}" if self.reason else ""),
        ]
        for w in self.waves:
            reasons = ", ".join(f"{r} {n}" for r, n in w.failed_by_reason)
            took = f", {w.duration_s:.1f} s" if w.duration_s else ""
            out.append(
                f"  wave {w.index} ({w.percent:g}%): {w.state}; offered {w.offered}, committed "
                f"{w.committed}, failed {w.failed}" + (f" ({reasons})" if reasons else "")
                + f", timed out {w.timed_out}"
                + (f", in progress {w.in_progress}" if w.in_progress else "")
                + (f", already on target {w.already}" if w.already else "") + took
            )  # fmt: skip
            for c in self.checks:
                if c.wave + 1 == w.index:
                    out.append(f"    gate {c.metric} on {c.board}: {c.describe()}")
        out.append(
            f"  total: offered {self.offered}, committed {self.committed}, failed {self.failed}, "
            f"already on target {self.already}; failure rate {self.failure_rate:.1%}"
        )
        if self.gates.thresholds:
            limits = ", ".join(f"{m}:{t:g}" for m, t in self.gates.thresholds)
            out.append(
                f"  gates: {limits} (at least {self.gates.min_samples} samples per device, "
                f"{self.gates.min_devices} devices per board; short of them after "
                f"{self.gates.wait_s:g} s: {self.gates.undecided}; a failing class halts "
                f"{'its own devices' if self.gates.scope == 'class' else 'the rollout'})"
            )
        else:
            out.append("  gates: none")
        for o in self.overrides:
            when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(o.at_unix))
            out.append(
                f"  override of gate {o.metric} at wave {o.wave + 1} by {o.who} at {when}: "
                f"{o.reason}"
            )
        if self.skipped:
            out.append(f"  never online, not offered: {' '.join(self.skipped)}")
        if self.not_updated and self.state != State.RUNNING:
            named = ", ".join(f"{d} ({why})" for d, why in self.not_updated)
            out.append(f"  named devices not updated: {named}")
        return out


def report(r: Rollout) -> RolloutReport:
    by_wave: dict[int, list[Any]] = {w.index: [] for w in r.waves}
    for d in r.devices:
        by_wave.setdefault(d.wave, []).append(d)
    waves = []
    for w in r.waves:
        mine = by_wave[w.index]
        offered = [d for d in mine if d.attempt >= 1]
        failed = [d for d in mine if d.status == Status.FAILED]  # never_online: not offered
        if w.ended_unix:
            state = "ended"
        elif w.index == r.wave and r.state == State.HALTED:
            state = "halted"
        elif w.index == r.wave and w.started_unix and r.state != State.ABORTED:
            state = "soaking" if w.settled_unix else "running"
        elif w.started_unix:
            state = "stopped"
        else:
            state = "pending"
        waves.append(
            WaveReport(
                index=w.index + 1,
                percent=round(w.fraction * 100, 4),
                state=state,
                offered=len(offered),
                committed=sum(d.status == Status.COMMITTED for d in offered),
                failed=len(failed),
                failed_by_reason=tuple(sorted(Counter(d.reason for d in failed).items())),
                timed_out=sum(d.reason == "timeout" for d in failed),
                in_progress=sum(d.status in (Status.OFFERED, Status.IN_PROGRESS) for d in mine),
                already=sum(d.status == Status.ALREADY for d in mine),
                started_unix=w.started_unix,
                ended_unix=w.ended_unix,
                halted_unix=r.updated_unix if state == "halted" else 0.0,
            )
        )
    devices = tuple(
        {
            "device": d.device_id, "wave": d.wave + 1, "attempt": d.attempt,
            "status": d.status.value, "reason": d.reason, "phase": d.phase,
            "message": d.message, "excused": d.excused,
        }
        for d in r.devices
    )  # fmt: skip
    return RolloutReport(
        rollout_id=r.spec.rollout_id,
        update_id=r.spec.update_id,
        target=r.spec.target.describe(),
        state=r.state.value,
        reason=r.reason,
        halted=bool(r.halts),
        halts=r.halts,
        waves=tuple(waves),
        offered=sum(w.offered for w in waves),
        committed=sum(w.committed for w in waves),
        failed=sum(w.failed for w in waves),
        already=sum(w.already for w in waves),
        failure_rate=tally(r.devices).rate,
        devices=devices,
        skipped=r.skipped,
        not_updated=_not_updated(r),
        gates=r.spec.gates,
        checks=r.checks,
        overrides=r.overrides,
    )


def _not_updated(r: Rollout) -> tuple[tuple[str, str], ...]:
    if r.spec.target.kind != "devices":
        return ()
    done = (Status.COMMITTED, Status.ALREADY)
    by_id = r.by_id()
    out = []
    for device_id in r.spec.target.devices:
        d = by_id.get(device_id)
        if d is None:
            out.append((device_id, "not offered"))
        elif d.status not in done:
            out.append((device_id, d.reason if d.status == Status.FAILED else d.status.value))
    return tuple(out)
