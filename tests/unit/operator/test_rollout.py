"""Staged rollouts over a real mosquitto on loopback against simulated devices
(tests/support/fleetsim.py: the real fleet link and the real update state machine, real signatures
and
real MQTT block transfers; only the engine is a stub): waves in hash order, a halt at the first
wave over the threshold with nothing offered beyond it, retry-failed as the only second offer,
an operator process killed with SIGKILL and resumed without a double offer, the lock, pause, and
a device that comes online mid-rollout (docs/ROLLOUTS.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions
from agent.operator.rollout import plan
from agent.operator.rollout.report import RolloutReport
from agent.operator.rollout.run import (
    create_rollout,
    load_rollout,
    request,
    retry_failed,
    run_rollout,
)
from agent.operator.rollout.state import RolloutError, State, Target, to_json
from agent.operator.rollout.store import RolloutStore
from tests.support.broker import Mosquitto
from tests.support.fleetsim import FleetSim, SimDevice, SimModels
from tests.support.paths import ROOT


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    """One broker per test: a target of `all` is every device the broker has a retained state
    of, so the devices of one test must not linger in the next one's."""
    b = Mosquitto(tmp_path / "broker")
    yield b
    b.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimModels:
    return SimModels.create(tmp_path_factory.mktemp("rollout-models"))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text("")
    return path


def sim(
    broker: Mosquitto,
    models: SimModels,
    root: Path,
    devices: list[SimDevice],
    protocol: str = "5",
) -> FleetSim:
    return FleetSim(
        broker.url,
        root,
        devices,
        trusted_keys_dir=models.trusted,
        shipped=models.shipped,
        protocol=protocol,
    )


def opts(broker: Mosquitto, protocol: str = "5") -> MqttOptions:
    return MqttOptions(broker=parse_broker("test", "broker", broker.url), protocol=protocol)


def edge_agent(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def conn_to(url: str, config: Path, store: Path) -> list[str]:
    return ["--broker", url, "--config", str(config), "--rollouts-dir", str(store)]


def conn(broker: Mosquitto, config: Path, store: Path) -> list[str]:
    return conn_to(broker.url, config, store)


def wait_for(what: str, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def test_a_group_rollout_completes_in_its_waves_in_hash_order(
    broker: Mosquitto, models: SimModels, config: Path, tmp_path: Path
) -> None:
    lab = [f"lab-{i:02d}" for i in range(12)]
    devices = [SimDevice(d, group="lab") for d in lab]
    devices += [SimDevice(f"other-{i}", group="other") for i in range(4)]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    argv = ["fleet", "rollout", "start", str(bundle), "--target", "group:lab", "--waves",
            "10%,50%,100%", "--soak", "1s", "--wave-timeout", "60s", "--id", "r-lab", "--json",
            *conn(broker, config, store)]  # fmt: skip
    with sim(broker, models, tmp_path / "fleet", devices) as fleet:
        done = edge_agent(*argv)
        assert done.returncode == 0, done.stderr
        rep = json.loads(done.stdout)
        assert rep["state"] == "completed" and not rep["halted"]
        assert [w["offered"] for w in rep["waves"]] == [2, 4, 6]  # ceil(10%, 50%, 100% of 12)
        assert [w["committed"] for w in rep["waves"]] == [2, 4, 6]
        assert all(w["failed"] == 0 and w["state"] == "ended" for w in rep["waves"])
        assert all(w["duration_s"] > 0 for w in rep["waves"])
        order = plan.ordered("r-lab", lab)  # sha256 of rollout id and device id
        by_wave = [[d["device"] for d in rep["devices"] if d["wave"] == w] for w in (1, 2, 3)]
        assert [sorted(w) for w in by_wave] == [
            sorted(order[:2]),
            sorted(order[2:6]),
            sorted(order[6:]),
        ]
        for d in lab:
            assert fleet.offers(d) == 1 and fleet.version(d) == "1.1.0", d
        for d in fleet.device_ids():
            if d.startswith("other-"):
                assert fleet.offers(d) == 0 and fleet.version(d) == "1.0.0"

        # status works from the file alone; the same id again is refused; a second rollout of
        # the same update finds every device on the target already: nothing offered
        status = edge_agent("fleet", "rollout", "status", "r-lab", "--json",
                            "--rollouts-dir", str(store))  # fmt: skip
        assert status.returncode == 0
        assert {**json.loads(status.stdout), "running": None} == {**rep, "running": None}
        again = edge_agent(*argv)
        assert again.returncode == 2 and again.stderr.count("\n") == 1
        assert "rollout r-lab exists" in again.stderr and "Traceback" not in again.stderr
        argv[argv.index("r-lab")] = "r-lab-2"
        second = edge_agent(*argv)
        assert second.returncode == 0, second.stderr
        rep2 = json.loads(second.stdout)
        assert rep2["offered"] == 0 and rep2["already"] == 12
        assert all(fleet.offers(d) == 1 for d in lab)


def test_it_halts_at_the_first_wave_over_the_threshold_and_retry_is_the_only_second_offer(
    broker: Mosquitto, models: SimModels, tmp_path: Path
) -> None:
    ids = [f"halt-{i:02d}" for i in range(20)]
    order = plan.ordered("r-halt", ids)
    # wave 1 (10%): order[0:2] fine; wave 2 (50%): order[2:10], 3 of them fail; wave 3 would
    # have failures too, but must never be offered
    bad = {order[3]: "reject", order[5]: "reject", order[8]: "rollback", order[12]: "reject"}
    devices = [SimDevice(d, behaviour=bad.get(d, "ok")) for d in ids]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    create_rollout(
        store, bundle, Target("all"), (0.1, 0.5, 1.0), prefix="fleet/v1", min_devices=2,
        max_failure_rate=0.2, wave_timeout_s=60, soak_s=0.5, rollout_id="r-halt",
    )  # fmt: skip
    with sim(broker, models, tmp_path / "fleet", devices) as fleet:
        rep = run_rollout(opts(broker), store, "r-halt")
        assert rep.state == "halted" and rep.halted
        # the 3 failures halt it once the verdict is certain: with every device of the wave
        # finished, or (a loaded machine) with devices still in flight, which cannot change it
        assert re.search(
            r"wave 2: 3 of (10 finished devices failed \(30\.0% > 20\.0%|\d finished devices "
            r"failed, over 20\.0% even if the \d not final yet commit \(30\.0%\))",
            rep.reason,
        ), rep.reason
        assert [w.offered for w in rep.waves] == [2, 8, 0]
        assert [w.state for w in rep.waves] == ["ended", "halted", "pending"]
        reasons = dict(rep.waves[1].failed_by_reason)
        assert reasons.get("unknown_key") == 2 and sum(reasons.values()) == 3
        for d in order[:10]:
            assert fleet.offers(d) == 1, d
        for d in order[10:]:
            assert fleet.offers(d) == 0, d  # nothing beyond the halted wave

        # halted stays halted: running it again offers nothing
        assert run_rollout(opts(broker), store, "r-halt").state == "halted"
        assert all(fleet.offers(d) == 0 for d in order[10:])

        # retry-failed: the failed devices get attempt 2 (and fail again: the same key is
        # still unknown to them), nothing else is offered twice
        assert retry_failed(store, "r-halt") is not None
        rep = run_rollout(opts(broker), store, "r-halt", resume=True)
        assert rep.state == "halted"
        failed = {d["device"]: d for d in rep.devices if d["status"] == "failed"}
        assert set(failed) == {order[3], order[5], order[8]}
        assert all(d["attempt"] == 2 for d in failed.values())
        for d in order[:10]:
            assert fleet.offers(d) == (2 if d in failed else 1), d
        assert all(fleet.offers(d) == 0 for d in order[10:])


def _state(store: Path, rollout_id: str) -> dict:  # type: ignore[type-arg]
    try:
        return to_json(load_rollout(store, rollout_id))
    except RolloutError:  # not written yet
        return {}


def test_an_operator_killed_mid_rollout_resumes_without_offering_twice(
    broker: Mosquitto, models: SimModels, config: Path, tmp_path: Path
) -> None:
    ids = [f"kill-{i:02d}" for i in range(12)]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    argv = ["fleet", "rollout", "start", str(bundle), "--target", "all", "--waves",
            "25%,50%,100%", "--soak", "3s", "--wave-timeout", "60s", "--id", "r-kill",
            *conn(broker, config, store)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def operator(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "agent", *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    with sim(broker, models, tmp_path / "fleet", [SimDevice(d) for d in ids]) as fleet:
        # the lock, then SIGTERM (what kill and a CI job's timeout send; Ctrl-C takes the
        # same KeyboardInterrupt path): exit 130, the state kept as running
        proc = operator(*argv)
        try:
            wait_for("wave 1 offered", lambda: sum(fleet.offers(d) for d in ids) >= 3)
            # a second operator on the same rollout is refused, naming the holder
            busy = edge_agent("fleet", "rollout", "resume", "r-kill", *conn(broker, config, store))
            assert busy.returncode == 1 and busy.stderr.count("\n") == 1, busy.stderr
            assert f"being run by pid {proc.pid}" in busy.stderr
            status = edge_agent("fleet", "rollout", "status", "r-kill", "--json",
                                "--rollouts-dir", str(store))  # fmt: skip
            assert json.loads(status.stdout)["running"] is True
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "fleet rollout resume r-kill" in err and "Traceback" not in err
        assert _state(store, "r-kill")["state"] == "running"
        # resumed, then SIGKILLed as soon as wave 2 is offered (its devices mid-update)
        proc = operator("fleet", "rollout", "resume", "r-kill", *conn(broker, config, store))
        try:
            wait_for("wave 2 offered", lambda: sum(fleet.offers(d) for d in ids) >= 6, 90)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
        offered_before = {d: fleet.offers(d) for d in ids}
        assert 0 < sum(offered_before.values()) < len(ids)
        resumed = edge_agent("fleet", "rollout", "resume", "r-kill", "--json",
                             *conn(broker, config, store))  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        rep = json.loads(resumed.stdout)
        assert rep["state"] == "completed" and rep["committed"] == 12, rep
        assert [w["offered"] for w in rep["waves"]] == [3, 3, 6]
        for d in ids:
            assert fleet.offers(d) == 1 and fleet.version(d) == "1.1.0", d


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--waves", "10%,5%,100%"], "--waves"),
        (["--waves", "10%,50%"], "the last wave must be 100%"),
        (["--max-failure-rate", "5"], "--max-failure-rate"),
        (["--wave-timeout", "soon"], "--wave-timeout"),
        (["--id", "../x"], "rollout id"),
        (["--min-devices", "0"], "--min-devices"),
        (["--target", "group:"], "--target"),
        (["--target", "all,dev-1"], "--target"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2_before_anything_is_written(
    flags: list[str], says: str, config: Path, tmp_path: Path, models: SimModels
) -> None:
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    argv = ["fleet", "rollout", "start", str(bundle), "--target", "all",
            *conn_to("mqtt://127.0.0.1:9", config, store)]  # fmt: skip
    if flags[0] == "--target":
        argv[argv.index("--target") : argv.index("--target") + 2] = flags
    else:
        argv += flags
    done = edge_agent(*argv)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert not store.exists() or not any(store.iterdir())


def test_a_bundle_that_does_not_read_is_one_line_and_exit_2(config: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a bundle")
    store = tmp_path / "rollouts"
    bad = edge_agent("fleet", "rollout", "start", str(junk), "--target", "all",
                     *conn_to("mqtt://127.0.0.1:9", config, store))  # fmt: skip
    assert bad.returncode == 2 and str(junk) in bad.stderr and bad.stderr.count("\n") == 1
    assert "Traceback" not in bad.stderr and not store.exists()


def test_pause_is_taken_by_the_running_process_and_a_late_device_joins_the_current_wave(
    broker: Mosquitto, models: SimModels, tmp_path: Path
) -> None:
    ids = [f"late-{i:02d}" for i in range(10)]
    # a device id that ranks before every other: when it comes online during wave 1 (50%),
    # the quota grows from 5 of 10 to 6 of 11 and it takes the new place
    candidates = (f"late-new-{i}" for i in range(1000))
    late = next(c for c in candidates if plan.ordered("r-late", [*ids, c])[0] == c)
    devices = [SimDevice(d) for d in ids] + [SimDevice(late, start_online=False)]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    create_rollout(
        store, bundle, Target("all"), (0.5, 1.0), prefix="fleet/v1",
        wave_timeout_s=60, soak_s=6.0, rollout_id="r-late",
    )  # fmt: skip
    result: list[RolloutReport] = []
    with sim(broker, models, tmp_path / "fleet", devices) as fleet:
        runner = threading.Thread(
            target=lambda: result.append(run_rollout(opts(broker), store, "r-late"))
        )
        runner.start()
        try:
            wait_for("wave 1 offered", lambda: sum(fleet.offers(d) for d in ids) == 5)
            fleet.come_online(late)
            wait_for("the late device committed", lambda: fleet.phase(late) == "committed")
            assert request(store, "r-late", "pause") is None  # left for the running process
            runner.join(5)
            assert not runner.is_alive()  # it took the pause within a second or so
        finally:
            if runner.is_alive():
                request(store, "r-late", "abort")
                runner.join(30)
        (rep,) = result
        assert rep.state == "paused" and rep.waves[0].offered == 6 and rep.waves[1].offered == 0
        assert fleet.offers(late) == 1
        assert sum(fleet.offers(d) for d in ids) == 5  # nothing offered while paused
        assert RolloutStore(store).pending("r-late") == []  # the request was carried out
        rep = run_rollout(opts(broker), store, "r-late", resume=True)
        assert rep.state == State.COMPLETED.value
        assert [w.offered for w in rep.waves] == [6, 5]
        assert all(fleet.offers(d) == 1 for d in [*ids, late])


def test_a_rollout_over_mqtt_3_1_1(broker: Mosquitto, models: SimModels, tmp_path: Path) -> None:
    """No response topic, no correlation property: the Command carries them, the devices
    answer on the rollout's one wildcard subscription; blocks and reports as on MQTT 5."""
    ids = [f"v311-{i}" for i in range(6)]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    create_rollout(
        store, bundle, Target.parse(ids), (0.5, 1.0), prefix="fleet/v1", soak_s=0.0,
        wave_timeout_s=60, rollout_id="r-311",
    )  # fmt: skip
    devices = [SimDevice(d) for d in ids]
    with sim(broker, models, tmp_path / "fleet", devices, protocol="3.1.1") as fleet:
        rep = run_rollout(opts(broker, "3.1.1"), store, "r-311")
        assert rep.state == "completed" and [w.committed for w in rep.waves] == [3, 3]
        assert all(fleet.offers(d) == 1 and fleet.version(d) == "1.1.0" for d in ids)


def test_pause_abort_resume_and_status_without_a_running_process(
    models: SimModels, config: Path, tmp_path: Path
) -> None:
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    create_rollout(store, bundle, Target("all"), (1.0,), prefix="fleet/v1", rollout_id="r-ops")
    d = ["--rollouts-dir", str(store)]
    paused = edge_agent("fleet", "rollout", "pause", "r-ops", "--json", *d)
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout) == {
        "rollout_id": "r-ops", "request": "pause", "left_for_running_process": False,
        "state": "paused", "reason": "paused by an operator",
    }  # fmt: skip
    assert _state(store, "r-ops")["state"] == "paused"
    listed = edge_agent("fleet", "rollout", "status", "--json", *d)
    assert json.loads(listed.stdout) == [
        {"rollout_id": "r-ops", "state": "paused", "update_id": _state(store, "r-ops")["spec"][
            "update_id"], "target": "all", "running": False}
    ]  # fmt: skip
    retry = edge_agent("fleet", "rollout", "retry-failed", "r-ops", *d)
    assert retry.returncode == 2 and "has no failed devices" in retry.stderr
    aborted = edge_agent("fleet", "rollout", "abort", "r-ops", *d)
    assert aborted.returncode == 0 and "aborted" in aborted.stdout
    for argv in (
        ["resume", "r-ops", *conn_to("mqtt://127.0.0.1:9", config, store)],
        ["pause", "r-ops", *d],
        ["retry-failed", "r-ops", *d],
        ["status", "nope", *d],
    ):
        done = edge_agent("fleet", "rollout", *argv)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (argv, done.stderr)
        assert "Traceback" not in done.stderr
    assert _state(store, "r-ops")["state"] == "aborted"  # fmt: skip
