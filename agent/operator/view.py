"""The operator's model of a fleet: one row per device, built from the retained `state` and
`health` messages.

Pure: no MQTT, no clock. `FleetView.update` takes a topic, the payload bytes and the time it was
received; `FleetView.rows` takes `now`. docs/FLEET.md describes the columns and the order;
`agent.operator.render` draws the rows as a text table or JSON.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Final

from agent.fleet.codec import ContentType, PayloadError, decode
from agent.fleet.topics import DEFAULT_PREFIX, parse
from agent.operator.digest import HealthInfo, Presence, StateInfo, _Malformed, _state, health_info
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S: Final = 60.0  # FleetConfig.health_interval_s
DEFAULT_STALE_AFTER_S: Final = 3 * DEFAULT_HEARTBEAT_S
STATE_TYPE: Final = pb.DeviceState.DESCRIPTOR.full_name
HEALTH_TYPE: Final = pb.Health.DESCRIPTOR.full_name
_BAD_UPDATES: Final = ("REJECTED", "ROLLED_BACK", "FAILED")


@dataclass(frozen=True, slots=True)
class Device:
    """Everything received for one device id."""

    device_id: str
    state: StateInfo | None = None
    health: HealthInfo | None = None
    last_received_unix: float = 0.0  # when the latest message for it arrived (any kind)
    live_unix: float = 0.0  # when the latest non-retained message arrived (0: only retained)


@dataclass(frozen=True, slots=True)
class Row:
    """A device as the table shows it, derived at `now`."""

    device: Device
    presence: Presence
    session: int
    model: str
    profile: str
    last_seen_unix: float  # the newest evidence: a live arrival or a payload timestamp
    stale: bool
    issues: tuple[str, ...]
    rank: int  # 0 lost, 1 online with issues, 2 offline, 3 the rest
    late_will: bool = False  # the retained state is a Will older than the health's session
    group: str = ""  # [fleet] group, from the newer of state and health
    tags: tuple[str, ...] = ()

    @property
    def device_id(self) -> str:
        return self.device.device_id


class FleetView:
    """Devices by id, updated message by message. Malformed payloads are counted, not raised."""

    def __init__(
        self, prefix: str = DEFAULT_PREFIX, stale_after_s: float = DEFAULT_STALE_AFTER_S
    ) -> None:
        self.prefix = prefix
        self.stale_after_s = stale_after_s
        self.devices: dict[str, Device] = {}
        self.messages = 0
        self.malformed = 0
        self.last_malformed = ""  # "<topic>: <why>" of the latest one
        self.late_wills = 0  # LOST states older than the session we know, ignored
        self.out_of_order = 0  # health of the same session with a lower seq, ignored

    def update(
        self,
        topic: str,
        payload: bytes,
        received_unix: float,
        *,
        retained: bool = False,
        message_type: str | None = None,
        content: ContentType | None = None,
    ) -> bool:
        """Apply one message; True if the view changed. `message_type` is the payload type its
        content-type property names, if it had one. An empty payload (a cleared retained topic)
        forgets that half of the device; a device with neither half is dropped."""
        parsed = parse(self.prefix, topic)
        if parsed is None or parsed.kind not in ("state", "health"):
            return False
        self.messages += 1
        device_id = parsed.device
        old = self.devices.get(device_id) or Device(device_id)
        expected = STATE_TYPE if parsed.kind == "state" else HEALTH_TYPE
        if message_type is not None and message_type != expected:
            return self._malformed(topic, f"content-type names {message_type}, not {expected}")
        if not payload:
            if parsed.kind == "state":
                new = dataclasses.replace(old, state=None)
            else:
                new = dataclasses.replace(old, health=None)
            if new.state is None and new.health is None:
                return self.devices.pop(device_id, None) is not None
            self.devices[device_id] = new
            return new != old
        try:
            if parsed.kind == "state":
                state = _state(decode(pb.DeviceState, payload, content), device_id)
                if state.presence is Presence.LOST and state.session < _known_session(old):
                    self.late_wills += 1
                    log.info("ignoring a late Will of %s (session %d)", device_id, state.session)
                    return False
                new = dataclasses.replace(old, state=state)
            else:
                health = health_info(decode(pb.Health, payload, content), device_id)
                if (
                    old.health is not None
                    and health.session == old.health.session
                    and health.seq < old.health.seq
                ):
                    self.out_of_order += 1
                    return False
                new = dataclasses.replace(old, health=health)
        except _Malformed as exc:
            return self._malformed(topic, str(exc))
        except PayloadError as exc:
            return self._malformed(topic, str(exc))
        except (ValueError, RuntimeError) as exc:
            return self._malformed(topic, f"not a {expected}: {exc}")
        new = dataclasses.replace(
            new,
            last_received_unix=received_unix,
            live_unix=old.live_unix if retained else received_unix,
        )
        self.devices[device_id] = new
        return True

    def _malformed(self, topic: str, why: str) -> bool:
        self.malformed += 1
        self.last_malformed = f"{topic}: {why}"
        log.info("ignoring a malformed message on %s", self.last_malformed)
        return False

    def rows(self, now: float, filter: str | None = None, group: str | None = None) -> list[Row]:
        """Every device (matching `filter`, in `group`), problems first: lost, then online with
        issues (stale, throttled, errors), then offline, then the rest; then by device id."""
        needle = (filter or "").lower()
        rows = [
            _row(d, now, self.stale_after_s)
            for d in self.devices.values()
            if (not needle or needle in _haystack(d)) and (group is None or group_of(d) == group)
        ]
        rows.sort(key=lambda r: (r.rank, r.device_id))
        return rows


def _known_session(d: Device) -> int:
    """The newest session this device is known to have had."""
    return max(d.state.session if d.state else 0, d.health.session if d.health else 0)


def _haystack(d: Device) -> str:
    parts = [d.device_id]
    for half in (d.state, d.health):
        if half is not None:
            parts += [half.model, half.profile]
    return " ".join(parts).lower()


def presence_of(d: Device) -> tuple[Presence, bool]:
    """The device's presence, and whether its retained state is a late Will (then: online)."""
    st, h = d.state, d.health
    presence = st.presence if st else Presence.UNKNOWN
    late_will = (
        presence is Presence.LOST and h is not None and st is not None and h.session > st.session
    )
    # a late Will overwrote the retained birth of a newer session, which still reports
    return (Presence.ONLINE if late_will else presence), late_will


def last_seen_of(d: Device) -> float:
    """The newest evidence of the device: a live arrival or a payload's own timestamp."""
    heard = [d.live_unix]
    heard += [d.health.timestamp_unix] if d.health is not None else []
    heard += [d.state.timestamp_unix] if d.state is not None else []
    return max(heard)


def newer_is_health(d: Device) -> bool:
    """Whether the health is the newer half (by the device's clock) of what we have."""
    h, st = d.health, d.state
    return h is not None and (st is None or h.timestamp_unix >= st.timestamp_unix)


def group_of(d: Device) -> str:
    """The group the newer half announces (both carry it: birth, Will, OFFLINE and health)."""
    half = d.health if newer_is_health(d) else d.state
    return half.group if half is not None else ""


def tags_of(d: Device) -> tuple[str, ...]:
    half = d.health if newer_is_health(d) else d.state
    return half.tags if half is not None else ()


def _row(d: Device, now: float, stale_after_s: float) -> Row:
    st, h = d.state, d.health
    presence, late_will = presence_of(d)
    session = _known_session(d)
    newer_health = newer_is_health(d)
    model = (h.model if newer_health and h else "") or (st.model if st else "")
    profile = (h.profile if newer_health and h else "") or (st.profile if st else "")
    last_seen = last_seen_of(d)
    stale = presence is Presence.ONLINE and now - last_seen > stale_after_s
    issues: list[str] = []
    if stale:
        issues.append(f"stale {age(now - last_seen)}")
    if h is not None and presence is not Presence.OFFLINE:
        issues += _health_issues(h)
    if presence is Presence.LOST:
        rank = 0
    elif presence is Presence.OFFLINE:
        rank = 2
    elif issues:
        rank = 1
    else:
        rank = 3
    return Row(
        d,
        presence,
        session,
        model,
        profile,
        last_seen,
        stale,
        tuple(issues),
        rank,
        late_will,
        group_of(d),
        tags_of(d),
    )


def _health_issues(h: HealthInfo) -> list[str]:
    issues = []
    if h.throttled_now:
        issues.append("throttled")
    if h.under_voltage:
        issues.append("under-voltage")
    if h.budget_bytes and h.rss_bytes > h.budget_bytes:
        issues.append("rss>budget")
    if h.requests_failed:
        issues.append(f"{h.requests_failed} failed")
    if h.nonfinite_logits:
        issues.append(f"{h.nonfinite_logits} non-finite logits")
    if h.clock_unsynchronized:
        issues.append("clock unsynchronized")
    # a replayed offer (the same update again) is refused and changes nothing: not an issue
    if h.update_phase in _BAD_UPDATES and not _harmless(h):
        why = f" ({h.update_reason_code})" if h.update_reason_code else ""
        issues.append(f"update {h.update_phase.lower()}{why}")
    return issues


def _harmless(h: HealthInfo) -> bool:
    return h.update_phase == "REJECTED" and h.update_reason_code == "replay"


def age(seconds: float) -> str:
    """A short age: 42s, 17m, 5h, 3d."""
    s = max(0.0, seconds)
    if s < 100:
        return f"{s:.0f}s"
    if s < 6000:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"
