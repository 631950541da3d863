#!/usr/bin/env python3
"""The fleet at scale, on one real mosquitto on loopback (docs/PERFORMANCE.md, "Fleet at scale").

1. **Rollouts to 1,000 ... 10,000 devices.** The fleet simulator (tests/support/fleetsim.py's
   `FleetShards`: 1,000 devices per process, each the real fleet link and the real update
   machine against a stub engine; state directories on tmpfs) starts, then `edge-agent fleet
   rollout start BUNDLE --target all --waves 1%,10%,50%,100% --soak 1s` runs as its own
   process until it completes. Measured per size: the operator process's CPU seconds (user +
   system) and peak RSS (GNU time), its state database's size, mosquitto's RSS (idle with the
   fleet connected; its peak, VmHWM) and CPU during the rollout, each wave's duration (from the
   rollout's report), and the simulator processes' start time, RSS, threads and CPU.
   `--rules 1000,10000,50000`: the operator's rules and state store alone, without broker or
   devices (`rules_run`), each size in a process of its own: CPU and peak RSS of a whole
   rollout's decisions and saves.
2. **`fleet watch --once` and `fleet inventory` with 10,000 and 50,000 devices.** One client
   publishes a retained `state` and `health` for each device (no agents), then each command
   runs as its own process: wall time, CPU and peak RSS; and Python's start-up alone (`--help`
   of the same command) for reference.

Never part of the test command (a 10,000-device run takes many minutes on 2 cores).

    python benchmarks/bench_fleet.py [--devices 1000,3000,10000] [--processes 0]
        [--rules 1000,10000,50000] [--inventory-devices 10000,50000] [--rounds 3]
        [--save R.json] [--load R.json] [--no-write]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import write_section  # noqa: E402

MIB = 1 << 20
PREFIX = "fleet/v1"
# the simulated devices' tick (the daemon's is 1 s): each builds a whole health to compare with
# the last (~0.9 ms), which at 1 s costs 0.9 cores per 1,000 idle devices; a tick as long as the
# health interval (30 s) changes nothing the rollout sees (its statuses are events, not ticks)
SIM_TICK_S = 30.0


# ----------------------------------------------------------------------------- /proc


def _status_kib(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _mib(kib: float) -> float:
    return kib / 1024


TIME = "/usr/bin/time"  # GNU time: forks the command from a small process and reports its own


def timed(argv: list[str], report: Path) -> list[str]:
    """`argv` run under GNU time, which writes its peak RSS (KiB), user and system CPU s to
    `report`. (A child's ru_maxrss from our own wait4 would include the pages of this process
    at the fork: the benchmark's own hundred-odd MiB.)"""
    return [TIME, "-f", "%M %U %S", "-o", str(report), *argv]


def read_timed(report: Path) -> tuple[float, float]:
    """(peak RSS MiB, CPU s) from `timed`'s report."""
    rss_kib, user, system = report.read_text().split()[-3:]
    return _mib(int(rss_kib)), float(user) + float(system)


def run_measured(argv: list[str], tmp: Path) -> dict[str, Any]:
    """Run `argv` to its end: wall s, CPU s (user + sys) and peak RSS MiB of that process
    alone, exit code, stdout, stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160", "LINES": "50"}
    report = tmp / "time.txt"
    t0 = time.monotonic()
    done = subprocess.run(timed(argv, report), cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    rss, cpu = read_timed(report)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_mib": rss,
        "code": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


class Sampler:
    """The peak RSS of a process, sampled every `every_s` (its VmHWM covers its whole life)."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.pid, self.every_s, self.peak_kib = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak_kib = max(self.peak_kib, _status_kib(self.pid, "VmRSS"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kib


# ----------------------------------------------------------------------------- 1. rollout


def set_max_queued(broker: Any, queue: int) -> None:
    """mosquitto's `max_queued_messages` (0: no limit), and a restart to take it. With its
    default (1,000) mosquitto 2 drops what a client has not taken past it: the operator's
    tools subscribed to every device's retained state and health lose devices at 10,000."""
    with open(broker.conf, "a") as conf:
        conf.write(f"max_queued_messages {queue}\n")
    broker.restart()


def bench_rollout(tmp: Path, n: int, processes: int) -> dict[str, Any]:
    from tests.support.broker import Mosquitto
    from tests.support.fleetsim import FleetShards, SimDevice, SimModels, raise_nofile, scratch_root

    nofile = raise_nofile(n + 1024)  # mosquitto inherits it: one descriptor per client
    if nofile < n + 64:
        raise RuntimeError(f"RLIMIT_NOFILE {nofile}: mosquitto cannot hold {n} clients")
    broker = Mosquitto(tmp / "broker")
    set_max_queued(broker, 0)  # as a broker for a fleet this size needs (docs/FLEET.md)
    try:
        with scratch_root(tmp / "fleet") as root:
            models = SimModels.create(tmp / "models")
            bundle = models.bundle(tmp / "u1.tar", version=1)
            config = tmp / "agent.toml"
            config.write_text("")
            devices = [SimDevice(f"dev-{i:05d}") for i in range(n)]
            sim = FleetShards(
                broker.url, root, devices, processes=processes, trusted_keys_dir=models.trusted,
                shipped=models.shipped, health_interval_s=30.0, tick_s=SIM_TICK_S,
            )  # fmt: skip
            with sim:
                time.sleep(5)  # the births and first health are in; the broker is idle
                bpid = broker.proc.pid  # type: ignore[union-attr]
                idle_rss = _status_kib(bpid, "VmRSS")
                sim_idle_rss = sum(_status_kib(p, "VmRSS") for p in sim.pids)
                c0 = sum(_cpu_s(p) for p in sim.pids)
                time.sleep(5)
                sim_idle_cpu = (sum(_cpu_s(p) for p in sim.pids) - c0) / 5
                threads = sim.threads()
                argv = [
                    sys.executable, "-m", "agent", "fleet", "rollout", "start", str(bundle),
                    "--target", "all", "--waves", "1%,10%,50%,100%", "--soak", "1s",
                    "--wave-timeout", "1800s", "--id", "bench", "--json",
                    "--broker", broker.url, "--config", str(config),
                    "--rollouts-dir", str(tmp / "rollouts"),
                ]  # fmt: skip
                sampler = Sampler(bpid)
                sim_peak = [Sampler(p) for p in sim.pids]
                b0, t0 = _cpu_s(bpid), time.monotonic()
                s0 = sum(_cpu_s(p) for p in sim.pids)
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                out_path = tmp / "report.json"
                with open(out_path, "w") as out, open(tmp / "rollout.err", "w") as err:
                    proc = subprocess.run(
                        timed(argv, tmp / "time.txt"), cwd=ROOT, env=env, stdout=out, stderr=err
                    )
                op_rss, op_cpu = read_timed(tmp / "time.txt")
                wall = time.monotonic() - t0
                broker_cpu = _cpu_s(bpid) - b0
                sim_cpu = sum(_cpu_s(p) for p in sim.pids) - s0
                broker_peak = max(sampler.stop(), _status_kib(bpid, "VmRSS"))
                sim_peak_kib = sum(s.stop() for s in sim_peak)
                if proc.returncode != 0:
                    why = (tmp / "rollout.err").read_text()[-2000:]
                    raise RuntimeError(f"rollout exited {proc.returncode}: {why}")
                rep = json.loads(out_path.read_text())
                phases, offers = sim.phases(), sim.offer_counts()
                result = {
                    "devices": n,
                    "processes": len(sim.pids),
                    "start_s": sim.started_s,
                    "rollout_wall_s": wall,
                    "operator_cpu_s": op_cpu,
                    "operator_peak_rss_mib": op_rss,
                    "state_db_mib": _mib(
                        sum(f.stat().st_size for f in (tmp / "rollouts").glob("rollouts.db*"))
                        / 1024
                    ),
                    "broker_idle_rss_mib": _mib(idle_rss),
                    "broker_peak_rss_mib_sampled": _mib(broker_peak),
                    "broker_hwm_mib": _mib(_status_kib(bpid, "VmHWM")),
                    "broker_cpu_s": broker_cpu,
                    "sim_idle_rss_mib": _mib(sim_idle_rss),
                    "sim_peak_rss_mib": _mib(sim_peak_kib),
                    "sim_threads": threads,
                    "sim_idle_cpu_cores": sim_idle_cpu,
                    "sim_cpu_s": sim_cpu,
                    "state": rep["state"],
                    "committed": rep["committed"],
                    "committed_seen_by_sim": sum(p == "committed" for p in phases.values()),
                    "offered_once": sum(c == 1 for c in offers.values()),
                    "waves": [
                        {
                            k: w[k]
                            for k in (
                                "wave",
                                "percent",
                                "offered",
                                "committed",
                                "failed",
                                "failed_by_reason",
                                "duration_s",
                            )
                        }
                        for w in rep["waves"]
                    ],
                }
    finally:
        broker.stop()
    return result


# ----------------------------------------------------------------------------- 1b. the rules alone

PHASES = ("RECEIVED", "DOWNLOADING", "VERIFIED", "STAGED", "ACTIVATING", "TRIAL", "COMMITTED")


def rules_run(n: int, store_dir: Path) -> dict[str, Any]:
    """The operator's driver loop without broker or devices, in this process: `n` online
    devices, each offered one reporting the 7 phases of an update one tick (0.2 simulated s)
    after another, applied once a tick (`plan.learn_all`); `plan.step` every tick, a save
    before each offer and at most once a simulated second otherwise, as
    agent/operator/rollout/run.py does. CPU s, peak RSS."""
    import resource

    from agent.operator.rollout import plan
    from agent.operator.rollout.state import Spec, State, Target
    from agent.operator.rollout.store import RolloutStore

    now = 1_800_000_000.0
    spec = Spec("bench", "u-1", "/b.tar", "m", "1.1.0", "ab" * 32, Target("all"),
                (0.01, 0.1, 0.5, 1.0), 1, 0.05, 1800.0, 1.0, PREFIX, now)  # fmt: skip
    seen = {f"dev-{i:05d}": plan.Seen(f"dev-{i:05d}", "online") for i in range(n)}
    store = RolloutStore(store_dir)
    r = plan.create(spec, now)
    store.create(r)
    progress: dict[str, int] = {}
    heard = saves = ticks = 0
    saved_at = now
    c0, t0 = time.process_time(), time.monotonic()
    while r.state == State.RUNNING:
        now += 0.2
        ticks += 1
        batch = []  # the tick's statuses, applied at once as the driver does
        for d, k in list(progress.items()):
            batch.append((d, plan.Heard("u-1", PHASES[k], "", "", now, live=True)))
            heard += 1
            if k + 1 == len(PHASES):
                del progress[d]
            else:
                progress[d] = k + 1
        r = plan.learn_all(r, batch, now)
        before = r
        r, offers = plan.step(r, seen, now)
        if offers or r.wave != before.wave or r.state != before.state or now - saved_at >= 1:
            store.save(r)
            saves, saved_at = saves + 1, now
        progress.update(dict.fromkeys(offers, 0))
    store.close()
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    db = sum(f.stat().st_size for f in store_dir.glob("rollouts.db*"))
    return {
        "devices": n, "state": r.state.value, "statuses": heard, "ticks": ticks, "saves": saves,
        "cpu_s": cpu, "wall_s": wall, "cpu_per_status_ms": 1000 * cpu / max(1, heard),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "db_mib": _mib(db / 1024),
    }  # fmt: skip


def bench_rules(tmp: Path, n: int) -> dict[str, Any]:
    """`rules_run` in a process of its own (its peak RSS is its own)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--rules-run", str(n), str(tmp)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- 2. watch, inventory


def publish_fleet(broker: Any, n: int) -> float:
    """Retained state and health of `n` devices, from one client; the seconds it took."""
    from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
    from agent.pb.edge_agent.v1 import agent_pb2

    publisher: Any = importlib.import_module("tests.unit.operator.test_fleet_operator").Publisher

    now = time.time()
    sha = "ab" * 32
    t0 = time.monotonic()
    with publisher(broker) as pub:
        for i in range(n):
            dev = f"dev-{i:05d}"
            group = f"site-{i % 20:02d}"
            kind = pb.DeviceState.LOST if i % 97 == 0 else pb.DeviceState.ONLINE
            state = pb.DeviceState(
                state=kind, session=3, device_id=dev, agent_version="0.9.0",
                profile="raspberry-pi-5", model="tiny 1.0 int8", model_sha256=sha,
                timestamp_unix=now - 600, group=group, tags=["bench", f"rack-{i % 7}"],
                arch="aarch64",
            )  # fmt: skip
            health = pb.Health(
                seq=9, session=3, device_id=dev, timestamp_unix=now - 5, agent_state="serving",
                agent_version="0.9.0", profile="raspberry-pi-5",
                model=pb.ModelRef(name="tiny", version="1.0", quantization="int8", sha256=sha),
                accelerator="cpu", uptime_s=3600,
                memory=pb.Memory(rss_bytes=300 * MIB, budget_bytes=512 * MIB),
                requests=pb.Requests(
                    total=1200, failed=int(i % 50 == 0),
                    ttft_ms=agent_pb2.Percentiles(p50=85.0, p95=140.0),
                    decode_tok_s=agent_pb2.Percentiles(p50=12.5, p95=10.0),
                ),
                thermal=pb.Thermal(max_celsius=55.0 + i % 30, throttled_known=True),
                disk=pb.Disk(path="/var/lib/edge-agent", free_bytes=2 << 30, total_bytes=8 << 30),
                group=group, tags=["bench", f"rack-{i % 7}"], arch="aarch64",
            )  # fmt: skip
            topic = f"{PREFIX}/{dev}"
            pub.publish(f"{topic}/state", state.SerializeToString(), state.DESCRIPTOR.full_name)
            pub.publish(f"{topic}/health", health.SerializeToString(), health.DESCRIPTOR.full_name)
            if len(pub.pending) >= 2000:
                pub.flush()
        pub.flush()
    return time.monotonic() - t0


def redraw_ms(url: str, rounds: int) -> dict[str, float]:
    """The live `watch`'s cost per redraw at this size, in this process: the table of a
    160x40 terminal (`render`, sorting every device) and the inventory's rows, median ms."""
    from agent.config.file import parse_broker
    from agent.fleet.mqtt import MqttOptions
    from agent.operator.client import watch
    from agent.operator.inventory import inventory
    from agent.operator.render import render

    opts = MqttOptions(broker=parse_broker("bench", "broker", url))
    view = watch(opts, PREFIX, once=True, settle_s=1.0, timeout_s=60.0, out=None)
    now = time.time()
    timings: dict[str, list[float]] = {"render 40 rows": [], "inventory rows": []}
    for _ in range(max(rounds, 5)):
        t0 = time.perf_counter()
        render(view, now, 160, max_rows=40)
        timings["render 40 rows"].append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        inventory(view)
        timings["inventory rows"].append((time.perf_counter() - t0) * 1000)
    return {k: statistics.median(v) for k, v in timings.items()}


def bench_inventory(
    tmp: Path, n: int, rounds: int, settle_s: float = 0.0, queue: int = -1
) -> dict[str, Any]:
    from tests.support.broker import Mosquitto

    broker = Mosquitto(tmp / "broker")
    if queue >= 0:
        set_max_queued(broker, queue)
    try:
        publish_s = publish_fleet(broker, n)
        bpid = broker.proc.pid  # type: ignore[union-attr]
        config = tmp / "agent.toml"
        config.write_text("")
        conn = ["--broker", broker.url, "--config", str(config)]
        if settle_s:  # at 50,000 under load a 1 s gap in the retained burst ended it early
            conn += ["--settle", str(settle_s), "--timeout", "300"]
        py = [sys.executable, "-m", "agent", "fleet"]
        commands = {
            "watch --once": [*py, "watch", "--once", *conn],
            "watch --once --json": [*py, "watch", "--once", "--json", *conn],
            "watch --once --group site-03": [*py, "watch", "--once", "--group", "site-03", *conn],
            "inventory": [*py, "inventory", *conn],
            "inventory --json": [*py, "inventory", "--json", *conn],
            "start-up (watch --help)": [*py, "watch", "--help"],
        }
        out: dict[str, Any] = {
            "redraw_ms": redraw_ms(broker.url, rounds),
            "devices": n,
            "settle_s": settle_s or 1.0,
            "max_queued_messages": queue,
            "messages": 2 * n,
            "publish_s": publish_s,
            "broker_rss_mib": _mib(_status_kib(bpid, "VmRSS")),
            "commands": {},
        }
        for name, argv in commands.items():
            runs = []
            for _ in range(rounds):
                r = run_measured(argv, tmp)
                if r["code"] != 0:
                    raise RuntimeError(f"{name} exited {r['code']}: {r['stderr'][-1000:]}")
                if "--json" in argv:
                    rows = len(json.loads(r["stdout"]))
                    want = n // 20 if "--group" in argv else n
                    if rows != want:
                        dropped = broker.read_log().count("messages are being dropped")
                        raise RuntimeError(
                            f"{name}: {rows} rows, expected {want} (mosquitto: {dropped} "
                            "'messages are being dropped' lines)"
                        )
                runs.append(r)
            out["commands"][name] = {
                k: statistics.median(r[k] for r in runs)
                for k in ("wall_s", "cpu_s", "peak_rss_mib")
            } | {"output_bytes": len(runs[0]["stdout"])}
    finally:
        broker.stop()
    return out


# ----------------------------------------------------------------------------- report


def body(data: dict[str, Any]) -> str:
    rolls, invs, rules = data["rollouts"], data["inventory"], data.get("rules", [])
    lines = [
        "## Fleet at scale (rollouts, the operator's rules to 50,000 devices, 50,000 retained)",
        "",
        f"`benchmarks/bench_fleet.py`, {data['machine']}, one mosquitto on loopback. The devices",
        "are tests/support/fleetsim.py's: each the real fleet link and the real update machine",
        "(signatures, MQTT block download, delta patching, store on tmpfs) against a stub",
        "engine, 1,000 devices per simulator process (`FleetShards`); the operator is `edge-agent",
        "fleet rollout start --target all --waves 1%,10%,50%,100% --soak 1s` as its own process,",
        "its state in SQLite (WAL, a row per device; docs/ROLLOUTS.md). Trial 1 s, health every",
        "30 s. The simulator shares the machine's cores with the operator and the broker.",
        "",
    ]
    if rolls:
        lines += [
            "| devices | sim processes | rollout wall | waves (s) | operator CPU | operator peak "
            "RSS | state db | mosquitto CPU | mosquitto peak RSS | simulator CPU | simulator "
            "peak RSS |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rolls:
            waves = " / ".join(f"{w['duration_s']:.0f}" for w in r["waves"])
            lines.append(
                f"| {r['devices']:,} ({r['state']}, {r['committed']:,} committed, "
                f"{r['offered_once']:,} offered once) | {r['processes']} "
                f"| {r['rollout_wall_s']:.0f} s | {waves} | {r['operator_cpu_s']:.1f} s "
                f"| {r['operator_peak_rss_mib']:.0f} MiB | {r['state_db_mib']:.1f} MiB "
                f"| {r['broker_cpu_s']:.1f} s | {r['broker_hwm_mib']:.0f} MiB "
                f"| {r['sim_cpu_s']:.0f} s | {r['sim_peak_rss_mib']:.0f} MiB |"
            )
        lines.append("")
    lines += [*data.get("notes", []), ""] if data.get("notes") else []
    if rules:
        lines += [
            "**The operator's rules and state store alone** (`--rules`; no broker, no devices,",
            "in one process: every device online, each offered one reporting the 7 phases of",
            "an update one 0.2 s tick after another, a tick's statuses applied at once",
            "(`plan.learn_all`), `plan.step` every tick, the state saved before each offer and",
            "at most once a second otherwise, as the running rollout does). What the",
            "operator's CPU grows with, apart from MQTT:",
            "",
            "| devices | statuses heard | CPU, whole rollout | per status heard | peak RSS "
            "| state db |",
            "|---|---|---|---|---|---|",
        ]
        for x in rules:
            lines.append(
                f"| {x['devices']:,} | {x['statuses']:,} | {x['cpu_s']:.1f} s "
                f"| {x['cpu_per_status_ms']:.3f} ms | {x['peak_rss_mib']:.0f} MiB "
                f"| {x['db_mib']:.1f} MiB |"
            )
        lines.append("")
    lines += [
        "Limits met on the way to 10,000: paho waits with select(), which fails past ~330",
        "clients a process (FD_SETSIZE 1024, three descriptors a client; the simulator patches",
        "in poll()); mosquitto takes one descriptor per client and has no connection limit by",
        "default (`max_connections -1`), so its RLIMIT_NOFILE is the limit: the benchmark",
        "raises the soft limit to the device count + 1,024 before starting it (the hard limit",
        "here is 20,000).",
        "",
    ]
    if invs:
        lines += [
            "**`fleet watch` and `fleet inventory`** against retained devices (a retained",
            "`state` and `health` each, published by one client; no agents). Each command as",
            "its own process, median of the rounds; the `--once` commands wait for 1 s without",
            "a retained message (`--settle`, the default) before they print.",
            "",
            "| command | "
            + " | ".join(f"{i['devices']:,} devices: wall / CPU / peak RSS" for i in invs)
            + " |",
            "|---|" + "---|" * len(invs),
        ]
        for name in invs[0]["commands"]:
            cells = []
            for i in invs:
                c = i["commands"][name]
                cells.append(
                    f"{c['wall_s']:.2f} s / {c['cpu_s']:.2f} s / {c['peak_rss_mib']:.0f} MiB"
                )
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Publishing took "
            + ", ".join(f"{i['publish_s']:.0f} s for {i['devices']:,}" for i in invs)
            + "; mosquitto then held "
            + ", ".join(f"{i['broker_rss_mib']:.0f} MiB" for i in invs)
            + ". One redraw of the live `fleet watch` (160x40, every device sorted) takes "
            + ", ".join(f"{i['redraw_ms']['render 40 rows']:.0f} ms" for i in invs)
            + ", the inventory's rows "
            + ", ".join(f"{i['redraw_ms']['inventory rows']:.0f} ms" for i in invs)
            + " (in-process, median).",
            *data.get("inventory_notes", []),
        ]
    return "\n".join(lines).rstrip("\n")


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--devices", default="1000,3000,10000", help="rollout sizes, comma-separated")
    ap.add_argument("--processes", type=int, default=0, help="simulator processes (0: n/1000)")
    ap.add_argument("--inventory-devices", default="10000,50000")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each watch/inventory command")
    ap.add_argument("--settle", type=float, default=0.0, help="--settle S for watch/inventory")
    ap.add_argument("--max-queued", type=int, default=-1, help="mosquitto's max_queued_messages")
    ap.add_argument("--rules", default="1000,10000,50000", help="sizes of the rules-alone run")
    ap.add_argument("--rules-run", nargs=2, metavar=("N", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--save", metavar="JSON", help="also write the results here")
    ap.add_argument("--load", metavar="JSON", help="write the section from saved results only")
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch docs/")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    machine = f"{os.cpu_count()} cores {platform.machine()}, Python {platform.python_version()}"
    if args.rules_run:
        print(json.dumps(rules_run(int(args.rules_run[0]), Path(args.rules_run[1]))))
        return
    if args.load:
        data = json.loads(Path(args.load).read_text())
    else:
        data = {"machine": machine, "rollouts": [], "inventory": [], "rules": []}
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as d:
            tmp = Path(d)
            for n in _sizes(args.rules):
                rules = bench_rules(tmp / f"rules-{n}", n)
                print(json.dumps(rules), flush=True)
                data["rules"].append(rules)
            for n in _sizes(args.devices):
                roll = bench_rollout(tmp / f"rollout-{n}", n, args.processes)
                print(json.dumps(roll, indent=2), flush=True)
                data["rollouts"].append(roll)
            for n in _sizes(args.inventory_devices):
                inv = bench_inventory(
                    tmp / f"inventory-{n}", n, args.rounds, args.settle, args.max_queued
                )
                print(json.dumps(inv, indent=2), flush=True)
                data["inventory"].append(inv)
        if args.save:
            Path(args.save).write_text(json.dumps(data, indent=2) + "\n")
    text = body(data)
    print(text)
    if not args.no_write:
        write_section("fleet", data, text)


if __name__ == "__main__":
    main()
