"""Judging an update's validity window on the device's clock (docs/UPDATES.md, "Time"): only a
wall clock known to be synchronized decides; before the new model loads, the update waits
(cancellable) for one and is judged on it, whatever was judged before."""

from __future__ import annotations

import logging

from agent.base.clock import Clock
from agent.ota.artifact import manifest
from agent.ota.interrupt import Interrupt
from agent.ota.reports import Reports
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger("agent.ota.updater")  # moved from updater.py: its lines keep their name

CLOCK_POLL_S = 1.0  # how often a staged update waiting for a synchronized clock looks again


class Timing:
    def __init__(self, clock: Clock, reports: Reports, interrupt: Interrupt) -> None:
        self.clock, self.reports, self.interrupt = clock, reports, interrupt

    def now(self) -> float | None:
        """The wall clock, or None while it is not known to be synchronized."""
        return self.clock.wall() if self.clock.state().synchronized else None

    def check(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        """Judge the manifest's validity window if the wall clock is synchronized (raise
        UpdateRejected "expired" / "not_yet_valid"); on an unsynchronized clock decide
        nothing."""
        now = self.now()
        if now is None:
            return
        manifest.check_times(m, now)
        rec.times_checked = True  # written with the next record

    async def before_activation(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        """Before the new model loads: wait (cancellable) until the wall clock is synchronized,
        then judge the manifest's window on it — whatever was judged before."""
        now = self.now()
        if now is None:
            why = "waiting for a synchronized clock to judge the manifest before activating"
            log.warning("update %s: staged; %s", m.update_id, why)
            self.reports.progress(rec, f"staged; {why}")
            while (now := self.now()) is None:
                await self.interrupt.pause(CLOCK_POLL_S)
            log.info("update %s: the clock is synchronized; activation continues", m.update_id)
        manifest.check_times(m, now)
        rec.times_checked = True
