"""A rollout's persisted state as frozen dataclasses, and its JSON form (docs/ROLLOUTS.md).

Pure: no MQTT, no files, no clock. `agent.operator.rollout.plan` moves a `Rollout` from one state
to the next; `agent.operator.rollout.store` writes it; `to_json`/`from_json` round-trip exactly.
"""

from __future__ import annotations

import bisect
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any, Final

from agent.base.errors import AgentError
from agent.config.file import GROUP_RE
from agent.config.fleet import DEVICE_ID_RULE, is_device_id
from agent.operator.rollout.figures import (
    NO_GATES,
    Check,
    Gates,
    Override,
    check_from_json,
    check_to_json,
    gates_from_json,
    gates_to_json,
    override_from_json,
    override_to_json,
)

FORMAT: Final = 1
ROLLOUT_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class RolloutError(AgentError):
    """A rollout cannot be created, read or changed as asked; the message says why."""


class State(enum.StrEnum):
    RUNNING = "running"  # waves go on while a process runs it (or will, at the next resume)
    PAUSED = "paused"  # an operator's pause: no offers until `resume`
    HALTED = "halted"  # the failure rate passed the threshold: no offers until `resume`
    ABORTED = "aborted"  # an operator's abort: final
    COMPLETED = "completed"  # every wave ended under the threshold: final


FINAL_STATES: Final = (State.ABORTED, State.COMPLETED)


class Status(enum.StrEnum):
    OFFERED = "offered"  # written before the update command goes out; never sent again
    IN_PROGRESS = "in_progress"  # the device reported a phase before COMMITTED
    COMMITTED = "committed"
    FAILED = "failed"  # rejected, rolled back, failed, timed out or went offline (reason)
    ALREADY = "already"  # the device showed the target model before any offer: done
    RETRY = "retry"  # failed, then made eligible again by `retry-failed`


IN_FLIGHT: Final = (Status.OFFERED, Status.IN_PROGRESS)
OFFERED_ONCE: Final = (Status.OFFERED, Status.IN_PROGRESS, Status.COMMITTED, Status.FAILED)


@dataclass(frozen=True, slots=True)
class Target:
    """Which devices the rollout is for: every device (`all`), one group, or a list."""

    kind: str  # "all" | "group" | "devices"
    group: str = ""
    devices: tuple[str, ...] = ()

    @classmethod
    def parse(cls, values: list[str]) -> Target:
        """From `--target all`, `--target group:G` or `--target DEV [DEV ...]`."""
        if values == ["all"]:
            return cls("all")
        if len(values) == 1 and values[0].startswith("group:"):
            group = values[0].removeprefix("group:")
            if not GROUP_RE.fullmatch(group):
                raise RolloutError(
                    f"--target {values[0]!r}: a group name is 1-64 of A-Z a-z 0-9 _ . : - "
                    "(starting with a letter or digit), as [fleet] group"
                )
            return cls("group", group=group)
        if not values:
            raise RolloutError("--target: give all, group:NAME or device ids")
        for v in values:
            if v == "all" or v.startswith("group:") or not is_device_id(v):
                raise RolloutError(
                    f"--target {v!r}: give all, group:NAME, or device ids alone (a device id: "
                    f"{DEVICE_ID_RULE})"
                )
        return cls("devices", devices=tuple(sorted(set(values))))

    def describe(self) -> str:
        if self.kind == "group":
            return f"group:{self.group}"
        return "all" if self.kind == "all" else " ".join(self.devices)


def parse_waves(text: str) -> tuple[float, ...]:
    """`1%,10%,50%,100%` → (0.01, 0.1, 0.5, 1.0): increasing cumulative fractions, ending at
    100%. RolloutError otherwise."""
    out: list[float] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", part)
        value = float(m.group(1)) if m else math.nan
        if not m or not 0 < value <= 100 or (out and value / 100 <= out[-1]):
            raise RolloutError(
                f"--waves {text!r}: increasing percentages of the target devices, ending at "
                "100%, e.g. 1%,10%,50%,100%"
            )
        out.append(value / 100)
    if out[-1] != 1.0:
        raise RolloutError(f"--waves {text!r}: the last wave must be 100%")
    return tuple(out)


def parse_rate(text: str) -> float:
    """`5%` → 0.05 (0% to 100%)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", text)
    if m is None or float(m.group(1)) > 100:
        raise RolloutError(f"--max-failure-rate {text!r}: a percentage from 0% to 100%, e.g. 5%")
    return float(m.group(1)) / 100


def check_rollout_id(rollout_id: str) -> str:
    if not ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise RolloutError(
            f"rollout id {rollout_id!r}: 1-100 of A-Z a-z 0-9 . _ - (starting with a letter or "
            "digit)"
        )
    return rollout_id


@dataclass(frozen=True, slots=True)
class Spec:
    """What the operator asked for; never changes after `create`."""

    rollout_id: str
    update_id: str
    bundle: str  # absolute path of the bundle
    model_name: str  # the manifest's: a device serving it at `version_label` is done
    version_label: str
    target_sha256: str  # the manifest's target_model_sha256: a device serving it is done
    target: Target
    waves: tuple[float, ...]
    min_devices: int
    max_failure_rate: float
    wave_timeout_s: float
    soak_s: float
    prefix: str
    created_unix: float
    # agent.model.directory.model_digest of the target directory ("" from an older state file)
    target_digest: str = ""
    # how this rollout reaches its broker (agent.fleet.mqtt.MqttOptions.to_pairs): resume uses it
    connection: tuple[tuple[str, str], ...] = ()
    # the gates its waves are judged by (docs/ROLLOUTS.md, "Gates"); none in an older rollout
    gates: Gates = NO_GATES


@dataclass(frozen=True, slots=True)
class Device:
    """One device the rollout has decided about (offered, or found already done)."""

    device_id: str
    wave: int  # index into Spec.waves of the wave that offered it (or found it done)
    status: Status
    attempt: int = 0  # 1 at the first offer, 2 after a retry-failed, ...
    phase: str = ""  # the last UpdateStatus phase heard for this attempt
    reason: str = ""  # why it failed: the reason code, the phase, "timeout" or "offline"
    message: str = ""
    offered_unix: float = 0.0
    final_unix: float = 0.0
    heard_ts: float = 0.0  # the newest device timestamp of a status of ours heard from it
    ignore_before_ts: float = 0.0  # statuses stamped at or before this are an older attempt's
    excused: bool = False  # failed before an operator resumed a halted rollout: not counted

    @property
    def final(self) -> bool:
        return self.status in (Status.COMMITTED, Status.FAILED, Status.ALREADY)


@dataclass(frozen=True, slots=True)
class Wave:
    index: int
    fraction: float
    started_unix: float = 0.0  # 0: not started
    settled_unix: float = 0.0  # when its last offered device became final (0: not yet)
    ended_unix: float = 0.0  # soaked and checked (0: not yet)


@dataclass(frozen=True, slots=True)
class Rollout:
    spec: Spec
    state: State = State.RUNNING
    reason: str = ""  # why it halted, was paused, aborted or resumed
    wave: int = 0  # the current wave's index
    waves: tuple[Wave, ...] = ()
    devices: tuple[Device, ...] = ()  # sorted by device id (`index` relies on it)
    updated_unix: float = 0.0
    halts: tuple[str, ...] = field(default=())  # every halt's reason, in order
    skipped: tuple[str, ...] = ()  # target devices never online while it ran (at its end)
    checks: tuple[Check, ...] = ()  # the gates' latest decisions, per wave judged
    overrides: tuple[Override, ...] = ()  # gates an operator overrode to resume it

    def device(self, device_id: str) -> Device | None:
        i = self.index(device_id)
        return self.devices[i] if i >= 0 else None

    def index(self, device_id: str) -> int:
        """Where the device is in `devices` (-1: not there); a binary search, as every
        status heard looks one up (O(n) each made a 10,000-device rollout O(n²))."""
        i = bisect.bisect_left(self.devices, device_id, key=_device_id)
        return i if i < len(self.devices) and self.devices[i].device_id == device_id else -1

    def by_id(self) -> dict[str, Device]:
        return {d.device_id: d for d in self.devices}


def _device_id(d: Device) -> str:
    return d.device_id


# ----------------------------------------------------------------------------- JSON


def to_json(r: Rollout) -> dict[str, Any]:
    devices = [device_to_json(d) for d in r.devices]
    return {**head_to_json(r), **gates_doc(r), "devices": devices}


def gates_doc(r: Rollout) -> dict[str, Any]:
    """The rollout's gates, their decisions and overrides (the store keeps them in a row of
    their own, written when they change: the head is rewritten at every save)."""
    return {
        "gates": gates_to_json(r.spec.gates),
        "checks": [check_to_json(c) for c in r.checks],
        "overrides": [override_to_json(o) for o in r.overrides],
    }


def device_to_json(d: Device) -> dict[str, Any]:
    return {"device_id": d.device_id, "wave": d.wave, "status": d.status.value,
            "attempt": d.attempt, "phase": d.phase, "reason": d.reason, "message": d.message,
            "offered_unix": d.offered_unix, "final_unix": d.final_unix,
            "heard_ts": d.heard_ts, "ignore_before_ts": d.ignore_before_ts,
            "excused": d.excused}  # fmt: skip


def head_to_json(r: Rollout) -> dict[str, Any]:
    """`to_json` without the devices (the store keeps one row per device) nor `gates_doc`."""
    s = r.spec
    return {
        "format": FORMAT,
        "spec": {
            "rollout_id": s.rollout_id,
            "update_id": s.update_id,
            "bundle": s.bundle,
            "model_name": s.model_name,
            "version_label": s.version_label,
            "target_sha256": s.target_sha256,
            "target": {"kind": s.target.kind, "group": s.target.group,
                       "devices": list(s.target.devices)},
            "waves": list(s.waves),
            "min_devices": s.min_devices,
            "max_failure_rate": s.max_failure_rate,
            "wave_timeout_s": s.wave_timeout_s,
            "soak_s": s.soak_s,
            "prefix": s.prefix,
            "created_unix": s.created_unix,
            "target_digest": s.target_digest,
            "connection": dict(s.connection),
        },
        "state": r.state.value,
        "reason": r.reason,
        "wave": r.wave,
        "waves": [
            {"index": w.index, "fraction": w.fraction, "started_unix": w.started_unix,
             "settled_unix": w.settled_unix, "ended_unix": w.ended_unix}
            for w in r.waves
        ],
        "updated_unix": r.updated_unix,
        "halts": list(r.halts),
        "skipped": list(r.skipped),
    }  # fmt: skip


def from_json(doc: Any, source: str) -> Rollout:
    """The Rollout in `doc` (from `source`, named in the error); RolloutError if it is not one."""
    try:
        if doc["format"] != FORMAT:
            raise RolloutError(f"{source}: format {doc['format']!r} is not {FORMAT}")
        s, t = doc["spec"], doc["spec"]["target"]
        spec = Spec(
            rollout_id=str(s["rollout_id"]),
            update_id=str(s["update_id"]),
            bundle=str(s["bundle"]),
            model_name=str(s["model_name"]),
            version_label=str(s["version_label"]),
            target_sha256=str(s["target_sha256"]),
            target=Target(str(t["kind"]), str(t["group"]), tuple(str(d) for d in t["devices"])),
            waves=tuple(float(w) for w in s["waves"]),
            min_devices=int(s["min_devices"]),
            max_failure_rate=float(s["max_failure_rate"]),
            wave_timeout_s=float(s["wave_timeout_s"]),
            soak_s=float(s["soak_s"]),
            prefix=str(s["prefix"]),
            created_unix=float(s["created_unix"]),
            target_digest=str(s.get("target_digest", "")),
            connection=tuple((str(k), str(v)) for k, v in s.get("connection", {}).items()),
            gates=gates_from_json(doc.get("gates")),
        )
        waves = tuple(
            Wave(int(w["index"]), float(w["fraction"]), float(w["started_unix"]),
                 float(w["settled_unix"]), float(w["ended_unix"]))
            for w in doc["waves"]
        )  # fmt: skip
        devices = tuple(_device(d) for d in doc["devices"])
        return Rollout(
            spec=spec,
            state=State(doc["state"]),
            reason=str(doc["reason"]),
            wave=int(doc["wave"]),
            waves=waves,
            devices=devices,
            updated_unix=float(doc["updated_unix"]),
            halts=tuple(str(h) for h in doc["halts"]),
            skipped=tuple(str(d) for d in doc["skipped"]),
            checks=tuple(check_from_json(c) for c in doc.get("checks", ())),
            overrides=tuple(override_from_json(o) for o in doc.get("overrides", ())),
        )
    except RolloutError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RolloutError(
            f"{source}: not a rollout state file ({type(exc).__name__}: {exc})"
        ) from exc


def _device(d: Any) -> Device:
    return Device(
        device_id=str(d["device_id"]),
        wave=int(d["wave"]),
        status=Status(d["status"]),
        attempt=int(d["attempt"]),
        phase=str(d["phase"]),
        reason=str(d["reason"]),
        message=str(d["message"]),
        offered_unix=float(d["offered_unix"]),
        final_unix=float(d["final_unix"]),
        heard_ts=float(d["heard_ts"]),
        ignore_before_ts=float(d["ignore_before_ts"]),
        excused=bool(d["excused"]),
    )
