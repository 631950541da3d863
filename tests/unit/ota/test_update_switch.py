"""When a committed download switches (docs/UPDATES.md, "When to switch"): policy idle waits
while a request runs or a session was used lately, window waits for its window on a
synchronized clock (and for the clock), a metered link holds the download back, a restart keeps
waiting, bad specs are refused, and a capped download still arrives whole and verified.

In process, as tests/unit/ota/test_update_clock.py: the real updater, store, signing, delta and
HTTP download (a real server on loopback); the daemon's part is `FileHost`; the clock's wall and
monotonic times are the test's to move, and the daemon's activity is the test's to say.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.config.window import SwitchConfig, parse_window
from agent.ota.updater import Updater
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.unit.ota import test_update_clock as clock_tests
from tests.unit.ota.test_update_clock import WAIT_S, Device, FileHost, SteppedClock

models, trusted, payload = clock_tests.models, clock_tests.trusted, clock_tests.payload

Phase = fpb.UpdateStatus
R = opb.UpdateRecord
WINDOW = "0 2 * * * 1h"  # every day 02:00-03:00 UTC


class MovedClock(SteppedClock):
    """SteppedClock whose monotonic time the test can also move forward (`advance`)."""

    def __init__(self, flag: Path, offset: float = 0.0) -> None:
        super().__init__(flag, offset)
        self.ahead = 0.0
        self.monotonic = lambda: time.monotonic() + self.ahead

    def advance(self, seconds: float) -> None:
        self.ahead += seconds


class Activity:
    """What the daemon says of its traffic: requests running, and a session-use token."""

    def __init__(self) -> None:
        self.running, self.token = 0, 0
        self.looks = 0  # how often the updater looked

    def __call__(self) -> tuple[int, object]:
        self.looks += 1
        return self.running, self.token

    async def seen(self) -> None:
        """Until the updater has looked again (what it saw is then judged: one event-loop
        step computes both)."""
        looks = self.looks
        await until(lambda: self.looks > looks)


def make_device(
    tmp_path: Path, models, trusted, switch: SwitchConfig, offset: float = 0.0, synced=True
) -> Device:
    clock = MovedClock(tmp_path / "timesync" / "synchronized", offset)
    clock.timesync_file.parent.mkdir(parents=True, exist_ok=True)
    clock.step(offset, synced)
    dev = Device(tmp_path, models, trusted, clock)
    dev.config = dataclasses.replace(dev.config, switch=switch)
    return dev


async def until(what: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """A condition, looked at often; the limit is a safety net only."""
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the safety limit")
        await asyncio.sleep(0.02)


def waiting(host: FileHost) -> str:
    return host.updater.switch.activation().waiting_for


def update_id(rec: opb.UpdateRecord) -> str:
    return opb.Manifest.FromString(rec.signed.manifest).update_id


def up(host: FileHost) -> Updater:
    return host.updater


# ------------------------------------------------------------------------------ idle


def test_idle_waits_while_a_request_runs_then_switches_once_idle(
    models, trusted, payload, tmp_path
):
    dev = make_device(tmp_path, models, trusted, SwitchConfig(activate="idle", idle_s=60.0))
    act = Activity()

    async def run() -> None:
        host = await dev.start(lambda s: None)
        up(host).switch.activity = act
        act.running = 1
        assert (await up(host).offer(payload)).phase == Phase.RECEIVED
        await until(lambda: waiting(host) == "idle")
        shown, rec = up(host).switch.activation(), dev.store.record()
        assert rec is not None and rec.state == R.STAGED and rec.waiting_for == "idle"
        assert (shown.policy, shown.update_id) == ("idle", update_id(rec))
        assert Phase.ACTIVATING not in [s.phase for s in host.reports]
        assert any("waiting until idle" in s.message for s in host.reports)
        # the request ends and a session is used once more: still not idle for 60 s
        act.running, act.token = 0, 1
        await act.seen()
        dev.clock.advance(30.0)
        await act.seen()
        assert waiting(host) == "idle"  # 30 s after the session's use
        dev.clock.advance(31.0)  # then 61 s of monotonic time without traffic
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, host.phases()
        assert host.serving.version == 1
        assert dev.store.record().waiting_for == ""
        assert waiting(host) == ""

    asyncio.run(run())


def test_a_restart_while_waiting_keeps_waiting(models, trusted, payload, tmp_path):
    dev = make_device(tmp_path, models, trusted, SwitchConfig(activate="idle", idle_s=60.0))
    act = Activity()
    act.running = 1

    async def first() -> None:
        host = await dev.start(lambda s: None)
        up(host).switch.activity = act
        assert (await up(host).offer(payload)).phase == Phase.RECEIVED
        await until(lambda: waiting(host) == "idle")
        up(host).stop()

    async def second() -> None:
        updater = Updater(
            dev.store, dev.config, clock_tests.model_ref(models.base), clock=dev.clock
        )
        updater.switch.activity = act  # the daemon sets it before resume
        updater.boot()
        host = FileHost(updater, lambda s: None)
        updater.attach(host)
        await updater.resume()
        await until(lambda: waiting(host) == "idle")
        rec = dev.store.record()
        assert rec is not None and rec.state == R.STAGED and rec.waiting_for == "idle"
        assert Phase.ACTIVATING not in [s.phase for s in host.reports]
        act.running = 0
        await act.seen()
        dev.clock.advance(61.0)
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, host.phases()

    asyncio.run(first())
    asyncio.run(second())


# ------------------------------------------------------------------------------ window


def _at(hour: int, minute: int = 0) -> float:
    """Unix time of tomorrow's hour:minute UTC (inside the manifest's 30-day validity)."""
    day = datetime.now(UTC).date() + timedelta(days=1)
    return datetime(day.year, day.month, day.day, hour, minute, tzinfo=UTC).timestamp()


def _window() -> SwitchConfig:
    return SwitchConfig(activate="window", window=parse_window(WINDOW), timezone="UTC")


def test_window_waits_outside_and_switches_inside(models, trusted, payload, tmp_path):
    dev = make_device(tmp_path, models, trusted, _window(), offset=_at(1) - time.time())

    async def run() -> None:
        host = await dev.start(lambda s: None)
        assert (await up(host).offer(payload)).phase == Phase.RECEIVED
        await until(lambda: waiting(host) == "window")
        shown = up(host).switch.activation()
        assert shown.window == WINDOW and shown.next_window_unix == _at(2)
        assert dev.store.record().waiting_for == "window"
        dev.clock.step(_at(2, 30) - time.time(), synchronized=True)  # inside the window
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, host.phases()

    asyncio.run(run())


def test_window_without_a_synchronized_clock_waits_for_the_clock(
    models, trusted, payload, tmp_path
):
    dev = make_device(
        tmp_path, models, trusted, _window(), offset=_at(2, 30) - time.time(), synced=False
    )

    async def run() -> None:
        host = await dev.start(lambda s: None)
        assert (await up(host).offer(payload)).phase == Phase.RECEIVED
        await until(lambda: waiting(host) == "clock")  # inside by its wall clock: not trusted
        assert dev.store.record().waiting_for == "clock"
        assert Phase.ACTIVATING not in [s.phase for s in host.reports]
        dev.clock.step(_at(2, 30) - time.time(), synchronized=True)
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, host.phases()

    asyncio.run(run())


def test_the_rollout_names_its_own_window(models, trusted, payload, tmp_path):
    """`--activate window:SPEC` overrides the device's policy ("now" here)."""
    dev = make_device(
        tmp_path, models, trusted, SwitchConfig(timezone="UTC"), offset=_at(5) - time.time()
    )

    async def run() -> None:
        host = await dev.start(lambda s: None)
        args = {"activate": "window:30 5 * * * 10m"}
        assert (await up(host).offer(payload, args)).phase == Phase.RECEIVED
        await until(lambda: waiting(host) == "window")
        assert up(host).switch.activation().next_window_unix == _at(5, 30)
        dev.clock.step(_at(5, 31) - time.time(), synchronized=True)
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, host.phases()

    asyncio.run(run())


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "args",
    [
        {"activate": "later"},
        {"activate": "idle:5m"},
        {"activate": "window:0 2 * * 3h"},
        {"activate": "window:0 2 * * * forever"},
        {"activate": "window"},  # the device has no window configured
        {"allow_metered": "yes"},
    ],
)
def test_a_bad_switch_argument_is_rejected(args, models, trusted, payload, tmp_path):
    dev = make_device(tmp_path, models, trusted, SwitchConfig())

    async def run() -> None:
        host = await dev.start(lambda s: None)
        status = await up(host).offer(payload, args)
        assert status.phase == Phase.REJECTED and status.reason_code == "activate", status
        assert dev.store.record() is None  # nothing recorded, nothing downloaded

    asyncio.run(run())


# ------------------------------------------------------------------------------ the link


def test_a_metered_link_holds_the_download_unless_allowed(models, trusted, payload, tmp_path):
    held = make_device(tmp_path / "held", models, trusted, SwitchConfig(metered=True))
    allowed = make_device(tmp_path / "allowed", models, trusted, SwitchConfig(metered=True))

    async def run() -> None:
        host = await held.start(lambda s: None)
        assert (await up(host).offer(payload)).phase == Phase.RECEIVED
        await until(lambda: waiting(host) == "metered")
        rec = held.store.record()
        assert rec is not None and rec.waiting_for == "metered" and rec.downloaded == 0
        assert not held.store.payload_path(update_id(rec)).exists()
        up(host).stop()

        host = await allowed.start(lambda s: None)
        offered = await up(host).offer(payload, {"allow_metered": "true"})
        assert offered.phase == Phase.RECEIVED
        final = await allowed.final(host)
        assert final.phase == Phase.COMMITTED, host.phases()

    asyncio.run(run())


def test_a_capped_download_arrives_whole_and_verified(models, trusted, payload, tmp_path):
    """The cap's rate is the throttle tests' (tests/unit/ota/test_throttle.py); here a cap of
    half the payload per second still ends in a verified, committed update."""
    size = opb.Manifest.FromString(opb.SignedManifest.FromString(payload).manifest).payload_size
    cap = SwitchConfig(max_download_bytes_s=max(1024, size // 2))
    dev = make_device(tmp_path, models, trusted, cap)

    async def run() -> None:
        host = await dev.start(lambda s: None)
        assert (await up(host).offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, host.phases()
        rec = dev.store.record()
        assert rec is not None and rec.downloaded == size
        assert up(host).switch.activation().bandwidth_bytes_s == cap.max_download_bytes_s

    asyncio.run(run())
