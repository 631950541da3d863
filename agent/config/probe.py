"""The agent config's `[probe]` section (docs/CONFIG.md): when the quality probe runs on the
serving model (docs/FLEET.md, Quality probe). `agent.config.file` parses the file and hands this
module the section's table."""

from __future__ import annotations

from dataclasses import dataclass

from agent.base.tomltable import Table

PROBE = ("enabled", "interval_s", "min_idle_s", "trial_wait_s")


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    enabled: bool = True
    # between two probes of the same model (a model not probed yet is probed at once)
    interval_s: float = 600.0
    # the engine must have run no request for this long before a periodic probe starts
    min_idle_s: float = 30.0
    # an update's trial: its checks wait this long for the new model's probe (which runs
    # between requests) before they go on without it
    trial_wait_s: float = 120.0


def parse_probe(t: Table) -> ProbeConfig:
    d = ProbeConfig()

    def num(key: str, lo: float, hi: float, default: float) -> float:
        return t.number(key, lo, hi) if key in t.raw else default

    return ProbeConfig(
        enabled=t.flag("enabled", default=d.enabled),
        interval_s=num("interval_s", 10, 7 * 86400, d.interval_s),
        min_idle_s=num("min_idle_s", 0, 86400, d.min_idle_s),
        trial_wait_s=num("trial_wait_s", 0, 86400, d.trial_wait_s),
    )
