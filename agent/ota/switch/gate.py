"""The waits of an update that its switch policy asks for: before the download, for a link
that is not metered (unless the command allows it); before a committed download activates,
for idleness or a maintenance window (on a synchronized clock). Each wait is written in the
record (`waiting_for`, so a restart keeps waiting), reported once, shown in health
(`activation`), cancellable, and runs on the event loop beside serving."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from agent.base.clock import Clock
from agent.config.file import UpdatesConfig
from agent.ota.interrupt import Interrupt
from agent.ota.reports import Reports
from agent.ota.store import Store
from agent.ota.switch.policy import Policy, command_args, resolve
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting update looks again
METERED_POLL_S = 3600.0  # a metered wait ends only by a cancel (or a restart without `metered`)

# (requests running or queued, a token that changes whenever a session is used)
Activity = Callable[[], tuple[int, object]]


def nothing_running() -> tuple[int, object]:
    """The default `Activity` (no daemon attached): always idle."""
    return 0, None


_UNSEEN = object()


class IdleWatch:
    """Seconds since the last activity by the monotonic clock: a running request or a change
    of the session token is activity (the first look counts as one: a start waits idle_s)."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._mono = monotonic
        self._token: object = _UNSEEN
        self._since = monotonic()

    def idle_for(self, running: int, token: object) -> float:
        now = self._mono()
        if running or token != self._token:
            self._token, self._since = token, now
        return now - self._since


class Switch:
    """The switch policy's waits for the updater, and what health shows of them."""

    def __init__(
        self,
        config: UpdatesConfig,
        clock: Clock,
        interrupt: Interrupt,
        reports: Reports,
        store: Store,
    ) -> None:
        self.config, self.clock, self.interrupt = config, clock, interrupt
        self.reports, self.store = reports, store
        self.activity: Activity = nothing_running  # the daemon sets its own
        self._waiting: fpb.Activation | None = None

    def activation(self) -> fpb.Activation:
        """Health's `activation`: the wait in progress, else the device's defaults."""
        s = self.config.switch
        shown = fpb.Activation(
            policy=s.activate,
            window=s.window.spec if s.window else "",
            metered=s.metered,
            bandwidth_bytes_s=s.max_download_bytes_s,
        )
        if self._waiting is not None:
            shown.MergeFrom(self._waiting)
        return shown

    def check_offer(self, args: Mapping[str, str]) -> tuple[str, bool]:
        """The update command's (activate, allow_metered), checked against this device
        (UpdateRejected, code "activate")."""
        activate, allow_metered = command_args(args)
        resolve(activate, self.config.switch)
        return activate, allow_metered

    async def before_download(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        """On a metered link, wait (cancellable) unless the update command allowed it."""
        if not self.config.switch.metered or rec.allow_metered:
            return
        policy = rec.activate.partition(":")[0] or self.config.switch.activate
        self._show(rec, m, fpb.Activation(policy=policy, waiting_for="metered"))
        try:
            while True:
                await self.interrupt.pause(METERED_POLL_S)
        finally:
            self._waiting = None

    async def before_activation(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        """Wait (cancellable) until the update's policy allows the switch."""
        policy = resolve(rec.activate, self.config.switch)
        watch = IdleWatch(self.clock.monotonic)
        try:
            while True:
                waiting_for, next_unix = self._blocked(policy, watch)
                if not waiting_for:
                    break
                shown = fpb.Activation(
                    policy=policy.name,
                    waiting_for=waiting_for,
                    window=policy.window.spec if policy.window else "",
                    next_window_unix=next_unix,
                )
                self._show(rec, m, shown)
                await self.interrupt.pause(POLL_S)
        finally:
            self._waiting = None
        if rec.waiting_for:
            log.info("update %s: %s allows the switch now", m.update_id, policy.name)
            rec.waiting_for = ""  # written with the next record

    def _blocked(self, policy: Policy, watch: IdleWatch) -> tuple[str, float]:
        """What the switch waits for now ("" = nothing), and the next window's start."""
        if policy.name == "idle":
            running, token = self.activity()
            return ("" if watch.idle_for(running, token) >= policy.idle_s else "idle"), 0.0
        if policy.name == "window":
            assert policy.window is not None
            if not self.clock.state().synchronized:
                return "clock", 0.0
            inside, start = policy.window.at(self.clock.wall(), policy.zone)
            return ("" if inside else "window"), start
        return "", 0.0

    def _show(self, rec: opb.UpdateRecord, m: opb.Manifest, shown: fpb.Activation) -> None:
        """Health shows the wait; a new reason is recorded and reported once."""
        shown.update_id = m.update_id
        self._waiting = shown
        if rec.waiting_for == shown.waiting_for and rec.reason.startswith("waiting"):
            return
        idle_s = self.config.switch.idle_s
        why = {
            "metered": "for a link that is not metered (the rollout did not allow a metered one)",
            "idle": f"until idle (no request running, no session used for {idle_s:g} s)",
            "window": f"for the maintenance window {shown.window!r}",
            "clock": f"for a synchronized clock to place the window {shown.window!r}",
        }[shown.waiting_for]
        rec.waiting_for, rec.reason = shown.waiting_for, f"waiting {why}"
        self.store.save(rec)
        log.info("update %s: %s", m.update_id, rec.reason)
        self.reports.progress(rec, rec.reason)
