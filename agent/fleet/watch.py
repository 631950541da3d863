"""The operator's model of a fleet: one row per device, built from the retained `state` and
`health` messages, and its renderings (a text table that fits a terminal, and JSON).

Pure: no MQTT, no clock. `FleetView.update` takes a topic, the payload bytes and the time it was
received; `render` and `to_json` take `now`. docs/FLEET.md describes the columns and the order.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from google.protobuf.message import DecodeError

from agent.fleet.topics import DEFAULT_PREFIX, parse
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S: Final = 60.0  # FleetConfig.health_interval_s
DEFAULT_STALE_AFTER_S: Final = 3 * DEFAULT_HEARTBEAT_S
STATE_TYPE: Final = pb.DeviceState.DESCRIPTOR.full_name
HEALTH_TYPE: Final = pb.Health.DESCRIPTOR.full_name
_PHASES: Final = dict(
    zip(pb.UpdateStatus.Phase.values(), pb.UpdateStatus.Phase.keys(), strict=True)
)
_BAD_UPDATES: Final = ("REJECTED", "ROLLED_BACK", "FAILED")
_MIB: Final = 1 << 20


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
                state = _state(pb.DeviceState.FromString(payload), device_id)
                if state.presence is Presence.LOST and state.session < _known_session(old):
                    self.late_wills += 1
                    log.info("ignoring a late Will of %s (session %d)", device_id, state.session)
                    return False
                new = dataclasses.replace(old, state=state)
            else:
                health = health_info(pb.Health.FromString(payload), device_id)
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
        except (DecodeError, ValueError, RuntimeError) as exc:
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

    def rows(self, now: float, filter: str | None = None) -> list[Row]:
        """Every device (matching `filter`), problems first: lost, then online with issues
        (stale, throttled, errors), then offline, then the rest; then by device id."""
        needle = (filter or "").lower()
        rows = [
            _row(d, now, self.stale_after_s)
            for d in self.devices.values()
            if not needle or needle in _haystack(d)
        ]
        rows.sort(key=lambda r: (r.rank, r.device_id))
        return rows


class _Malformed(ValueError):
    pass


def _known_session(d: Device) -> int:
    """The newest session this device is known to have had."""
    return max(d.state.session if d.state else 0, d.health.session if d.health else 0)


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
    )


def _haystack(d: Device) -> str:
    parts = [d.device_id]
    for half in (d.state, d.health):
        if half is not None:
            parts += [half.model, half.profile]
    return " ".join(parts).lower()


def _row(d: Device, now: float, stale_after_s: float) -> Row:
    st, h = d.state, d.health
    presence = st.presence if st else Presence.UNKNOWN
    session = _known_session(d)
    late_will = (
        presence is Presence.LOST and h is not None and st is not None and h.session > st.session
    )
    if late_will:
        # a late Will overwrote the retained birth of a newer session, which still reports
        presence = Presence.ONLINE
    newer_health = h is not None and (st is None or h.timestamp_unix >= st.timestamp_unix)
    model = (h.model if newer_health and h else "") or (st.model if st else "")
    profile = (h.profile if newer_health and h else "") or (st.profile if st else "")
    heard = [d.live_unix]
    heard += [h.timestamp_unix] if h is not None else []
    heard += [st.timestamp_unix] if st is not None else []
    last_seen = max(heard)
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
        d, presence, session, model, profile, last_seen, stale, tuple(issues), rank, late_will
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
    if h.update_phase in _BAD_UPDATES:
        why = f" ({h.update_reason_code})" if h.update_reason_code else ""
        issues.append(f"update {h.update_phase.lower()}{why}")
    return issues


# ----------------------------------------------------------------------------- text


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


def _bytes(n: int) -> str:
    if n >= 10 << 30:
        return f"{n / (1 << 30):.0f}G"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f}G"
    return f"{n / _MIB:.0f}M"


def _num(x: float) -> str:
    if not x or math.isnan(x):
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


@dataclass(frozen=True, slots=True)
class _Column:
    title: str
    drop: int  # dropped in this order (lowest first) when the terminal is narrow; 99: never
    cell: Callable[[Row, float], str]
    right: bool = False
    max_width: int = 24
    min_width: int = 0  # > 0: may be cut down to this (with "…") instead of dropped


def _h(f: Callable[[HealthInfo], str]) -> Callable[[Row, float], str]:
    return lambda r, now: f(r.device.health) if r.device.health else "-"


def _mem(h: HealthInfo) -> str:
    if not h.rss_bytes:
        return "-"
    budget = f"/{h.budget_bytes / _MIB:.0f}" if h.budget_bytes else ""
    return f"{h.rss_bytes / _MIB:.0f}{budget}M"


def _state_cell(r: Row, now: float) -> str:
    h = r.device.health
    if r.presence is Presence.ONLINE and h and h.agent_state and h.agent_state != "serving":
        return f"online/{h.agent_state}"
    return "?" if r.presence is Presence.UNKNOWN else str(r.presence)


def _health_age(r: Row, now: float) -> str:
    return age(now - r.device.health.timestamp_unix) if r.device.health else "-"


def _update(h: HealthInfo) -> str:
    if not h.update_phase:
        return "-"
    text = f"{h.update_phase.lower()} {h.update_to_version}".strip()
    if h.update_phase == "DOWNLOADING" and h.update_total_bytes:
        text += f" {100 * h.update_downloaded_bytes // h.update_total_bytes}%"
    return text


COLUMNS: Final[tuple[_Column, ...]] = (
    _Column("DEVICE", 99, lambda r, now: r.device_id, max_width=40, min_width=12),
    _Column("STATE", 99, _state_cell, max_width=18),
    _Column("SESS", 1, lambda r, now: str(r.session) if r.session else "-", right=True),
    _Column("MODEL", 12, lambda r, now: r.model or "-", max_width=32, min_width=12),
    _Column("PROFILE", 3, lambda r, now: r.profile or "-", max_width=24),
    _Column("MEM", 10, _h(_mem), right=True),
    _Column("TTFT", 7, _h(lambda h: f"{h.ttft_p50_ms:.0f}ms" if h.ttft_p50_ms else "-"), True),
    _Column("TOK/S", 8, _h(lambda h: _num(h.decode_tok_s_p50)), right=True),
    _Column("REQ/FAIL", 9, _h(lambda h: f"{h.requests_total}/{h.requests_failed}"), True),
    _Column(
        "TEMP", 6, _h(lambda h: "-" if h.max_celsius is None else f"{h.max_celsius:.0f}C"), True
    ),
    _Column(
        "DISK", 4, _h(lambda h: _bytes(h.disk_free_bytes) if h.disk_total_bytes else "-"), True
    ),
    _Column("UPDATE", 5, _h(_update)),
    _Column("SEEN", 11, lambda r, now: age(now - r.last_seen_unix), right=True),
    _Column("HEALTH", 2, _health_age, right=True),
    _Column("ISSUES", 99, lambda r, now: ", ".join(r.issues), max_width=60, min_width=10),
)
_GAP: Final = 2


def summary(view: FleetView, now: float, filter: str | None = None) -> str:
    """The header line: counts by state, stale, with issues, and what was ignored."""
    return _summary(view, view.rows(now, filter), filter)


def _summary(view: FleetView, rows: list[Row], filter: str | None) -> str:
    counts = {p: 0 for p in Presence}
    for r in rows:
        counts[r.presence] += 1
    text = f"{len(rows)} device{'s' if len(rows) != 1 else ''}: " + ", ".join(
        f"{counts[p]} {p}" for p in Presence if counts[p] or p is not Presence.UNKNOWN
    )
    stale = sum(r.stale for r in rows)
    issues = sum(r.rank == 1 for r in rows)
    text += f" · {stale} stale · {issues} with issues"
    if filter:
        text = f"filter {filter!r}: {text} (of {len(view.devices)})"
    ignored = []
    if view.malformed:
        ignored.append(f"{view.malformed} malformed")
    late = view.late_wills + sum(r.late_will for r in rows)
    if late:
        ignored.append(f"{late} late will{'s' if late != 1 else ''}")
    if ignored:
        text += " · ignored " + ", ".join(ignored)
    return text


def render(
    view: FleetView,
    now: float,
    width: int,
    max_rows: int | None = None,
    filter: str | None = None,
) -> str:
    """The table: a summary line, column titles, then one line per device, problems first.

    `max_rows` bounds the device lines, including the "… N more" line that replaces the rest.
    Columns that do not fit `width` are dropped (least useful first), then long cells are cut.
    """
    rows = view.rows(now, filter)
    shown: Sequence[Row] = rows
    more = ""
    if max_rows is not None and len(rows) > max_rows:
        keep = max(0, max_rows - 1)
        shown, rest = rows[:keep], rows[keep:]
        problems = sum(r.rank < 2 for r in rest)
        more = f"… {len(rest)} more" + (f" ({problems} with problems)" if problems else "")
    cells = [[c.cell(r, now) for c in COLUMNS] for r in shown]
    cols, widths = _layout(cells, width)
    lines = [_cut_summary(_summary(view, rows, filter), width)]
    lines.append(_line([COLUMNS[i].title for i in cols], cols, widths, width, title=True))
    lines += [_line([row[i] for i in cols], cols, widths, width) for row in cells]
    if more:
        lines.append(more[:width])
    if not rows:
        lines.append("(no devices)" if not filter else "(no device matches the filter)")
    return "\n".join(lines)


def _cut_summary(text: str, width: int) -> str:
    """Too long for the terminal: drop whole " · " parts from the end, not half a word."""
    if len(text) <= width:
        return text
    cut = text.rfind(" · ", 0, width + 1)
    return text[:cut] if cut > 0 else text[:width]


def _layout(cells: list[list[str]], width: int) -> tuple[list[int], list[int]]:
    """Which columns to show and how wide: drop the least useful until the natural widths fit,
    then cut the flexible ones (widest first) down to their minimum."""
    natural = [
        min(c.max_width, max([len(c.title), *(len(row[i]) for row in cells)]))
        for i, c in enumerate(COLUMNS)
    ]
    cols = list(range(len(COLUMNS)))

    def total() -> int:
        return sum(natural[i] for i in cols) + _GAP * (len(cols) - 1)

    for i in sorted((i for i in cols if COLUMNS[i].drop < 99), key=lambda i: COLUMNS[i].drop):
        if total() <= width:
            break
        if COLUMNS[i].min_width and total() - natural[i] + COLUMNS[i].min_width <= width:
            break  # cutting this one is enough; keep it
        cols.remove(i)
    widths = [natural[i] for i in cols]
    over = total() - width
    for k in sorted(range(len(cols)), key=lambda k: -widths[k]):
        if over <= 0:
            break
        floor = COLUMNS[cols[k]].min_width
        if floor and widths[k] > floor:
            cut = min(over, widths[k] - floor)
            widths[k] -= cut
            over -= cut
    return cols, widths


def _line(
    values: list[str], cols: list[int], widths: list[int], width: int, title: bool = False
) -> str:
    out = []
    for k, (value, w) in enumerate(zip(values, widths, strict=True)):
        text = value if len(value) <= w else value[: max(0, w - 1)] + "…"
        right = COLUMNS[cols[k]].right and not title
        last = k == len(cols) - 1
        out.append(text.rjust(w) if right else (text if last else text.ljust(w)))
    return (" " * _GAP).join(out).rstrip()[:width]


# ----------------------------------------------------------------------------- JSON


def to_json(view: FleetView, now: float, filter: str | None = None) -> list[dict[str, object]]:
    """One dict per device, sorted by device id (the table's fields, unabbreviated)."""
    out: list[dict[str, object]] = []
    for r in sorted(view.rows(now, filter), key=lambda r: r.device_id):
        d = r.device
        out.append(
            {
                "device": r.device_id,
                "state": str(r.presence),
                "session": r.session,
                "model": r.model,
                "profile": r.profile,
                "agent_version": (d.health.agent_version if d.health else "")
                or (d.state.agent_version if d.state else ""),
                "stale": r.stale,
                "issues": list(r.issues),
                "last_seen_unix": r.last_seen_unix,
                "last_received_unix": d.last_received_unix,
                "state_timestamp_unix": d.state.timestamp_unix if d.state else None,
                "health": dataclasses.asdict(d.health) if d.health else None,
            }
        )
    return out
