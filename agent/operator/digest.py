"""The operator's digest of one device's retained messages: what its latest `DeviceState`
says (presence, session) and the part of its latest `Health` the operator looks at.

Pure: no MQTT, no clock. `health_info` also summarises a `status` answer; payloads that
contradict their topic raise `_Malformed`, which `agent.operator.view.FleetView` counts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

_PHASES: Final = dict(
    zip(pb.UpdateStatus.Phase.values(), pb.UpdateStatus.Phase.keys(), strict=True)
)


class Presence(enum.StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"
    LOST = "lost"  # the Last Will: the broker lost the device without a clean stop
    UNKNOWN = "unknown"  # health but no state (or a cleared state)


_KINDS: Final = {
    pb.DeviceState.ONLINE: Presence.ONLINE,
    pb.DeviceState.OFFLINE: Presence.OFFLINE,
    pb.DeviceState.LOST: Presence.LOST,
}


@dataclass(frozen=True, slots=True)
class StateInfo:
    """What a device's latest `DeviceState` says."""

    presence: Presence
    session: int
    agent_version: str
    profile: str
    model: str  # "name version quantization"
    timestamp_unix: float
    model_sha256: str = ""
    model_digest: str = ""  # agent.model.directory.model_digest: every defining file
    group: str = ""
    tags: tuple[str, ...] = ()
    arch: str = ""


@dataclass(frozen=True, slots=True)
class HealthInfo:
    """The part of a device's latest `Health` the operator looks at."""

    seq: int
    session: int
    timestamp_unix: float
    agent_state: str
    agent_version: str
    profile: str
    model: str
    accelerator: str
    execution_path: str
    uptime_s: float
    rss_bytes: int
    budget_bytes: int
    ttft_p50_ms: float
    decode_tok_s_p50: float
    requests_total: int
    requests_failed: int
    requests_rejected: int
    max_celsius: float | None  # None: the device has no temperature sensor
    throttled_known: bool
    throttled_now: bool
    under_voltage: bool
    throttled_since_boot: bool
    disk_free_bytes: int
    disk_total_bytes: int
    update_phase: str  # "" when no update has happened
    update_to_version: str
    update_message: str
    update_reason_code: str
    update_downloaded_bytes: int
    update_total_bytes: int
    nonfinite_logits: int = 0
    model_name: str = ""
    model_version: str = ""
    model_quantization: str = ""
    model_sha256: str = ""
    model_digest: str = ""
    update_id: str = ""
    group: str = ""
    tags: tuple[str, ...] = ()
    arch: str = ""
    # the device says its wall clock is not synchronized: its updates wait before activating
    clock_unsynchronized: bool = False
    # when a committed download may switch (Health.activation; docs/UPDATES.md)
    switch_policy: str = ""  # "now" | "idle" | "window"
    waiting_for: str = ""  # "" | "metered" | "idle" | "window" | "clock"
    switch_window: str = ""
    next_window_unix: float = 0.0


class _Malformed(ValueError):
    pass


def _check_id(payload_id: str, device_id: str) -> None:
    if payload_id and payload_id != device_id:
        raise _Malformed(f"payload is for device {payload_id!r}")


def _state(m: pb.DeviceState, device_id: str) -> StateInfo:
    _check_id(m.device_id, device_id)
    if m.state not in _KINDS:
        raise _Malformed(f"state kind {m.state} is not ONLINE, OFFLINE or LOST")
    return StateInfo(
        presence=_KINDS[m.state],
        session=m.session,
        agent_version=m.agent_version,
        profile=m.profile,
        model=m.model,
        timestamp_unix=m.timestamp_unix,
        model_sha256=m.model_sha256,
        model_digest=m.model_digest,
        group=m.group,
        tags=tuple(m.tags),
        arch=m.arch,
    )


def _max_celsius(th: pb.Thermal) -> float | None:
    """The hottest reading; None when the device read no sensor (no zones: 0 is not a reading)."""
    if th.zones:
        return th.max_celsius or max(z.celsius for z in th.zones)
    return th.max_celsius or None


def health_info(m: pb.Health, device_id: str | None = None) -> HealthInfo:
    """The operator's summary of a `Health` (from the topic, or a `status` answer); with
    `device_id`, a payload naming another device is malformed."""
    if device_id is not None:
        _check_id(m.device_id, device_id)
    ref, mem, req, th, disk, upd = (
        m.model,
        m.memory,
        m.requests,
        m.thermal,
        m.disk,
        m.last_update,
    )
    phase = _PHASES.get(upd.phase, f"PHASE_{upd.phase}") if upd.phase else ""
    return HealthInfo(
        seq=m.seq,
        session=m.session,
        timestamp_unix=m.timestamp_unix,
        agent_state=m.agent_state,
        agent_version=m.agent_version,
        profile=m.profile,
        model=" ".join(p for p in (ref.name, ref.version, ref.quantization) if p),
        accelerator=m.accelerator,
        execution_path=m.execution_path,
        uptime_s=m.uptime_s,
        rss_bytes=mem.rss_bytes,
        budget_bytes=mem.budget_bytes,
        ttft_p50_ms=req.ttft_ms.p50,
        decode_tok_s_p50=req.decode_tok_s.p50,
        requests_total=req.total,
        requests_failed=req.failed,
        requests_rejected=req.rejected,
        nonfinite_logits=req.nonfinite_logits,
        max_celsius=_max_celsius(th),
        throttled_known=th.throttled_known,
        throttled_now=th.throttled_now,
        under_voltage=th.under_voltage,
        throttled_since_boot=th.throttled_since_boot,
        disk_free_bytes=disk.free_bytes,
        disk_total_bytes=disk.total_bytes,
        update_phase=phase,
        update_to_version=upd.to_version,
        update_message=upd.message,
        update_reason_code=upd.reason_code,
        update_downloaded_bytes=upd.downloaded_bytes,
        update_total_bytes=upd.total_bytes,
        model_name=ref.name,
        model_version=ref.version,
        model_quantization=ref.quantization,
        model_sha256=ref.sha256,
        model_digest=ref.digest,
        update_id=upd.update_id,
        clock_unsynchronized=m.HasField("clock") and not m.clock.synchronized,
        group=m.group,
        tags=tuple(m.tags),
        arch=m.arch,
        switch_policy=m.activation.policy,
        waiting_for=m.activation.waiting_for,
        switch_window=m.activation.window,
        next_window_unix=m.activation.next_window_unix,
    )
