"""What each console page shows, as plain values for its template (`templates/`): built from a
snapshot of the live fleet or from one rollout read from the store. Pure: no I/O, no clock
(`now` is given).

Bounds (docs/ROLLOUTS.md "The console"): a value from a device shows at most `MAX_FIELD`
characters; the device table shows `PAGE_SIZE` devices a page (`?page=N`, narrowed by
`?group=G` and `?q=TEXT`), the group/profile/version summary at most `MAX_SUMMARY` rows, a
rollout's device table at most `MAX_ROLLOUT_DEVICES` rows; each says how many more there are.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from agent.operator.console.charts import fleet_figure, gate_figures, health_figures
from agent.operator.console.history import Series
from agent.operator.digest import HealthInfo, Presence
from agent.operator.inventory import InventoryRow
from agent.operator.rollout.report import report
from agent.operator.rollout.state import Rollout
from agent.operator.view import age

PAGE_SIZE: Final = 200
MAX_SUMMARY: Final = 500
MAX_ROLLOUT_DEVICES: Final = 500
MAX_QUERY: Final = 100  # characters of ?q= and ?group= looked at
MAX_FIELD: Final = 120  # characters of one value from a device in a table cell or a legend


def clip(value: object, limit: int = MAX_FIELD) -> str:
    """A value from the network as a page shows it: at most `limit` characters."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class SummaryRow:
    group: str
    profile: str
    model: str  # "name version"
    devices: int
    online: int


def _model(r: InventoryRow) -> str:
    return " ".join(p for p in (r.model, r.version) if p)


def overview(
    rows: Mapping[str, InventoryRow], now: float, *, page: int, group: str | None, query: str
) -> dict[str, Any]:
    """The fleet page: counts, the summary by group/profile/version, one page of devices."""
    all_rows = list(rows.values())
    presence = Counter(r.presence.value for r in all_rows)
    combos: Counter[tuple[str, str, str]] = Counter()
    online: Counter[tuple[str, str, str]] = Counter()
    for r in all_rows:
        key = (r.group, r.profile, _model(r))
        combos[key] += 1
        online[key] += r.presence is Presence.ONLINE
    summary = [SummaryRow(g, p, m, n, online[(g, p, m)]) for (g, p, m), n in sorted(combos.items())]
    needle = query[:MAX_QUERY].lower()
    shown = [
        r for r in all_rows
        if (group is None or r.group == group)
        and (not needle or needle in f"{r.device_id} {r.model} {r.version} {r.profile}".lower())
    ]  # fmt: skip
    pages = max(1, math.ceil(len(shown) / PAGE_SIZE))
    page = min(max(1, page), pages)
    devices = shown[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
    return {
        "total": len(all_rows),
        "presence": sorted(presence.items()),
        "summary": summary[:MAX_SUMMARY],
        "summary_more": max(0, len(summary) - MAX_SUMMARY),
        "devices": [(r, age(now - r.last_seen_unix)) for r in devices],
        "matching": len(shown),
        "page": page,
        "pages": pages,
        "group": group,
        "query": query[:MAX_QUERY],
        "figure": (
            fleet_figure((r.group, clip(_model(r))) for r in all_rows) if all_rows else None
        ),
    }


def rollout_page(r: Rollout) -> dict[str, Any]:
    """A rollout: its report (waves, totals, halts, overrides), the gate charts of the wave it
    halted at (else the latest wave judged), every check in words, and its devices."""
    rep = report(r)
    judged = sorted({c.wave for c in rep.checks})
    halted_wave = next((w.index - 1 for w in rep.waves if w.state == "halted"), None)
    wave = halted_wave if halted_wave in judged else (judged[-1] if judged else None)
    halting = [c for c in rep.checks if c.verdict in ("fail", "undecided") and c.wave == wave]
    return {
        "report": rep,
        "chart_wave": wave,
        "figures": gate_figures(rep.checks, wave) if wave is not None else [],
        "halting": halting,
        "checks": [(c, c.describe()) for c in rep.checks],
        "devices": rep.devices[:MAX_ROLLOUT_DEVICES],
        "devices_more": max(0, len(rep.devices) - MAX_ROLLOUT_DEVICES),
        "gate_limits": ", ".join(f"{m}:{t:g}" for m, t in rep.gates.thresholds) or "none",
    }


def device_page(
    device_id: str,
    row: InventoryRow | None,
    health: HealthInfo | None,
    issues: tuple[str, ...],
    series: Series | None,
    now: float,
) -> dict[str, Any]:
    """A device: what the inventory says, its latest health, and its health over time."""
    mib = 1 << 20
    facts: list[tuple[str, str]] = []
    if row is not None:
        facts += [
            ("presence", row.presence.value), ("group", row.group), ("tags", " ".join(row.tags)),
            ("model", _model(row)), ("quantization", row.quantization), ("sha256", row.sha256),
            ("profile", row.profile), ("arch", row.arch), ("agent", row.agent_version),
            ("last seen", f"{age(now - row.last_seen_unix)} ago"),
            ("last update", " ".join(p for p in (row.update_phase, row.update_to_version) if p)),
        ]  # fmt: skip
    if health is not None:
        facts += [
            ("state", health.agent_state),
            ("decode p50", f"{health.decode_tok_s_p50:.1f} tok/s"),
            ("TTFT p50", f"{health.ttft_p50_ms:.0f} ms"),
            ("memory", f"{health.rss_bytes / mib:.0f} MiB of {health.budget_bytes / mib:.0f} MiB"),
            ("requests", f"{health.requests_total} ({health.requests_failed} failed)"),
        ]
    return {
        "device_id": device_id,
        "facts": [(k, v) for k, v in facts if v],
        "issues": issues,
        "points": len(series.times) if series else 0,
        "figures": health_figures(series) if series and series.times else [],
    }
