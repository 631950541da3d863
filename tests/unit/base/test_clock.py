"""The agent's clocks (agent/base/clock.py): when the wall clock counts as synchronized, elapsed
time
that survives a restart, the manifest and cancel time checks that wait for a synchronized
clock, and the clock's state in health (docs/UPDATES.md, "Time")."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.api.grpc.convert import status_message
from agent.base.clock import Clock, ClockState, Stopwatch, kernel_synchronized
from agent.base.errors import ConfigError
from agent.config.file import parse_config
from agent.fleet.device.health import HealthReporter, build_health, changes
from agent.operator.view import FleetView
from agent.ota.artifact import keys
from agent.ota.artifact.cancel import sign_cancel, verify_cancel
from agent.ota.artifact.manifest import UpdateRejected, check_times
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from agent.status.metrics import Metrics
from tests.unit.fleet.test_fleet_health import agent_status, disk, model_info, thermal
from tests.unit.status.test_metrics import scrape, value

YEAR = 365 * 86400.0
NOW = 1.8e9  # late 2027


# ----------------------------------------------------------------------------- sync state


def test_timesyncd_file_decides_when_asked_for(tmp_path: Path) -> None:
    flag = tmp_path / "synchronized"
    clock = Clock("timesyncd", flag, kernel=lambda: True)  # the kernel is not asked
    assert clock.state() == ClockState(False, "")
    flag.touch()  # what systemd-timesyncd does once it has synced
    assert clock.state() == ClockState(True, "timesyncd")
    flag.unlink()  # /run is a tmpfs: a reboot forgets it
    assert clock.state() == ClockState(False, "")


@pytest.mark.parametrize(("kernel", "want"), [(True, True), (False, False), (None, False)])
def test_kernel_status_decides_when_asked_for(
    tmp_path: Path, kernel: bool | None, want: bool
) -> None:
    flag = tmp_path / "synchronized"
    flag.touch()  # not looked at
    clock = Clock("kernel", flag, kernel=lambda: kernel)
    assert clock.state() == ClockState(want, "kernel" if want else "")


def test_auto_takes_either_and_trusted_takes_nothing(tmp_path: Path) -> None:
    flag = tmp_path / "synchronized"
    kernel = [False]
    auto = Clock("auto", flag, kernel=lambda: kernel[0])
    assert not auto.state().synchronized
    kernel[0] = True
    assert auto.state() == ClockState(True, "kernel")
    flag.touch()
    assert auto.state() == ClockState(True, "timesyncd")
    trusted = Clock("trusted", tmp_path / "absent", kernel=lambda: False)
    assert trusted.state() == ClockState(True, "trusted")
    with pytest.raises(ValueError, match="clock source"):
        Clock("ntp")


def test_kernel_status_is_read_from_adjtimex() -> None:
    # this machine's answer is not known, but it is an answer: adjtimex(2) works through ctypes
    assert isinstance(kernel_synchronized(), bool)


def test_config_keys(tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    cfg = parse_config({"updates": {"clock": "timesyncd", "timesync_file": str(flag)}}, "t")
    assert (cfg.updates.clock, cfg.updates.timesync_file) == ("timesyncd", flag)
    default = parse_config({}, "t").updates
    assert (default.clock, default.timesync_file) == (
        "auto",
        Path("/run/systemd/timesync/synchronized"),
    )
    with pytest.raises(ConfigError, match="clock"):
        parse_config({"updates": {"clock": "ntp"}}, "t")


# ----------------------------------------------------------------------------- elapsed time


def test_stopwatch_continues_from_the_record_and_ignores_the_wall_clock() -> None:
    mono, wall = [100.0], [NOW]
    clock = Clock("trusted", wall=lambda: wall[0], monotonic=lambda: mono[0])
    watch = Stopwatch(clock, base=12.5)  # 12.5 s served before a restart
    assert watch.elapsed() == 12.5
    wall[0] += 10 * YEAR  # NTP steps the wall clock: nothing changes
    mono[0] += 2.0
    assert watch.elapsed() == 14.5
    wall[0] -= 20 * YEAR
    assert watch.elapsed() == 14.5


# ----------------------------------------------------------------------------- checks


def _manifest(issued: float, lifetime: float = 30 * 86400) -> opb.Manifest:
    return opb.Manifest(issued_unix=issued, expires_unix=issued + lifetime)


def test_check_times_judges_the_window() -> None:
    m = _manifest(NOW)
    check_times(m, NOW)
    check_times(m, NOW - 86000)  # inside the allowed skew
    with pytest.raises(UpdateRejected) as exc:
        check_times(m, NOW + YEAR)
    assert exc.value.code == "expired"
    with pytest.raises(UpdateRejected) as exc:
        check_times(m, NOW - YEAR)
    assert exc.value.code == "not_yet_valid"


def test_a_cancel_is_not_judged_by_an_unsynchronized_clock() -> None:
    key = Ed25519PrivateKey.generate()
    trusted = {keys.key_id(key.public_key()): key.public_key()}
    data = sign_cancel("u-1", [key], expires_in_s=600, now=NOW).SerializeToString()
    for wrong in (NOW - 3 * YEAR, NOW + 3 * YEAR):
        with pytest.raises(UpdateRejected):
            verify_cancel(data, trusted, wrong)  # on a synchronized clock: refused
    cancel, kid = verify_cancel(data, trusted, None)  # not synchronized: its times are moot
    assert (cancel.update_id, kid) == ("u-1", keys.key_id(key.public_key()))


# ----------------------------------------------------------------------------- health


def test_health_carries_the_clock_and_a_change_of_it_is_published() -> None:
    def health(state: ClockState | None) -> fpb.Health:
        return build_health(
            agent_status(clock=state),
            model_info(),
            seq=1,
            session=1,
            device_id="pi",
            thermal=thermal(),
            disk=disk(),
            last_update=None,
            now=NOW,
        )

    unsynced, synced = health(ClockState(False)), health(ClockState(True, "timesyncd"))
    assert unsynced.HasField("clock") and not unsynced.clock.synchronized
    assert (synced.clock.synchronized, synced.clock.source) == (True, "timesyncd")
    assert "clock" in changes(unsynced, synced)
    assert "clock" not in changes(synced, health(ClockState(True, "kernel")))
    assert not health(None).HasField("clock")


def test_health_heartbeat_is_timed_on_the_monotonic_clock() -> None:
    r = HealthReporter(device_id="pi", session=1, interval_s=60.0, min_interval_s=5.0)

    def tick(now: float, mono: float) -> fpb.Health | None:
        status = agent_status(clock=ClockState(True, "trusted"))
        return r.next(
            status,
            model_info(),
            thermal=thermal(),
            disk=disk(),
            last_update=None,
            now=now,
            mono=mono,
        )

    assert tick(NOW, 10.0) is not None
    assert tick(NOW + 10 * YEAR, 11.0) is None  # a step of the wall clock is no heartbeat
    assert tick(NOW - 10 * YEAR, 12.0) is None
    beat = tick(NOW - 10 * YEAR + 60, 70.0)
    assert beat is not None and beat.timestamp_unix == NOW - 10 * YEAR + 60


def test_local_status_carries_the_clock() -> None:
    """`edge-agent client status` (GetStatus) says whether the wall clock is synchronized."""
    msg = status_message(agent_status(clock=ClockState(True, "kernel")))
    assert (msg.clock_synchronized, msg.clock_source) == (True, "kernel")
    msg = status_message(agent_status(clock=ClockState(False)))
    assert (msg.clock_synchronized, msg.clock_source) == (False, "")


def test_metrics_carry_the_clock() -> None:
    for state, want in ((ClockState(True, "timesyncd"), 1.0), (ClockState(False), 0.0)):
        samples, types = scrape(Metrics(lambda state=state: agent_status(clock=state)))
        assert value(samples, "edge_agent_clock_synchronized") == want
        assert types["edge_agent_clock_synchronized"] == "gauge"
    samples, _ = scrape(Metrics(lambda: agent_status(clock=None)))
    assert ("edge_agent_clock_synchronized", frozenset()) not in samples


def test_the_fleet_view_shows_a_device_whose_clock_is_not_synchronized() -> None:
    now = time.time()
    for clock, issues in (
        (fpb.Clock(synchronized=False), ("clock unsynchronized",)),
        (fpb.Clock(synchronized=True, source="kernel"), ()),
        (None, ()),  # an older agent says nothing about its clock
    ):
        view = FleetView("fleet/v1")
        state = fpb.DeviceState(
            state=fpb.DeviceState.ONLINE, session=1, device_id="d1", timestamp_unix=now - 5
        )
        health = fpb.Health(seq=1, session=1, device_id="d1", timestamp_unix=now - 1)
        if clock is not None:
            health.clock.CopyFrom(clock)
        view.update("fleet/v1/d1/state", state.SerializeToString(), now, retained=True)
        view.update("fleet/v1/d1/health", health.SerializeToString(), now, retained=True)
        (row,) = view.rows(now)
        assert row.issues == issues
