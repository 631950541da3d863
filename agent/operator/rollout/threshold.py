"""The failure threshold of a rollout (docs/ROLLOUTS.md): the tally of the devices offered so
far, when it is over `--max-failure-rate`, when it is certain to stay over, and the reason a
halt records. Pure, like `plan`, which decides with it."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from agent.operator.rollout.state import Device, Spec, Status


@dataclass(frozen=True, slots=True)
class Tally:
    offered: int  # devices offered (latest attempt) or never online, excused ones left out
    finished: int  # ... of them final
    failed: int
    reasons: tuple[tuple[str, int], ...]

    @property
    def rate(self) -> float:
        return self.failed / self.finished if self.finished else 0.0


def tally(devices: Iterable[Device]) -> Tally:
    """Over the devices offered (latest attempt) and the named ones never online to offer to
    (failed, attempt 0: `never_online`)."""
    counted = [
        d
        for d in devices
        if (d.attempt >= 1 or d.status == Status.FAILED)
        and not d.excused
        and d.status != Status.RETRY
    ]
    finished = [d for d in counted if d.status in (Status.COMMITTED, Status.FAILED)]
    failed = [d for d in finished if d.status == Status.FAILED]
    reasons = Counter(d.reason for d in failed)
    return Tally(len(counted), len(finished), len(failed), tuple(sorted(reasons.items())))


def over_threshold(spec: Spec, t: Tally) -> bool:
    return t.finished >= spec.min_devices and t.rate > spec.max_failure_rate


def certain_over(spec: Spec, t: Tally, pending: int) -> bool:
    """Over the threshold even if each of the `pending` devices (in flight, or failed and
    offered again) commits: waiting for them (a stalled device: the whole wave timeout) cannot
    change the verdict on the devices offered so far."""
    best = dataclasses.replace(t, finished=t.finished + pending)
    return pending > 0 and over_threshold(spec, best)


def halt_reason(index: int, spec: Spec, t: Tally, pending: int = 0) -> str:
    """Why the failure threshold halted the rollout; `pending`: devices not final yet that
    could not bring the rate under it (`certain_over`)."""
    reasons = ", ".join(f"{why} {n}" for why, n in t.reasons)
    if pending:
        return (
            f"wave {index + 1}: {t.failed} of {t.finished} finished devices failed, over "
            f"{spec.max_failure_rate:.1%} even if the {pending} not final yet commit "
            f"({t.failed / (t.finished + pending):.1%}); reasons: {reasons}"
        )
    return (
        f"wave {index + 1}: {t.failed} of {t.finished} finished devices failed "
        f"({t.rate:.1%} > {spec.max_failure_rate:.1%}, at least {spec.min_devices} finished)"
        f"; reasons: {reasons}"
    )
