"""Each device's health over time, as the console heard it since it started: a bounded ring of
points per device, for a bounded number of devices (once full, devices heard first keep their
history and newer ones get none; they are counted). Admitting newer devices by evicting the
least recently heard would, in a fleet larger than the bound, wipe every history in turn.

A point is the time and a few figures as 4-byte floats in one growing `array` per device (the
time relative to the console's start), so the bounds hold in memory: at most `max_points` x
40 bytes for each of `max_devices` devices (docs/ROLLOUTS.md "The console"). A health repeated
(the same session and sequence number, e.g. a retained copy after a reconnect) is not a new
point. Not thread-safe: the caller holds the lock that guards the fleet view too.
"""

from __future__ import annotations

import logging
import math
from array import array
from dataclasses import dataclass
from typing import Final

from agent.operator.digest import HealthInfo
from agent.operator.rollout.figures import Figures

log = logging.getLogger(__name__)

MAX_POINTS: Final = 240  # per device: 4 h at the default 60 s health interval
MAX_DEVICES: Final = 10_000  # devices with a history: at most ~92 MiB when every ring is full
# (key, title, unit) of what each point holds, in the order of a point's figures
METRICS: Final = (
    ("decode_tok_s", "decode p50", "tok/s"),
    ("ttft_p50_ms", "TTFT p50", "ms"),
    ("decode_run", "decode p50 of the serving model since its activation", "tok/s"),
    ("ttft_p95_ms", "TTFT p95 of the serving model since its activation", "ms"),
    ("nll", "probe NLL", "nats/token"),
    ("rss_mib", "RSS", "MiB"),
    ("celsius", "temperature", "°C"),
    ("requests", "requests", ""),
    ("failed", "failed requests", ""),
)
_WIDTH: Final = 1 + len(METRICS)  # the time, then the figures


@dataclass(frozen=True, slots=True)
class Series:
    """One device's history: times (unix seconds) and, per metric key, the figures (None where
    the health did not carry one)."""

    device_id: str
    times: tuple[float, ...]
    figures: dict[str, tuple[float | None, ...]]


def point(h: HealthInfo, run: Figures | None) -> tuple[float, ...]:
    """A health's figures in `METRICS` order (NaN: not reported)."""
    nan = math.nan
    probed = run is not None and run.probe_runs > 0
    return (
        h.decode_tok_s_p50 or nan,
        h.ttft_p50_ms or nan,
        (run.decode_p50 or nan) if run is not None else nan,
        (run.ttft_p95 or nan) if run is not None else nan,
        run.nll if probed and run is not None else nan,
        h.rss_bytes / (1 << 20) if h.rss_bytes else nan,
        h.max_celsius if h.max_celsius is not None else nan,
        float(h.requests_total),
        float(h.requests_failed),
    )


class _Ring:
    __slots__ = ("count", "data", "last", "size", "start")

    def __init__(self, size: int) -> None:
        self.data = array("f")  # grows to `size` points, then wraps
        self.start = 0
        self.count = 0
        self.size = size
        self.last: tuple[int, int] = (-1, -1)  # (session, seq) of the newest point

    def add(self, figures: tuple[float, ...]) -> None:
        if self.count < self.size:
            self.data.extend(figures)
            self.count += 1
            return
        base = self.start * _WIDTH
        self.data[base : base + _WIDTH] = array("f", figures)
        self.start = (self.start + 1) % self.size

    def rows(self) -> list[tuple[float, ...]]:
        out = []
        for i in range(self.count):
            base = ((self.start + i) % self.count) * _WIDTH
            out.append(tuple(self.data[base : base + _WIDTH]))
        return out


class HealthHistory:
    """Devices' health points, bounded (module docstring)."""

    def __init__(
        self, started_unix: float, max_points: int = MAX_POINTS, max_devices: int = MAX_DEVICES
    ) -> None:
        self.started_unix = started_unix  # history covers the time since then
        self.max_points, self.max_devices = max_points, max_devices
        self._rings: dict[str, _Ring] = {}
        self.refused: set[str] = set()  # heard once the bound was reached: no history kept
        self._refused_cap = max_devices  # how many of those are named (the rest counted)
        self.refused_count = 0

    def add(self, device_id: str, h: HealthInfo, run: Figures | None, at: float) -> None:
        """Record a health heard at `at` (unix seconds), unless it is the newest one again."""
        ring = self._rings.get(device_id)
        if ring is None:
            if len(self._rings) >= self.max_devices:
                if device_id not in self.refused:
                    if not self.refused_count:
                        log.warning(
                            "health history: %d devices kept already; %s and devices heard "
                            "after it get none",
                            self.max_devices,
                            device_id,
                        )
                    self.refused_count += 1
                    if len(self.refused) < self._refused_cap:
                        self.refused.add(device_id)
                return
            ring = self._rings[device_id] = _Ring(self.max_points)
        if (h.session, h.seq) == ring.last:
            return
        ring.last = (h.session, h.seq)
        ring.add((at - self.started_unix, *point(h, run)))

    def series(self, device_id: str) -> Series | None:
        ring = self._rings.get(device_id)
        if ring is None:
            return None
        rows = ring.rows()

        def value(v: float) -> float | None:
            return v if math.isfinite(v) else None

        figures = {
            key: tuple(value(r[1 + i]) for r in rows) for i, (key, _, _) in enumerate(METRICS)
        }
        return Series(device_id, tuple(self.started_unix + r[0] for r in rows), figures)

    def __len__(self) -> int:
        return len(self._rings)
