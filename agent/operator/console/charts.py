"""The console's charts as plotly figures (plain dicts: `data` traces and a `layout`), which the
pages hand to plotly.js as JSON. Pure: no I/O.

* a rollout's gates: per gate metric, per board class (profile/arch), the old model's figure
  (before) beside the target's (after) as bars, and the limit the after figure may reach before
  the gate fails as a marker;
* a device's health over time: one line per figure;
* the fleet: devices per group, stacked by model version.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from agent.operator.console.history import METRICS as HEALTH_METRICS
from agent.operator.console.history import Series
from agent.operator.rollout.figures import METRICS, Check

Figure = dict[str, Any]
MAX_VERSIONS: Final = 12  # the fleet chart's stacks; the rest are "other"
BEFORE, AFTER, LIMIT, FAILED = "#4c78a8", "#54a24b", "#e45756", "#b279a2"


def limit(c: Check) -> float | None:
    """The after figure at which `c`'s gate fails (None without a before figure)."""
    if c.before is None:
        return None
    kind = METRICS.get(c.metric, ("", "", "delta"))[2]
    if c.metric == "decode_tok_s":
        return c.before * (1 - c.threshold)
    if kind == "ratio":
        return c.before * (1 + c.threshold)
    return c.before + c.threshold


def gate_figures(checks: Sequence[Check], wave: int) -> list[tuple[str, Figure]]:
    """(metric, figure) per gate metric judged at `wave` (0-based): those that failed on some
    board class first (what halted the rollout), then the others, each in METRICS order."""
    shown = [c for c in checks if c.wave == wave and c.metric in METRICS]
    failed = {c.metric for c in shown if c.verdict in ("fail", "undecided")}
    out = []
    for metric in sorted(METRICS, key=lambda m: m not in failed):
        mine = sorted((c for c in shown if c.metric == metric), key=lambda c: c.board)
        if mine:
            out.append((metric, gate_figure(metric, mine, wave)))
    return out


def gate_figure(metric: str, checks: Sequence[Check], wave: int) -> Figure:
    name, unit, _ = METRICS[metric]
    boards = [c.board for c in checks]
    labels = [f"{c.verdict.upper()}" for c in checks]
    after_colors = [FAILED if c.verdict == "fail" else AFTER for c in checks]
    data = [
        {
            "type": "bar", "name": "before (old model)", "x": boards,
            "y": [c.before for c in checks], "marker": {"color": BEFORE},
            "customdata": [c.before_devices for c in checks],
            "hovertemplate": "%{x}: %{y:.4g} before (%{customdata} devices)<extra></extra>",
        },
        {
            "type": "bar", "name": "after (target model)", "x": boards,
            "y": [c.after for c in checks], "marker": {"color": after_colors},
            "text": labels, "textposition": "outside",
            "customdata": [c.after_devices for c in checks],
            "hovertemplate": "%{x}: %{y:.4g} after (%{customdata} devices)<extra></extra>",
        },
        {
            "type": "scatter", "mode": "markers", "name": "gate limit", "x": boards,
            "y": [limit(c) for c in checks],
            "marker": {"symbol": "line-ew-open", "size": 44, "color": LIMIT,
                       "line": {"width": 3, "color": LIMIT}},
            "hovertemplate": "%{x}: limit %{y:.4g}<extra></extra>",
        },
    ]  # fmt: skip
    unit = "share of requests" if metric == "errors" else unit
    return {
        "data": data,
        "layout": {
            "title": {
                "text": f"{name} ({metric}), wave {wave + 1}: before vs after per board",
                "x": 0.01,
                "xanchor": "left",
            },
            "barmode": "group",
            "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
            "xaxis": {"title": {"text": "board class (profile/arch)"}, "type": "category"},
            "height": 380,
            "margin": {"t": 60, "b": 100, "l": 70, "r": 20},
            "legend": {"orientation": "h", "y": -0.3},
        },
    }


def _iso(t: float) -> str:
    """A time as plotly reads dates (UTC, to the millisecond: reports may come close together)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def health_figures(s: Series) -> list[tuple[str, Figure]]:
    """(metric key, figure) per health figure the device reported (not only as 0) at least
    once."""
    x = [_iso(t) for t in s.times]
    out = []
    for key, title, unit in HEALTH_METRICS:
        y = s.figures[key]
        if all(not v for v in y):
            continue
        out.append((key, {
            "data": [{"type": "scatter", "mode": "lines+markers", "name": title, "x": x,
                      "y": list(y), "connectgaps": False}],
            "layout": {
                "title": {"text": f"{title}" + (f" ({unit})" if unit else ""), "x": 0.01,
                          "xanchor": "left"},
                "xaxis": {"type": "date", "title": {"text": "time (UTC)"}},
                "yaxis": {"rangemode": "tozero"},
                "height": 260, "margin": {"t": 40, "b": 50, "l": 60, "r": 20},
                "showlegend": False,
            },
        }))  # fmt: skip
    return out


def fleet_figure(rows: Iterable[tuple[str, str]]) -> Figure:
    """Devices per group stacked by version, from (group, "model version") pairs."""
    pairs = [(g or "(no group)", v or "(no model)") for g, v in rows]
    versions = [v for v, _ in Counter(v for _, v in pairs).most_common()]
    kept = set(versions[:MAX_VERSIONS])
    counts = Counter((g, v if v in kept else "other") for g, v in pairs)
    groups = sorted({g for g, _ in pairs})
    names = versions[:MAX_VERSIONS] + (["other"] if len(versions) > MAX_VERSIONS else [])
    data = [
        {"type": "bar", "name": v, "x": groups, "y": [counts.get((g, v), 0) for g in groups]}
        for v in names
    ]
    return {
        "data": data,
        "layout": {
            "title": {"text": "devices per group, by model version", "x": 0.01, "xanchor": "left"},
            "barmode": "stack",
            "xaxis": {"type": "category"},
            "yaxis": {"title": {"text": "devices"}},
            "height": 320,
            "margin": {"t": 50, "b": 50, "l": 60, "r": 20},
        },
    }
