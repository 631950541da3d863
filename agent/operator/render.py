"""The renderings of `agent.operator.view.FleetView`: a text table that fits a terminal, and
JSON; and the same two of the fleet's inventory (`agent.operator.inventory`). Pure: all take
`now`. docs/FLEET.md describes the columns and the order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from agent.operator.digest import HealthInfo, Presence
from agent.operator.inventory import InventoryRow
from agent.operator.view import FleetView, Row, age

_MIB: Final = 1 << 20


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


R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _Column(Generic[R]):
    title: str
    drop: int  # dropped in this order (lowest first) when the terminal is narrow; 99: never
    cell: Callable[[R, float], str]
    right: bool = False
    max_width: int = 24
    min_width: int = 0  # > 0: may be cut down to this (with "…") instead of dropped
    hide_empty: bool = False  # left out when no shown row has a value ("-")


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


COLUMNS: Final[tuple[_Column[Row], ...]] = (
    _Column("DEVICE", 99, lambda r, now: r.device_id, max_width=40, min_width=12),
    _Column("STATE", 99, _state_cell, max_width=18),
    _Column("GROUP", 3, lambda r, now: r.group or "-", max_width=24, hide_empty=True),
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


def summary(
    view: FleetView, now: float, filter: str | None = None, group: str | None = None
) -> str:
    """The header line: counts by state, stale, with issues, and what was ignored."""
    return _summary(view, view.rows(now, filter, group), filter, group)


def _summary(view: FleetView, rows: list[Row], filter: str | None, group: str | None) -> str:
    counts = {p: 0 for p in Presence}
    for r in rows:
        counts[r.presence] += 1
    text = f"{len(rows)} device{'s' if len(rows) != 1 else ''}: " + ", ".join(
        f"{counts[p]} {p}" for p in Presence if counts[p] or p is not Presence.UNKNOWN
    )
    stale = sum(r.stale for r in rows)
    issues = sum(r.rank == 1 for r in rows)
    text += f" · {stale} stale · {issues} with issues"
    if filter or group is not None:
        which = " ".join(
            ([f"group {group!r}"] if group is not None else [])
            + ([f"filter {filter!r}"] if filter else [])
        )
        text = f"{which}: {text} (of {len(view.devices)})"
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
    group: str | None = None,
) -> str:
    """The table: a summary line, column titles, then one line per device, problems first.

    `max_rows` bounds the device lines, including the "… N more" line that replaces the rest.
    Columns that do not fit `width` are dropped (least useful first), then long cells are cut.
    Only the shown rows are formatted.
    """
    rows = view.rows(now, filter, group)
    shown: Sequence[Row] = rows
    more = ""
    if max_rows is not None and len(rows) > max_rows:
        keep = max(0, max_rows - 1)
        shown, rest = rows[:keep], rows[keep:]
        problems = sum(r.rank < 2 for r in rest)
        more = f"… {len(rest)} more" + (f" ({problems} with problems)" if problems else "")
    lines = [_cut_summary(_summary(view, rows, filter, group), width)]
    lines += _table(COLUMNS, shown, now, width)
    if more:
        lines.append(more[:width])
    if not rows:
        lines.append("(no devices)" if not (filter or group is not None) else "(no device matches)")
    return "\n".join(lines)


def _table(columns: Sequence[_Column[R]], shown: Sequence[R], now: float, width: int) -> list[str]:
    """The column titles and one line per shown row, fitted to `width`."""
    cells = [[c.cell(r, now) for c in columns] for r in shown]
    cols, widths = _layout(columns, cells, width)
    lines = [_line(columns, [columns[i].title for i in cols], cols, widths, width, title=True)]
    lines += [_line(columns, [row[i] for i in cols], cols, widths, width) for row in cells]
    return lines


def _cut_summary(text: str, width: int) -> str:
    """Too long for the terminal: drop whole " · " parts from the end, not half a word."""
    if len(text) <= width:
        return text
    cut = text.rfind(" · ", 0, width + 1)
    return text[:cut] if cut > 0 else text[:width]


def _layout(
    columns: Sequence[_Column[R]], cells: list[list[str]], width: int
) -> tuple[list[int], list[int]]:
    """Which columns to show and how wide: drop the least useful until the natural widths fit,
    then cut the flexible ones (widest first) down to their minimum."""
    natural = [
        min(c.max_width, max([len(c.title), *(len(row[i]) for row in cells)]))
        for i, c in enumerate(columns)
    ]
    cols = [
        i
        for i, c in enumerate(columns)
        if not c.hide_empty or any(row[i] not in ("", "-") for row in cells)
    ]

    def total() -> int:
        return sum(natural[i] for i in cols) + _GAP * (len(cols) - 1)

    for i in sorted((i for i in cols if columns[i].drop < 99), key=lambda i: columns[i].drop):
        if total() <= width:
            break
        if columns[i].min_width and total() - natural[i] + columns[i].min_width <= width:
            break  # cutting this one is enough; keep it
        cols.remove(i)
    widths = [natural[i] for i in cols]
    over = total() - width
    for k in sorted(range(len(cols)), key=lambda k: -widths[k]):
        if over <= 0:
            break
        floor = columns[cols[k]].min_width
        if floor and widths[k] > floor:
            cut = min(over, widths[k] - floor)
            widths[k] -= cut
            over -= cut
    return cols, widths


def _line(
    columns: Sequence[_Column[R]],
    values: list[str],
    cols: list[int],
    widths: list[int],
    width: int,
    title: bool = False,
) -> str:
    out = []
    for k, (value, w) in enumerate(zip(values, widths, strict=True)):
        text = value if len(value) <= w else value[: max(0, w - 1)] + "…"
        right = columns[cols[k]].right and not title
        last = k == len(cols) - 1
        out.append(text.rjust(w) if right else (text if last else text.ljust(w)))
    return (" " * _GAP).join(out).rstrip()[:width]


# ----------------------------------------------------------------------------- JSON


def to_json(
    view: FleetView, now: float, filter: str | None = None, group: str | None = None
) -> list[dict[str, object]]:
    """One dict per device, sorted by device id (the table's fields, unabbreviated)."""
    out: list[dict[str, object]] = []
    for r in sorted(view.rows(now, filter, group), key=lambda r: r.device_id):
        d = r.device
        out.append(
            {
                "device": r.device_id,
                "state": str(r.presence),
                "session": r.session,
                "model": r.model,
                "profile": r.profile,
                "group": r.group,
                "tags": list(r.tags),
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


# ----------------------------------------------------------------------------- inventory


def _update_cell(r: InventoryRow, now: float) -> str:
    return f"{r.update_phase.lower()} {r.update_to_version}".strip() if r.update_phase else "-"


def _switch_cell(r: InventoryRow, now: float) -> str:
    """The switch policy, and what a committed download waits for: "idle: waits for idle"."""
    if not r.waiting_for:
        return r.switch_policy if r.switch_policy not in ("", "now") else "-"
    return f"{r.switch_policy}: waits for {r.waiting_for}"


def _presence_cell(r: InventoryRow, now: float) -> str:
    return "?" if r.presence is Presence.UNKNOWN else str(r.presence)


INVENTORY_COLUMNS: Final[tuple[_Column[InventoryRow], ...]] = (
    _Column("DEVICE", 99, lambda r, now: r.device_id, max_width=40, min_width=12),
    _Column("GROUP", 6, lambda r, now: r.group or "-", hide_empty=True),
    _Column("TAGS", 1, lambda r, now: ",".join(r.tags) or "-", max_width=32, hide_empty=True),
    _Column("MODEL", 99, lambda r, now: r.model or "-", max_width=32, min_width=8),
    _Column("VERSION", 99, lambda r, now: r.version or "-", max_width=16),
    _Column("SHA256", 8, lambda r, now: r.sha256[:SHORT_SHA] or "-"),
    _Column("QUANT", 7, lambda r, now: r.quantization or "-"),
    _Column("PROFILE", 4, lambda r, now: r.profile or "-"),
    _Column("ARCH", 5, lambda r, now: r.arch or "-"),
    _Column("AGENT", 3, lambda r, now: r.agent_version or "-"),
    _Column("STATE", 99, _presence_cell),
    _Column("UPDATE", 2, _update_cell),
    _Column("SWITCH", 2, _switch_cell, max_width=28, hide_empty=True),
    _Column("SEEN", 9, lambda r, now: age(now - r.last_seen_unix), right=True),
)
SHORT_SHA: Final = 12


def inventory_table(rows: Mapping[str, InventoryRow], now: float, width: int) -> str:
    """One line per device, sorted by device id, after a count; columns fit `width`."""
    shown = [rows[k] for k in sorted(rows)]
    counts = {p: sum(r.presence is p for r in shown) for p in Presence}
    head = f"{len(shown)} device{'s' if len(shown) != 1 else ''}: " + ", ".join(
        f"{counts[p]} {p}" for p in Presence if counts[p] or p is not Presence.UNKNOWN
    )
    models = len({(r.model, r.version, r.sha256) for r in shown if r.sha256})
    head += f" · {models} model build{'s' if models != 1 else ''}"
    lines = [_cut_summary(head, width), *_table(INVENTORY_COLUMNS, shown, now, width)]
    if not shown:
        lines.append("(no devices)")
    return "\n".join(lines)


def inventory_json(rows: Mapping[str, InventoryRow], now: float) -> list[dict[str, object]]:
    """One object per device, sorted by device id, with the keys docs/FLEET.md lists."""
    return [
        {
            "device": r.device_id,
            "group": r.group,
            "tags": list(r.tags),
            "state": str(r.presence),
            "session": r.session,
            "model": r.model,
            "version": r.version,
            "sha256": r.sha256,
            "digest": r.digest,
            "quantization": r.quantization,
            "profile": r.profile,
            "arch": r.arch,
            "agent_version": r.agent_version,
            "last_seen_unix": r.last_seen_unix,
            "last_seen_age_s": round(max(0.0, now - r.last_seen_unix), 1),
            "update_phase": r.update_phase,
            "update_id": r.update_id,
            "update_to_version": r.update_to_version,
            "switch_policy": r.switch_policy,
            "waiting_for": r.waiting_for,
            "switch_window": r.switch_window,
            "next_window_unix": r.next_window_unix,
        }
        for r in (rows[k] for k in sorted(rows))
    ]
