"""Updates on a board without an RTC (docs/UPDATES.md, "Time"): the wall clock moves by years,
both ways, in every update state, and no update decision follows it.

Two seams. In process: the real updater, store, signing, delta and HTTP download (a real
server on loopback) with the daemon's part (`FileHost`: "loading" a model is checking its
file) and a clock whose wall time the test moves. On a real daemon process: libfaketime moves
the wall clock of `edge-agent run` (its monotonic clock is left alone, as on a board), with a
real mosquitto and the real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import platform
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent import __version__
from agent.base.clock import Clock
from agent.base.errors import AgentError
from agent.config.file import UpdatesConfig
from agent.fleet.topics import Topics
from agent.model.directory import load_model_dir
from agent.operator.client import send
from agent.operator.link import FleetError
from agent.ota import updater as updater_module
from agent.ota.artifact.bundle import read_bundle
from agent.ota.artifact.cancel import sign_cancel
from agent.ota.artifact.manifest import InstallContext
from agent.ota.store import ModelRef, Store
from agent.ota.updater import Updater
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.daemon_harness import Daemon
from tests.support.fleetsim import model_ref
from tests.support.httpserver import PayloadServer, Served
from tests.support.paths import SUPPORT
from tests.system import test_updates
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import TRUSTED, Models, bundle, statuses, wait_final

# the update tests' module fixtures: the tiny model and its fine-tune, the trusted key, mosquitto
models, trusted, broker = test_updates.models, test_updates.trusted, test_updates.broker

Phase = fpb.UpdateStatus
R = opb.UpdateRecord
YEAR = 365 * 86400.0
TRIAL_S = 1.5
WAIT_S = 60.0


# ----------------------------------------------------------------------------- in process


class SteppedClock(Clock):
    """The agent's clock with a wall clock `offset` seconds off this machine's, synchronized
    while the flag file exists (as systemd-timesyncd says it). Monotonic time is real."""

    def __init__(self, flag: Path, offset: float = 0.0) -> None:
        super().__init__("timesyncd", flag, wall=lambda: time.time() + self.offset)
        self.offset = offset

    def step(self, offset: float, synchronized: bool) -> None:
        self.offset = offset
        if synchronized:
            self.timesync_file.touch()
        else:
            self.timesync_file.unlink(missing_ok=True)


class FileHost:
    """The daemon's part of an update for the in-process tests: a model "loads" when its file
    has its sha256; every report goes to `reports` and through `on_report`."""

    def __init__(self, updater: Updater, on_report: Callable[[fpb.UpdateStatus], None]) -> None:
        self.updater = updater
        self.serving = updater.serving_ref()
        self.reports: list[fpb.UpdateStatus] = []
        self.on_report = on_report
        self.checks = 0
        self.problem: str | None = None  # what the trial's health checks say
        self.on_check: Callable[[int], None] = lambda n: None
        self.final = asyncio.Event()

    def install_context(self, installed: ModelRef) -> InstallContext:
        return InstallContext(
            model_name=load_model_dir(Path(installed.model_dir)).name,
            installed_version=installed.version,
            installed_sha256=installed.sha256,
            profile="generic-x86_64",
            arch=platform.machine(),
            agent_version=__version__,
            finished_update_ids=frozenset(self.updater.installed().finished),
        )

    async def activate(self, ref: ModelRef, canary: opb.Canary | None) -> None:
        problem = ref.verify()
        if problem is not None:
            raise AgentError(problem)
        self.serving = ref

    async def check_serving(self, canary: opb.Canary | None) -> str | None:
        self.checks += 1
        self.on_check(self.checks)
        return self.problem

    def report(self, status: fpb.UpdateStatus, key: str = "") -> None:
        self.reports.append(status)
        if status.phase in (Phase.COMMITTED, Phase.ROLLED_BACK, Phase.REJECTED):
            self.final.set()
        self.on_report(status)

    def remove_unused_caches(self) -> None:
        pass

    def phases(self) -> list[str]:
        names = [Phase.Phase.Name(s.phase) for s in self.reports]
        return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


class Device:
    """A device's state directory and the updater that a (re)start of it runs."""

    def __init__(self, root: Path, models: Models, trusted: Path, clock: SteppedClock) -> None:
        self.root, self.models, self.clock = root, models, clock
        self.config = UpdatesConfig(
            trusted_keys_dir=trusted,
            trial_s=TRIAL_S,
            retry_s=0.2,
            progress_interval_s=0.2,
            clock="timesyncd",
            timesync_file=clock.timesync_file,
        )
        self.store = Store(root / "state")
        self.at: dict[int, float] = {}  # monotonic time of each phase's first report

    async def start(self, on_report: Callable[[fpb.UpdateStatus], None]) -> FileHost:
        """What the daemon does at a start: boot, attach, resume."""
        up = Updater(self.store, self.config, model_ref(self.models.base), clock=self.clock)
        up.boot()

        def seen(status: fpb.UpdateStatus) -> None:
            self.at.setdefault(status.phase, time.monotonic())
            on_report(status)

        host = FileHost(up, seen)
        up.attach(host)
        await up.resume()
        return host

    async def final(self, host: FileHost) -> fpb.UpdateStatus:
        await asyncio.wait_for(host.final.wait(), WAIT_S)
        return host.reports[-1]


@pytest.fixture
def payload(models: Models, tmp_path: Path) -> Iterator[bytes]:
    """A signed manifest (version 1, issued now, 30 days valid) whose payload a real HTTP
    server on loopback serves."""
    served = Served(tmp_path / "payload.bin")
    http = PayloadServer(served)
    path = bundle(models, tmp_path, payload_url=http.url, version=1)
    read_bundle(path)[1].extract(served.path)
    yield read_bundle(path)[0].SerializeToString()
    http.close()


def device(tmp_path: Path, models: Models, trusted: Path, offset: float, synced: bool) -> Device:
    clock = SteppedClock(tmp_path / "timesync" / "synchronized", offset)
    clock.timesync_file.parent.mkdir()
    clock.step(offset, synced)
    return Device(tmp_path, models, trusted, clock)


EARLY = [R.RECEIVED, R.DOWNLOADING, R.VERIFIED, R.STAGED]  # before the window is judged last


@pytest.mark.parametrize("years", [-3, 3])
@pytest.mark.parametrize("state", EARLY, ids=[R.State.Name(s).lower() for s in EARLY])
def test_booted_at_a_wrong_time_the_update_commits_once_the_clock_syncs(
    state, years, models, trusted, payload, tmp_path
):
    """A board boots years off (fake-hwclock's last shutdown, or a bad one ahead), takes an
    update, and NTP steps the clock to the real time while the update is in `state`."""
    dev = device(tmp_path, models, trusted, years * YEAR, synced=False)

    def on_report(status: fpb.UpdateStatus) -> None:
        if status.phase == Phase.Phase.Value(R.State.Name(state)):
            dev.clock.step(0.0, synchronized=True)

    async def run() -> None:
        host = await dev.start(on_report)
        offered = await host.updater.offer(payload)
        # judged on this wrong clock the manifest is expired or issued years ahead
        assert offered.phase == Phase.RECEIVED, offered
        assert "judged once the clock is synchronized" in offered.message
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, (final, host.phases())
        assert host.serving.version == 1
        rec = dev.store.record()
        assert rec is not None and rec.times_checked and rec.trial_elapsed_s == TRIAL_S

    asyncio.run(run())


@pytest.mark.parametrize("years", [-10, 10])
@pytest.mark.parametrize("state", [R.ACTIVATING, R.TRIAL], ids=["activating", "trial"])
def test_a_step_while_the_new_model_loads_or_serves_changes_nothing(
    state, years, models, trusted, payload, tmp_path
):
    """A synchronized clock steps by years (an operator's `date -s`, a broken server) once the
    window has been judged: the trial still lasts `trial_s` of served time."""
    dev = device(tmp_path, models, trusted, 0.0, synced=True)

    def on_report(status: fpb.UpdateStatus) -> None:
        if status.phase == Phase.Phase.Value(R.State.Name(state)):
            dev.clock.step(years * YEAR, synchronized=True)

    async def run() -> None:
        host = await dev.start(on_report)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, (final, host.phases())
        # the trial's clock starts after its TRIAL report: no commit sooner than trial_s after
        # it (backwards, the old wall-clock trial waited for years)
        assert dev.at[Phase.COMMITTED] - dev.at[Phase.TRIAL] >= TRIAL_S
        assert host.checks >= 2  # health checked through the trial, then the canary

    asyncio.run(run())


@pytest.mark.parametrize("years", [-3, 3])
def test_a_staged_update_waits_for_a_synchronized_clock(years, models, trusted, payload, tmp_path):
    """Never synchronized while staged: it waits, says so, and activates once the clock
    syncs (the cheap work — download, rebuild — is done meanwhile)."""
    dev = device(tmp_path, models, trusted, years * YEAR, synced=False)
    serving_while_waiting: list[int] = []

    def on_report(status: fpb.UpdateStatus) -> None:
        if status.phase == Phase.STAGED and "waiting for a synchronized clock" in status.message:
            serving_while_waiting.append(hosts[0].serving.version)
            dev.clock.step(0.0, synchronized=True)

    async def run() -> None:
        host = await dev.start(on_report)
        hosts.append(host)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert final.phase == Phase.COMMITTED, (final, host.phases())
        assert serving_while_waiting == [0]  # it waited once, before loading anything

    hosts: list[FileHost] = []
    asyncio.run(run())


def test_a_clock_that_syncs_past_the_expiry_rejects_before_activation(
    models, trusted, payload, tmp_path
):
    """The window is judged on the synchronized clock before the new model loads: synced to a
    time after the manifest's expiry, the update ends `expired` and the old model serves on;
    then the clock steps both ways across restarts and nothing changes."""
    dev = device(tmp_path, models, trusted, -3 * YEAR, synced=False)

    def on_report(status: fpb.UpdateStatus) -> None:
        if status.phase == Phase.VERIFIED:
            dev.clock.step(YEAR, synchronized=True)

    async def run() -> None:
        host = await dev.start(on_report)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert (final.phase, final.reason_code) == (Phase.REJECTED, "expired"), final
        assert host.serving.version == 0
        assert not (dev.store.models.exists() and any(dev.store.models.iterdir()))
        for years in (-10, 10):  # rejected: restarts at any time leave it so
            dev.clock.step(years * YEAR, synchronized=False)
            again = await dev.start(lambda s: None)
            assert again.serving.version == 0
            rec = dev.store.record()
            assert rec is not None and rec.state == R.REJECTED

    asyncio.run(run())


def test_a_cancel_reaches_an_update_waiting_for_the_clock(models, trusted, payload, tmp_path):
    """A signed cancel issued now is years "in the future" on the unsynchronized clock: it is
    obeyed (a cancel only stops an update), and the update ends `cancelled`."""
    dev = device(tmp_path, models, trusted, -3 * YEAR, synced=False)
    waiting = asyncio.Event()

    def on_report(status: fpb.UpdateStatus) -> None:
        if "waiting for a synchronized clock" in status.message:
            waiting.set()

    async def run() -> None:
        host = await dev.start(on_report)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        await asyncio.wait_for(waiting.wait(), WAIT_S)
        update_id = opb.Manifest.FromString(
            opb.SignedManifest.FromString(payload).manifest
        ).update_id
        cancel = sign_cancel(update_id, [TRUSTED], reason="bad build")
        done = await host.updater.cancel(cancel.SerializeToString())
        assert (done.phase, done.reason_code) == (Phase.REJECTED, "cancelled"), done
        assert host.serving.version == 0

    asyncio.run(run())


@pytest.mark.parametrize("years", [-3, 3])
def test_a_restart_in_the_trial_continues_its_elapsed_time(
    years, models, trusted, payload, tmp_path, monkeypatch, caplog
):
    """The agent dies in the trial and starts again with the wall clock years off: the trial
    continues from the elapsed time in the record (the old code compared the wall clock with
    the trial's start and, backwards, waited for years)."""
    monkeypatch.setattr(updater_module, "TRIAL_SAVE_S", 0.0)  # every health check writes it
    dev = device(tmp_path, models, trusted, 0.0, synced=True)
    dev.config = dataclasses.replace(dev.config, trial_s=6.0)  # far from over at the crash

    async def run() -> None:
        host = await dev.start(lambda s: None)

        def crash_after_two(n: int) -> None:
            if n == 2:
                host.updater.stop()  # the task ends at its next await: a crash, to the record

        host.on_check = crash_after_two
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        task = host.updater._task
        assert task is not None
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        rec = dev.store.record()
        assert rec is not None and rec.state == R.TRIAL
        assert 0 < rec.trial_elapsed_s < 6.0, rec
        kept = rec.trial_elapsed_s
        dev.clock.step(years * YEAR, synchronized=years > 0)
        with caplog.at_level(logging.INFO, logger="agent.ota.updater"):
            again = await dev.start(lambda s: None)
            final = await dev.final(again)
        assert final.phase == Phase.COMMITTED, (final, again.phases())
        assert f"trial continues at {kept:.1f} of 6 s" in caplog.text
        rec = dev.store.record()
        assert rec is not None and rec.trial_restarts == 1 and rec.trial_elapsed_s == 6.0

    asyncio.run(run())


def test_an_old_record_without_elapsed_time_runs_a_whole_trial(models, trusted, payload, tmp_path):
    """A record written by an older agent in its trial has only `trial_started_unix` (here a
    year ago): the new agent reads it and runs a whole trial of served time."""
    dev = device(tmp_path, models, trusted, 0.0, synced=True)

    def crash_as_the_trial_starts(status: fpb.UpdateStatus) -> None:
        if status.phase == Phase.TRIAL:
            hosts[0].updater.stop()  # the task ends at the trial's first await

    async def run() -> None:
        host = await dev.start(crash_as_the_trial_starts)
        hosts.append(host)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        task = host.updater._task
        assert task is not None
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        rec = dev.store.record()
        assert rec is not None and rec.state == R.TRIAL
        rec.ClearField("trial_elapsed_s")
        rec.trial_started_unix = time.time() - YEAR
        dev.store.save(rec)
        dev.at.clear()
        resumed = time.monotonic()
        again = await dev.start(lambda s: None)
        final = await dev.final(again)
        assert final.phase == Phase.COMMITTED, (final, again.phases())
        assert dev.at[Phase.COMMITTED] - resumed >= TRIAL_S

    hosts: list[FileHost] = []
    asyncio.run(run())


@pytest.mark.parametrize("years", [-10, 10])
def test_a_committed_update_stays_committed_whatever_the_clock(
    years, models, trusted, payload, tmp_path
):
    dev = device(tmp_path, models, trusted, 0.0, synced=True)

    async def run() -> None:
        host = await dev.start(lambda s: None)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        assert (await dev.final(host)).phase == Phase.COMMITTED
        dev.clock.step(years * YEAR, synchronized=False)
        again = await dev.start(lambda s: None)
        assert again.serving.version == 1 and again.serving.verify() is None
        rec = dev.store.record()
        assert rec is not None and rec.state == R.COMMITTED
        assert [s.phase for s in again.reports] == [Phase.COMMITTED]  # re-reported, nothing new

    asyncio.run(run())


# ----------------------------------------------------------------------------- real daemon

LIBFAKETIME = Path(f"/usr/lib/{platform.machine()}-linux-gnu/faketime/libfaketime.so.1")
FIX_SOURCE = SUPPORT / "faketime_fix.c"


@pytest.fixture(scope="module")
def faketime_preload(tmp_path_factory) -> str:
    """LD_PRELOAD for a process whose wall clock follows a file (libfaketime, Debian's
    `libfaketime`, installed by scripts/test), with the sleep fix in front of it."""
    assert LIBFAKETIME.exists(), f"{LIBFAKETIME} missing: apt-get install libfaketime"
    lib = tmp_path_factory.mktemp("faketime") / "faketime_fix.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(FIX_SOURCE)], check=True)
    return f"{lib}:{LIBFAKETIME}"


class FakeTime:
    """The wall clock of the daemons started with `env`: `set("-1095d")`, `set("+0")`."""

    def __init__(self, tmp: Path, preload: str, offset: str) -> None:
        self.file = tmp / "faketime"
        self.set(offset)
        self.env = {
            "LD_PRELOAD": preload,
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_NO_CACHE": "1",  # a change is seen at the next clock read
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # a board's monotonic clock never steps
        }

    def set(self, offset: str) -> None:
        self.file.write_text(offset + "\n")


def _daemon(  # type: ignore[no-untyped-def]
    tmp: Path,
    models: Models,
    broker,
    trusted: Path,
    device: str,
    env: dict[str, str],
    trial_s: float = 1.0,
) -> Daemon:
    """A daemon that takes the wall clock as synchronized while timesync/synchronized exists
    under `tmp`, returned once it is online."""
    flag = tmp / "timesync" / "synchronized"
    flag.parent.mkdir(exist_ok=True)
    text = test_updates.config(trusted, trial_s).replace(
        'clock = "trusted"', f'clock = "timesyncd"\ntimesync_file = "{flag}"'
    )
    seen = Observer(broker, f"birth-{device}-{time.monotonic_ns()}")
    args = ("--broker", broker.url, "--device-id", device)
    d = Daemon(tmp, models.base, text, env=env, args=args)
    try:
        seen.state(device, fpb.DeviceState.ONLINE)
    finally:
        seen.close()
    return d


def _over_http(models: Models, tmp: Path) -> tuple[PayloadServer, bytes]:
    served = Served(tmp / "payload.bin")
    http = PayloadServer(served)
    path = bundle(models, tmp, payload_url=http.url, version=1)
    read_bundle(path)[1].extract(served.path)
    return http, read_bundle(path)[0].SerializeToString()


def _wait(pred: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _healths(watch: Observer, device: str) -> list[fpb.Health]:
    topic = Topics(PREFIX, device).health
    with watch._cv:
        return [fpb.Health.FromString(s.payload) for s in watch.seen if s.topic == topic]


@pytest.mark.parametrize("days", [-1095, 1095])
def test_a_daemon_booted_years_off_waits_for_the_clock_then_commits(
    days, models, trusted, broker, tmp_path, faketime_preload
):
    """`edge-agent run` boots three years off and unsynchronized (libfaketime); the update is
    taken (the old agent refused it: `not_yet_valid` / `expired`), rebuilt and staged, then
    waits; health says the clock is not synchronized. NTP steps the clock and
    systemd-timesyncd's flag appears: it activates and commits."""
    clock = FakeTime(tmp_path, faketime_preload, f"{days:+d}d")
    http, signed = _over_http(models, tmp_path)
    device = f"dev-clock-boot-{'ahead' if days > 0 else 'back'}"
    watch = Observer(broker, device)
    d = _daemon(tmp_path, models, broker, trusted, device, clock.env)
    try:
        resp = send(options(broker), PREFIX, device, "update", {}, signed, 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        _wait(
            lambda: any("synchronized clock" in s.message for s in statuses(watch, device)),
            "the staged update does not say it waits for the clock",
        )
        assert d.client().info()["version"] == "1.0.0"
        _wait(lambda: any(h.HasField("clock") for h in _healths(watch, device)), "no clock")
        assert not _healths(watch, device)[-1].clock.synchronized
        clock.set("+0")  # NTP steps the clock to the real time...
        (tmp_path / "timesync" / "synchronized").touch()  # ...and timesyncd says so
        final = wait_final(watch, device)
        assert final.phase == Phase.COMMITTED, (final, test_updates.phases(watch, device))
        assert d.client().info()["version"] == "1.1.0"
        _wait(
            lambda: (
                _healths(watch, device)[-1].clock
                == fpb.Clock(synchronized=True, source="timesyncd")
            ),
            "health does not show the synchronized clock",
        )
    finally:
        d.stop()
        http.close()
        watch.close()


@pytest.mark.parametrize("days", [-3650, 3650])
def test_a_daemon_whose_clock_steps_in_the_trial_runs_the_whole_trial(
    days, models, trusted, broker, tmp_path, faketime_preload
):
    """The wall clock of a real daemon steps ten years, either way, as its trial starts: the
    trial lasts `trial_s` of served time (forward, the old agent committed at once; backward,
    it waited ten years)."""
    trial_s = 4.0
    clock = FakeTime(tmp_path, faketime_preload, "+0")
    (tmp_path / "timesync").mkdir()
    (tmp_path / "timesync" / "synchronized").touch()
    http, signed = _over_http(models, tmp_path)
    device = f"dev-clock-trial-{'ahead' if days > 0 else 'back'}"
    watch = Observer(broker, device)
    resume = tmp_path / "resume"
    pause = {"EDGE_AGENT_OTA_PAUSE_AT": "trial", "EDGE_AGENT_OTA_RESUME_FILE": str(resume)}
    d = _daemon(tmp_path, models, broker, trusted, device, {**clock.env, **pause}, trial_s=trial_s)
    try:
        resp = send(options(broker), PREFIX, device, "update", {}, signed, 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        _wait(lambda: Phase.TRIAL in [s.phase for s in statuses(watch, device)], "no trial")
        clock.set(f"{days:+d}d")
        started = time.monotonic()
        resume.touch()  # the trial starts after the step
        final = wait_final(watch, device, timeout=trial_s + WAIT_S)
        assert final.phase == Phase.COMMITTED, (final, test_updates.phases(watch, device))
        assert time.monotonic() - started >= trial_s
        assert d.client().info()["version"] == "1.1.0"
    finally:
        d.stop()
        http.close()
        watch.close()


def test_a_daemon_restarted_years_back_in_its_trial_finishes_it(
    models, trusted, broker, tmp_path, faketime_preload
):
    """Killed in its trial, the daemon starts again three years back (fake-hwclock's time
    without NTP yet): the trial continues and commits (the old agent waited three years)."""
    clock = FakeTime(tmp_path, faketime_preload, "+0")
    (tmp_path / "timesync").mkdir()
    (tmp_path / "timesync" / "synchronized").touch()
    http, signed = _over_http(models, tmp_path)
    device = "dev-clock-restart"
    watch = Observer(broker, "clock-restart")
    crash = {"EDGE_AGENT_OTA_CRASH_AT": "trial"}
    d = _daemon(tmp_path, models, broker, trusted, device, {**clock.env, **crash}, trial_s=2.0)
    try:
        with contextlib.suppress(FleetError):
            send(options(broker), PREFIX, device, "update", {}, signed, 30)
        assert d.proc.wait(WAIT_S) == -signal.SIGKILL  # switched, then "crashed" in its trial
        d.stop()
        clock.set("-1095d")
        (tmp_path / "timesync" / "synchronized").unlink()
        d = _daemon(tmp_path, models, broker, trusted, device, clock.env, trial_s=2.0)
        final = wait_final(watch, device)
        assert final.phase == Phase.COMMITTED, (final, test_updates.phases(watch, device))
        assert d.client().info()["version"] == "1.1.0"
    finally:
        d.stop()
        http.close()
        watch.close()


@pytest.mark.parametrize("years", [-10, 10])
def test_a_rolled_back_update_stays_rolled_back_whatever_the_clock(
    years, models, trusted, payload, tmp_path
):
    """The clock steps as the trial starts and the trial's health check fails: rolled back,
    and restarts with the clock off either way keep the old model."""
    dev = device(tmp_path, models, trusted, 0.0, synced=True)

    def on_report(status: fpb.UpdateStatus) -> None:
        if status.phase == Phase.TRIAL:
            dev.clock.step(years * YEAR, synchronized=True)
            hosts[0].problem = "the engine thread has not answered for 12.0 s"

    async def run() -> None:
        host = await dev.start(on_report)
        hosts.append(host)
        assert (await host.updater.offer(payload)).phase == Phase.RECEIVED
        final = await dev.final(host)
        assert final.phase == Phase.ROLLED_BACK and "health check" in final.message, final
        assert host.serving.version == 0
        for again_years in (-years, years):
            dev.clock.step(again_years * YEAR, synchronized=False)
            again = await dev.start(lambda s: None)
            assert again.serving.version == 0 and again.serving.verify() is None
            rec = dev.store.record()
            assert rec is not None and rec.state == R.ROLLED_BACK

    hosts: list[FileHost] = []
    asyncio.run(run())
