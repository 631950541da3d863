"""The fleet's inventory: per device, what it runs and where (model, version, sha256,
quantization, profile, arch, agent version), its group and tags, presence and when it was last
heard of. The input an operator (and `agent.operator.rollout.run`) needs before a rollout.

Pure: built from a `agent.operator.view.FleetView` (the retained `state` and `health`), no MQTT,
no clock. Each field comes from the newer of the two halves by the device's clock, the other
filling what it lacks (a birth sent while the engine was loading names no model).
`edge-agent fleet inventory` prints it (`agent.operator.render.inventory_table`/`inventory_json`).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.operator.digest import HealthInfo, Presence, StateInfo
from agent.operator.view import (
    Device,
    FleetView,
    group_of,
    last_seen_of,
    newer_is_health,
    presence_of,
    tags_of,
)


@dataclass(frozen=True, slots=True)
class InventoryRow:
    """One device as the inventory shows it. Empty strings where the device did not say."""

    device_id: str
    group: str
    tags: tuple[str, ...]
    presence: Presence
    model: str  # the model's name
    version: str
    sha256: str  # of the model file that serves (hex, 64 characters)
    quantization: str
    profile: str
    arch: str  # platform.machine() of the device: aarch64, armv7l, x86_64
    agent_version: str
    last_seen_unix: float  # the newest evidence: a live arrival or a payload timestamp
    update_phase: str  # the last update's phase ("COMMITTED", "TRIAL", ...); "" if none
    session: int = 0  # the newest connection session seen in state or health
    update_id: str = ""  # the last update's id
    update_to_version: str = ""  # ... and the version it was going to
    digest: str = ""  # agent.model.directory.model_digest of the serving model ("" from old agents)
    # when a committed download may switch (docs/UPDATES.md "When to switch"): the policy in
    # force, what it waits for ("" = nothing), the window and its next start (0 = unknown)
    switch_policy: str = ""
    waiting_for: str = ""
    switch_window: str = ""
    next_window_unix: float = 0.0


def inventory(view: FleetView, group: str | None = None) -> dict[str, InventoryRow]:
    """Every device of `view` (only `group`'s, if given), by device id in sorted order."""
    return {
        device_id: inventory_row(view.devices[device_id])
        for device_id in sorted(view.devices)
        if group is None or group_of(view.devices[device_id]) == group
    }


def inventory_row(d: Device) -> InventoryRow:
    st, h = d.state, d.health
    name, version, quantization, sha, digest = _model(st, h, newer_is_health(d))
    first, second = (h, st) if newer_is_health(d) else (st, h)
    presence, _ = presence_of(d)
    return InventoryRow(
        device_id=d.device_id,
        group=group_of(d),
        tags=tags_of(d),
        presence=presence,
        model=name,
        version=version,
        sha256=sha,
        quantization=quantization,
        profile=_first(first, second, "profile"),
        arch=_first(first, second, "arch"),
        agent_version=_first(first, second, "agent_version"),
        last_seen_unix=last_seen_of(d),
        update_phase=h.update_phase if h else "",
        session=max(st.session if st else 0, h.session if h else 0),
        update_id=h.update_id if h else "",
        update_to_version=h.update_to_version if h else "",
        digest=digest,
        switch_policy=h.switch_policy if h else "",
        waiting_for=h.waiting_for if h else "",
        switch_window=h.switch_window if h else "",
        next_window_unix=h.next_window_unix if h else 0.0,
    )


def _first(a: StateInfo | HealthInfo | None, b: StateInfo | HealthInfo | None, field: str) -> str:
    for half in (a, b):
        value = getattr(half, field, "") if half is not None else ""
        if value:
            return str(value)
    return ""


def _model(
    st: StateInfo | None, h: HealthInfo | None, health_first: bool
) -> tuple[str, str, str, str, str]:
    """(name, version, quantization, sha256, digest) from the newer half that names a model."""
    from_health = (
        (h.model_name, h.model_version, h.model_quantization, h.model_sha256, h.model_digest)
        if h
        else None
    )
    from_state = (*split_model(st.model), st.model_sha256, st.model_digest) if st else None
    order = (from_health, from_state) if health_first else (from_state, from_health)
    for candidate in order:
        if candidate is not None and (candidate[0] or candidate[3]):
            return candidate
    return "", "", "", "", ""


def split_model(text: str) -> tuple[str, str, str]:
    """A birth's "name version quantization" as its three parts (a name may hold spaces)."""
    parts = text.rsplit(" ", 2)
    if len(parts) < 3:
        return (parts[0] if parts else ""), (parts[1] if len(parts) > 1 else ""), ""
    return parts[0], parts[1], parts[2]
