"""What rollout gates compare and record (docs/ROLLOUTS.md, "Gates"): a device's figures of one
model (`Figures`, from a `ModelRun` in its health), the gates a rollout was started with
(`Gates`), one gate's decision for one board class at one wave (`Check`), and an operator's
override of a gate (`Override`), with their JSON forms for the rollout store.

Pure: no MQTT, no files, no clock. The decisions are `agent.operator.rollout.gates`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from agent.base.errors import AgentError
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

# metric → (what it is, unit, "ratio" | "delta"): a ratio threshold is a share of the before
# figure (0.15: 15 % worse), a delta one an absolute change (nats/token; share of requests)
METRICS: Final = {
    "nll": ("probe NLL", "nats/token", "delta"),
    "decode_tok_s": ("decode p50", "tok/s", "ratio"),
    "ttft_p95": ("TTFT p95", "ms", "ratio"),
    "errors": ("error rate", "", "delta"),
}
DEFAULT_THRESHOLDS: Final = (
    ("nll", 0.1),
    ("decode_tok_s", 0.15),
    ("ttft_p95", 0.25),
    ("errors", 0.02),
)
DEFAULT_MIN_SAMPLES: Final = 20
VERDICTS: Final = ("pass", "fail", "wait", "undecided", "overridden", "unmeasured")


class GateError(AgentError):
    """A --gate, --no-gate or --override-gate value that does not parse; the message says why."""


@dataclass(frozen=True, slots=True)
class Figures:
    """One model's figures on one device since its activation (a `ModelRun`)."""

    sha256: str
    version: str
    requests: int  # requests that ran to an end
    errors: int  # of them, ended in an error (every kind)
    samples: int  # requests behind the percentiles
    decode_p50: float  # tok/s
    ttft_p95: float  # ms
    probe_id: str = ""  # "" when no probe ran
    nll: float = 0.0  # nats/token of the probe text
    probe_runs: int = 0

    @classmethod
    def from_pb(cls, run: pb.ModelRun) -> Figures:
        probe = run.probe if run.HasField("probe") else None
        probed = probe is not None and probe.nll_tokens > 0 and math.isfinite(probe.nll_per_token)
        return cls(
            sha256=run.model.sha256,
            version=run.model.version,
            requests=run.requests,
            errors=sum(run.errors.values()),
            samples=run.samples,
            decode_p50=run.decode_tok_s.p50,
            ttft_p95=run.ttft_ms.p95,
            probe_id=probe.probe_id if probed and probe is not None else "",
            nll=probe.nll_per_token if probed and probe is not None else 0.0,
            probe_runs=probe.runs if probed and probe is not None else 0,
        )


@dataclass(frozen=True, slots=True)
class DeviceRuns:
    """What a device's latest health says of its board class and of how its models run."""

    profile: str
    arch: str
    timestamp_unix: float
    run: Figures | None  # the serving model (None: an agent that reports no figures)
    previous: Figures | None  # the model before it, as it last ran

    @property
    def board(self) -> str:
        return f"{self.profile or '?'}/{self.arch or '?'}"


@dataclass(frozen=True, slots=True)
class Gates:
    """The gates a rollout decides its waves by; no thresholds: no gates (an older rollout)."""

    thresholds: tuple[tuple[str, float], ...] = ()  # metric → threshold, in METRICS order
    min_samples: int = DEFAULT_MIN_SAMPLES  # per device: requests (errors), samples (speed)
    min_devices: int = 1  # per board class: updated devices with enough samples
    wait_s: float = 0.0  # how long a settled wave waits for samples before `undecided` applies
    undecided: str = "pass"  # "pass" | "halt": what a gate still short of samples then does
    # what a failing class stops: "rollout" (it halts) or "class" (its devices are offered no
    # more; the others go on, and the rollout halts at its last wave instead of completing)
    scope: str = "rollout"

    def threshold(self, metric: str) -> float | None:
        return dict(self.thresholds).get(metric)


NO_GATES: Final = Gates()


@dataclass(frozen=True, slots=True)
class Check:
    """One gate's decision on one board class when a wave was judged."""

    wave: int  # index into the rollout's waves
    board: str  # "<profile>/<arch>"
    metric: str
    verdict: str  # one of VERDICTS
    threshold: float
    before: float | None = None  # the old model on this class (None: no figure)
    after: float | None = None  # the target model on the wave's updated devices of this class
    before_devices: int = 0
    after_devices: int = 0
    note: str = ""

    @property
    def change(self) -> float | None:
        """How much worse (positive) the after figure is, in the threshold's terms."""
        return worse_by(self.metric, self.before, self.after)

    def describe(self) -> str:
        """`decode p50 20.0 -> 14.0 tok/s (30.0% worse; limit 15.0%): FAIL` and the like."""
        name, unit, kind = METRICS.get(self.metric, (self.metric, "", "delta"))
        if self.metric == "all":
            return f"{self.verdict.upper()}" + (f" ({self.note})" if self.note else "")

        def fig(v: float | None) -> str:
            if v is None:
                return "-"
            return f"{v:.2%}" if self.metric == "errors" else f"{v:.4g}"

        c = self.change
        if kind == "ratio":  # a share of the before figure
            limit, worse = f"{self.threshold:.1%}", "" if c is None else f"{c:+.1%}"
        elif self.metric == "errors":  # percentage points of the requests
            limit = f"{self.threshold * 100:.1f} points"
            worse = "" if c is None else f"{c * 100:+.1f} points"
        else:
            limit, worse = f"{self.threshold:g}", "" if c is None else f"{c:+.3f}"
        worse = f"{worse} worse; limit {limit}" if worse else f"limit {limit}"
        devices = f"devices {self.before_devices} before, {self.after_devices} after"
        text = f"{name} {fig(self.before)} -> {fig(self.after)} {unit}".rstrip()
        note = f"; {self.note}" if self.note else ""
        return f"{text} ({worse}; {devices}{note}): {self.verdict.upper()}"


@dataclass(frozen=True, slots=True)
class Override:
    """An operator resumed a rollout a gate halted, turning that gate off for the rest of it."""

    metric: str  # a METRICS key, or "all"
    reason: str
    who: str  # user@host of the operator's process
    at_unix: float
    wave: int  # index of the wave it was halted at


def parse_gates(
    gate: list[str], no_gate: list[str], *, min_samples: int, min_devices: int, wait_s: float,
    undecided: str, scope: str = "rollout",
) -> Gates:  # fmt: skip
    """The default gates changed by `--gate METRIC:THRESHOLD` and `--no-gate METRIC|all`."""
    if min_samples < 1 or min_devices < 1:
        raise GateError("--gate-min-samples and --gate-min-devices: at least 1")
    if undecided not in ("pass", "halt"):
        raise GateError(f"--gate-undecided {undecided!r}: pass or halt")
    if scope not in ("rollout", "class"):
        raise GateError(f"--gate-scope {scope!r}: rollout or class")
    chosen = dict(DEFAULT_THRESHOLDS)
    for value in no_gate:
        if value == "all":
            chosen.clear()
        else:
            chosen.pop(check_metric(value, "--no-gate"), None)
    for value in gate:
        metric, sep, number = value.partition(":")
        try:
            threshold = float(number) if sep else math.nan
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold) or threshold < 0:
            raise GateError(
                f"--gate {value!r}: METRIC:THRESHOLD, a number >= 0 (e.g. decode_tok_s:0.15, "
                "nll:0.2, errors:0.02)"
            )
        chosen[check_metric(metric, "--gate")] = threshold
    ordered = tuple((m, chosen[m]) for m in METRICS if m in chosen)
    return Gates(ordered, min_samples, min_devices, wait_s, undecided, scope)


def worse_by(metric: str, before: float | None, after: float | None) -> float | None:
    """How much worse `after` is than `before` (positive: worse) in `metric`'s threshold terms:
    a share of the before figure for speed, an absolute change for NLL and the error rate."""
    if before is None or after is None:
        return None
    if metric == "decode_tok_s":
        return (before - after) / before if before > 0 else None
    if metric == "ttft_p95":
        return (after - before) / before if before > 0 else None
    return after - before


def check_metric(metric: str, flag: str) -> str:
    if metric not in METRICS:
        raise GateError(f"{flag} {metric!r}: one of {', '.join(METRICS)} (or all)")
    return metric


# ----------------------------------------------------------------------------- JSON


def gates_to_json(g: Gates) -> dict[str, Any]:
    return {"thresholds": dict(g.thresholds), "min_samples": g.min_samples,
            "min_devices": g.min_devices, "wait_s": g.wait_s, "undecided": g.undecided,
            "scope": g.scope}  # fmt: skip


def gates_from_json(doc: Any) -> Gates:
    if doc is None:  # a rollout created before gates existed: none
        return NO_GATES
    thresholds = {str(k): float(v) for k, v in doc["thresholds"].items()}
    unknown = set(thresholds) - set(METRICS)
    if unknown:  # a newer version's gate: never dropped silently
        raise ValueError(f"gates {sorted(unknown)} are not known to this version")
    return Gates(
        tuple((m, thresholds[m]) for m in METRICS if m in thresholds),
        int(doc["min_samples"]),
        int(doc["min_devices"]),
        float(doc["wait_s"]),
        str(doc["undecided"]),
        str(doc.get("scope", "rollout")),
    )


def check_to_json(c: Check) -> dict[str, Any]:
    return {"wave": c.wave, "board": c.board, "metric": c.metric, "verdict": c.verdict,
            "threshold": c.threshold, "before": c.before, "after": c.after,
            "before_devices": c.before_devices, "after_devices": c.after_devices,
            "note": c.note}  # fmt: skip


def check_from_json(d: Any) -> Check:
    def f(v: Any) -> float | None:
        return None if v is None else float(v)

    return Check(int(d["wave"]), str(d["board"]), str(d["metric"]), str(d["verdict"]),
                 float(d["threshold"]), f(d["before"]), f(d["after"]), int(d["before_devices"]),
                 int(d["after_devices"]), str(d["note"]))  # fmt: skip


def override_to_json(o: Override) -> dict[str, Any]:
    return {"metric": o.metric, "reason": o.reason, "who": o.who, "at_unix": o.at_unix,
            "wave": o.wave}  # fmt: skip


def override_from_json(d: Any) -> Override:
    return Override(str(d["metric"]), str(d["reason"]), str(d["who"]), float(d["at_unix"]),
                    int(d["wave"]))  # fmt: skip
