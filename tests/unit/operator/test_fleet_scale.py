"""Rollouts at scale: 1,000 simulated devices (tests/support/fleetsim.py: each one the real fleet
link
and the real update state machine, real signatures, payloads in real MQTT blocks; only the engine
is a stub) on a real mosquitto, and `edge-agent fleet rollout` as a real operator process:

* a rollout to all 1,000 completes in its waves (1%, 10%, 50%, 100%), every device committed and
  offered exactly once; devices that come online mid-rollout are offered in the wave that runs;
* with 10% of the devices failing (reject, rollback, stall, offline) it halts at the first wave
  over the threshold, as soon as that is certain (not after its stalled devices time out), and
  no device beyond that wave is offered;
* the operator process SIGKILLed mid-rollout and started again resumes, and no device is offered
  twice;
* and, on six devices over HTTP, that each simulated failure happens as the simulator documents.

The small cases of the same rules are in tests/unit/operator/test_rollout.py; the timings and the
resources
they take are measured by benchmarks/bench_fleet.py (docs/PERFORMANCE.md), never asserted here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.operator.rollout import plan
from agent.operator.rollout.run import load_rollout
from agent.operator.rollout.state import to_json
from tests.support.broker import Mosquitto
from tests.support.fleetsim import FleetShards, FleetSim, SimDevice, SimModels, scratch_root
from tests.support.paths import ROOT

N = 1000
WAVES = (0.01, 0.1, 0.5, 1.0)
FAILING = ("reject", "rollback", "stall", "offline")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    """One broker per test: `--target all` is every device with a retained state there."""
    b = Mosquitto(tmp_path / "broker")
    yield b
    b.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimModels:
    return SimModels.create(tmp_path_factory.mktemp("scale-models"))


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    with scratch_root(tmp_path / "fleet") as r:  # tmpfs: a thousand updaters fsync a lot
        yield r


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text("")
    return path


def fleet(broker: Mosquitto, models: SimModels, root: Path, devices: list[SimDevice]) -> FleetSim:
    # health every 30 s: the heartbeat of a real fleet is 60 s; the rollout needs none of it
    return FleetSim(
        broker.url,
        root,
        devices,
        trusted_keys_dir=models.trusted,
        shipped=models.shipped,
        health_interval_s=30.0,
        max_download_attempts=1000,  # a stalled device stays stalled: the rollout times it out
    )


def rollout(broker: Mosquitto, config: Path, store: Path, *args: str) -> list[str]:
    conn = ["--broker", broker.url, "--config", str(config), "--rollouts-dir", str(store)]
    return [sys.executable, "-m", "agent", "fleet", "rollout", *args, "--json", *conn]


def run(argv: list[str], timeout: float = 900) -> dict:  # type: ignore[type-arg]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env()
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def wait_for(what: str, done: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def wave_sizes(n: int) -> list[int]:
    """How many devices each wave offers to a fleet of `n` (the documented quota rule)."""
    covered = [plan.quota(f, n) for f in WAVES]
    return [c - p for c, p in zip(covered, [0, *covered[:-1]], strict=True)]


def first_ranked(rollout_id: str, below: str, count: int) -> list[str]:
    """`count` device ids that rank before every device ranked `below` or later: they come
    first in the rollout's order whatever else is in the fleet."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        name = f"late-{i:06d}"
        if plan.rank(rollout_id, name) < below:
            out.append(name)
        i += 1
    return sorted(out, key=lambda d: plan.rank(rollout_id, d))


def test_a_rollout_to_1000_devices_completes_in_its_waves_and_late_devices_join_the_running_wave(
    broker: Mosquitto, models: SimModels, root: Path, config: Path, tmp_path: Path
) -> None:
    rid = "r-all"
    ids = [f"dev-{i:04d}" for i in range(N - 4)]
    lowest = min(plan.rank(rid, d) for d in ids)
    late = first_ranked(rid, lowest, 4)  # never seen before; the lowest ranks of all
    devices = [SimDevice(d) for d in ids] + [SimDevice(d, start_online=False) for d in late]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    argv = rollout(broker, config, tmp_path / "rollouts", "start", str(bundle), "--target", "all",
                   "--waves", "1%,10%,50%,100%", "--soak", "1s", "--wave-timeout", "600s",
                   "--id", rid)  # fmt: skip
    first_two = sum(wave_sizes(len(ids))[:2])
    wave_3 = plan.ordered(rid, ids)[first_two : sum(wave_sizes(len(ids))[:3])]
    with fleet(broker, models, root, devices) as sim:
        # the last device of wave 3 does not activate until the newcomers have their places:
        # wave 3 is still running when they come, however slow or fast this machine is
        sim.hold([wave_3[-1]])
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        try:
            # wave 3 (50%) has started: its 398 offers go out at once
            wait_for("wave 3 offered", lambda: sum(sim.offers(d) for d in ids) > first_two)
            for d in late:  # each joins the fleet (a first birth) while wave 3 runs
                sim.come_online(d, timeout_s=120)
            wait_for("two newcomers offered", lambda: all(sim.offers(d) for d in late[:2]))
            sim.release()
            out, err = proc.communicate(timeout=900)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, err[-3000:]
        rep = json.loads(out)
        assert rep["state"] == "completed" and not rep["halted"]
        assert rep["committed"] == N and rep["failed"] == 0 and rep["offered"] == N
        assert all(w["state"] == "ended" and w["failed"] == 0 for w in rep["waves"])
        # N was 996 when wave 3 began (quota 498 of them); the four newcomers make it 1,000
        # (quota 500): the two places that opened went to the lowest-ranked newcomers, the
        # other two were offered at the start of wave 4
        assert [w["offered"] for w in rep["waves"]] == [10, 90, 400, 500]
        by_device = {d["device"]: d for d in rep["devices"]}
        assert [by_device[d]["wave"] for d in late] == [3, 3, 4, 4]
        for d in sim.device_ids():
            assert sim.offers(d) == 1, d
            assert sim.phase(d) == "committed" and sim.version(d) == "1.1.0", d
        order = plan.ordered(rid, ids)  # the devices online from the start, by rank
        assert {d for d in ids if by_device[d]["wave"] == 1} == set(order[:10])
        assert {d for d in ids if by_device[d]["wave"] <= 3} == set(order[:498])


def test_with_10_percent_failing_it_halts_at_the_first_wave_over_the_threshold(
    broker: Mosquitto, models: SimModels, root: Path, config: Path, tmp_path: Path
) -> None:
    rid, rate, min_devices = "r-halt", 0.05, 20
    ids = [f"dev-{i:04d}" for i in range(N)]
    rng = random.Random(26)
    # the failures by rank: reject, rollback, stall, offline, reject, ... (wave 1's one is a
    # reject: a stalled device there would cost a whole --wave-timeout before wave 2)
    bad = plan.ordered(rid, rng.sample(ids, N // 10))
    behaviour = {d: FAILING[i % len(FAILING)] for i, d in enumerate(bad)}
    order = plan.ordered(rid, ids)
    covered = [plan.quota(f, N) for f in WAVES]
    # the first wave whose devices so far fail more than `rate` (the threshold applies from
    # `min_devices` final devices on): the rollout must stop there
    halt = next(
        i
        for i, c in enumerate(covered)
        if c >= min_devices and sum(d in behaviour for d in order[:c]) / c > rate
    )
    assert halt >= 1, "the sample must let wave 1 pass, or the test shows little"
    assert halt < len(WAVES) - 1, "and some wave must be left to not offer"
    final = sum(behaviour.get(d, "ok") not in ("ok", "stall") for d in order[: covered[halt]])
    assert final / covered[halt] > rate, "the verdict is certain before a stall times out"
    devices = [SimDevice(d, behaviour=behaviour.get(d, "ok")) for d in ids]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    argv = rollout(broker, config, tmp_path / "rollouts", "start", str(bundle), "--target", "all",
                   "--waves", "1%,10%,50%,100%", "--soak", "1s", "--wave-timeout", "600s",
                   "--min-devices", str(min_devices), "--max-failure-rate", "5%",
                   "--id", rid)  # fmt: skip
    with fleet(broker, models, root, devices) as sim:
        rep = run(argv)
        assert rep["state"] == "halted" and rep["halted"], rep["reason"]
        assert rep["reason"].startswith(f"wave {halt + 1}:"), rep["reason"]
        sizes = wave_sizes(N)
        assert [w["offered"] for w in rep["waves"]] == sizes[: halt + 1] + [0] * (
            len(WAVES) - halt - 1
        )
        assert rep["waves"][halt]["state"] == "halted"
        offered, beyond = order[: covered[halt]], order[covered[halt] :]
        for d in offered:
            assert sim.offers(d) == 1, d
        for d in beyond:
            assert sim.offers(d) == 0, d  # nothing offered past the halted wave
        # the rollout halts once the wave's verdict is certain, without waiting out the wave
        # timeout of its stalled devices: each device offered still ends as it behaves
        want = {"reject": "rejected", "rollback": "rolled_back", "stall": "downloading"}
        for d in offered:
            b = behaviour.get(d, "ok")
            if b == "offline":
                assert not sim.online(d) and sim.phase(d) == "", d
            else:
                wait_for(f"{d} {b}", lambda d=d, b=b: sim.phase(d) == want.get(b, "committed"))
        # and what the rollout recorded of them is what they did, each failure with its reason
        code = {"reject": "unknown_key", "rollback": "rolled_back", "stall": "timeout"}
        recorded = {r["device"]: r for r in rep["devices"]}
        assert set(recorded) == set(offered)
        for d in offered:
            b, r = behaviour.get(d, "ok"), recorded[d]
            assert r["status"] in ({"committed"} if b == "ok" else {"failed"}) | {
                "offered", "in_progress"
            }, (d, b, r)  # fmt: skip
            if r["status"] == "failed":
                assert r["reason"] == code.get(b, b), (d, b, r)
        assert all(
            recorded[d]["status"] != "failed" for d in offered if behaviour.get(d) == "stall"
        )
        failed = [r for r in recorded.values() if r["status"] == "failed"]
        assert rep["failed"] == len(failed) and rep["failure_rate"] > rate
        by_reason: dict[str, int] = {}
        for w in rep["waves"]:
            for k, v in w["failed_by_reason"].items():
                by_reason[k] = by_reason.get(k, 0) + v
        assert by_reason == dict(Counter(r["reason"] for r in failed))
        assert rep["committed"] == sum(r["status"] == "committed" for r in recorded.values())


def test_a_rollout_reaches_devices_simulated_in_several_processes(
    broker: Mosquitto, models: SimModels, root: Path, config: Path, tmp_path: Path
) -> None:
    """`FleetShards`, which bench_fleet.py runs 10,000 devices with: the devices of three
    processes are one fleet to the operator, and the queries gather every process's."""
    ids = [f"dev-{i:04d}" for i in range(60)]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    devices = [SimDevice(d) for d in ids]
    with FleetShards(broker.url, root, devices, processes=3, trusted_keys_dir=models.trusted,
                     shipped=models.shipped, health_interval_s=30.0) as sim:  # fmt: skip
        assert len(set(sim.pids)) == 3 and sim.threads() >= 60
        rep = run(rollout(broker, config, tmp_path / "rollouts", "start", str(bundle),
                          "--target", "all", "--waves", "10%,100%", "--soak", "1s",
                          "--id", "r-shards"))  # fmt: skip
        assert rep["state"] == "completed" and rep["committed"] == 60
        assert sim.offer_counts() == dict.fromkeys(ids, 1)
        assert sim.phases() == dict.fromkeys(ids, "committed")


def _state(store: Path, rollout_id: str) -> dict:  # type: ignore[type-arg]
    return to_json(load_rollout(store, rollout_id))


def test_an_operator_killed_mid_rollout_resumes_and_offers_no_device_twice(
    broker: Mosquitto, models: SimModels, root: Path, config: Path, tmp_path: Path
) -> None:
    rid = "r-kill"
    ids = [f"dev-{i:04d}" for i in range(N)]
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    argv = rollout(broker, config, store, "start", str(bundle), "--target", "all",
                   "--waves", "1%,10%,50%,100%", "--soak", "1s", "--wave-timeout", "600s",
                   "--id", rid)  # fmt: skip
    with fleet(broker, models, root, [SimDevice(d) for d in ids]) as sim:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            # SIGKILL once wave 3's 400 offers have reached the devices, while they update
            wait_for("wave 3 offered", lambda: sum(sim.offers(d) for d in ids) == 500)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        assert proc.returncode == -signal.SIGKILL
        before = _state(store, rid)
        assert before["state"] == "running"
        offered = {d for d in ids if sim.offers(d) == 1}
        assert len(offered) == 500
        rep = run(rollout(broker, config, store, "resume", rid))
        assert rep["state"] == "completed", rep["reason"]
        assert rep["committed"] == N and rep["failed"] == 0
        assert [w["offered"] for w in rep["waves"]] == wave_sizes(N)
        for d in ids:
            assert sim.offers(d) == 1, d  # no device was offered twice
            assert sim.phase(d) == "committed" and sim.version(d) == "1.1.0", d
        order = plan.ordered(rid, ids)
        assert offered == set(order[:500])  # those the killed process had offered


def test_each_simulated_failure_happens_as_documented_over_http(
    broker: Mosquitto, models: SimModels, root: Path, tmp_path: Path
) -> None:
    """The simulator's own promises (tests/support/fleetsim.py), on the HTTP transport the scale
    tests
    do not use: each behaviour ends as documented, a signed cancel ends a stalled download, an
    `offline` device never answers, its Will is on the broker and it gets the offer again when
    it comes back, and a device that loses power after its update resumes from its record."""
    from agent.config.file import parse_broker
    from agent.fleet.mqtt import MqttOptions
    from agent.operator.client import send
    from agent.operator.link import FleetError
    from agent.ota.artifact.bundle import read_bundle
    from agent.ota.artifact.cancel import sign_cancel
    from tests.support.httpserver import PayloadServer, Served

    served = Served(tmp_path / "payload.bin")
    http = PayloadServer(served)
    bundle = models.bundle(tmp_path / "u1.tar", version=1, payload_url=http.url)
    signed, payload = read_bundle(bundle)
    payload.extract(served.path)
    opts = MqttOptions(broker=parse_broker("test", "broker", broker.url))
    kinds = ("ok", "reject", "rollback", "stall", "offline", "fail", "crashloop")
    devices = [SimDevice(f"b-{b}", behaviour=b) for b in kinds]
    try:
        with fleet(broker, models, root, devices) as sim:
            codes = {}
            for d in devices:
                try:
                    resp = send(opts, "fleet/v1", d.device_id, "update", {},
                                signed.SerializeToString(), 5.0)  # fmt: skip
                    codes[d.behaviour] = resp.update.reason_code or resp.code
                except FleetError:  # no answer
                    codes[d.behaviour] = "no answer"
            assert codes["reject"] == "unknown_key" and codes["offline"] == "no answer"
            final = {
                "ok": "committed",
                "rollback": "rolled_back",
                "fail": "rejected",
                "crashloop": "rolled_back",
            }
            wait_for(
                "final phases", lambda: all(sim.phase(f"b-{b}") == p for b, p in final.items())
            )
            status = sim.last_status("b-fail")
            assert status is not None and status.reason_code == "payload_hash"
            status = sim.last_status("b-crashloop")  # by the updater's rule, at the 3rd start
            assert status is not None and "3 restarts during the trial" in status.message
            assert sim.online("b-crashloop") and sim.version("b-crashloop") == "1.0.0"
            assert sim.phase("b-stall") == "downloading"
            assert not sim.online("b-offline") and sim.phase("b-offline") == ""
            assert [sim.version(f"b-{b}") for b in ("ok", "rollback", "fail")] == [
                "1.1.0",
                "1.0.0",
                "1.0.0",
            ]
            # the stalled transfer ends with an operator's signed cancel
            update_id = read_offer_id(bundle)
            cancel = sign_cancel(update_id, [models.key], reason="stalled")
            resp = send(opts, "fleet/v1", "b-stall", "cancel", {}, cancel.SerializeToString(), 10)
            assert resp.update.reason_code == "cancelled", resp
            assert sim.phase("b-stall") == "rejected"
            # a power cut after the commit, and back: the store's pointer still says 1.1.0
            sim.go_offline("b-ok")
            sim.come_online("b-ok")
            assert sim.online("b-ok") and sim.version("b-ok") == "1.1.0"
            # back: nothing was installed while it was away, and its persistent session
            # delivers the offer it never acknowledged (MQTT's at-least-once), which it takes
            sim.come_online("b-offline")
            assert sim.online("b-offline")
            wait_for("the redelivered offer", lambda: sim.phase("b-offline") == "committed")
            assert sim.version("b-offline") == "1.1.0"
            assert {d.device_id: sim.offers(d.device_id) for d in devices} == {
                d.device_id: 2 if d.behaviour == "offline" else 1 for d in devices
            }
    finally:
        http.close()


def read_offer_id(bundle: Path) -> str:
    from agent.operator.publish import read_offer

    return read_offer(bundle)[1].update_id
