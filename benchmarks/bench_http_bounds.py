#!/usr/bin/env python3
"""The HTTP listener's bounds (docs/API.md "HTTP limits"), measured on a real `edge-agent run`
with the demo model.

* Slow clients held: N connections that never finish a request (a third send nothing, a third
  half a head, a third a head and half a body) against the default limit of 64 with deadlines
  far away, so that only eviction protects the listener; then `/health` over HTTP and gRPC's
  health check, timed, while all N are still open; the daemon's open descriptors and RSS.
* Deadlines: how long a connection that sends nothing stays open with `header_timeout_s = 1`.
* Refusal: with every connection busy (`max_connections = 4`, four requests held at the
  fault-injection gate), how long a new connection waits for its 503.
* A 1 MB chat message: how long its request takes (render + tokenize, then refused: it is far
  over the context), and the slowest `/health` answered meanwhile.

Writes docs/bench/http-bounds.json and a section of docs/PERFORMANCE.md.

    python benchmarks/bench_http_bounds.py [--profile NAME] [--rounds 5] [--no-write]
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from agent.api.http.faults import GATE_ENV  # noqa: E402
from agent.model.directory import demo_model_dir  # noqa: E402
from benchmarks._report import bench_args, fmt, med, write_section  # noqa: E402
from tests.support.daemon_harness import Daemon  # noqa: E402

BASE = "[watchdog]\ntick_s = 0.2\n"


def _sock(d: Daemon) -> str:
    return str(d.socket.with_name("agent-http.sock"))


def _health_s(d: Daemon) -> float:
    with httpx.Client(transport=httpx.HTTPTransport(uds=_sock(d)), timeout=120) as c:
        t = time.perf_counter()
        assert c.get("http://localhost/health").status_code == 200
        return time.perf_counter() - t


def _grpc_health_s(d: Daemon) -> float:
    client = d.client(timeout=120)
    t = time.perf_counter()
    assert client.health() == "SERVING"
    return time.perf_counter() - t


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _metric(d: Daemon, name: str) -> float:
    with httpx.Client(transport=httpx.HTTPTransport(uds=_sock(d)), timeout=120) as c:
        text = c.get("http://localhost/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def slow_clients(tmp: Path, model: Path, profile: str, n: int, rounds: int) -> dict[str, Any]:
    config = BASE + "[http]\nheader_timeout_s = 3600\nbody_timeout_s = 3600\n"
    (tmp / f"slow{n}").mkdir()
    d = Daemon(tmp / f"slow{n}", model, config, profile=profile)
    held: list[socket.socket] = []
    try:
        idle_fds, idle_rss = _fds(d.proc.pid), _rss_mib(d.proc.pid)
        t0 = time.perf_counter()
        for i in range(n):
            s = socket.socket(socket.AF_UNIX)
            s.connect(_sock(d))
            if i % 3 == 1:
                s.sendall(b"GET /health HTTP/1.1\r\nHo")
            elif i % 3 == 2:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: 100\r\n\r\n{"
                )
            held.append(s)
        opened_s = time.perf_counter() - t0
        health = [_health_s(d) for _ in range(rounds * 4)]
        grpc_health = [_grpc_health_s(d) for _ in range(rounds * 4)]
        return {
            "connections": n,
            "open_s": opened_s,
            "health_s": med(health),
            "grpc_health_s": med(grpc_health),
            "fds_idle": idle_fds,
            "fds_held": _fds(d.proc.pid),
            "rss_idle_mib": idle_rss,
            "rss_held_mib": _rss_mib(d.proc.pid),
            "evicted": _metric(d, 'edge_agent_http_connections_dropped_total{reason="evicted"}'),
        }
    finally:
        for s in held:
            s.close()
        d.stop()


def deadline(tmp: Path, model: Path, profile: str, rounds: int) -> dict[str, Any]:
    (tmp / "deadline").mkdir()
    d = Daemon(tmp / "deadline", model, BASE + "[http]\nheader_timeout_s = 1\n", profile=profile)
    try:
        held = []
        for _ in range(rounds * 4):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(60)
            s.connect(_sock(d))
            t = time.perf_counter()
            assert s.recv(1) == b""
            held.append(time.perf_counter() - t)
            s.close()
        return {"silent_closed_after_s": med(held)}
    finally:
        d.stop()


def refusal_and_tokenizing(tmp: Path, model: Path, profile: str, rounds: int) -> dict[str, Any]:
    folder = tmp / "gated"
    folder.mkdir()
    gate = folder / "gate"
    os.mkfifo(gate)
    config = BASE + "[http]\nmax_connections = 4\n"
    d = Daemon(folder, model, config, profile=profile, env={GATE_ENV: str(gate)})

    def release(threads: list[threading.Thread]) -> None:
        while any(t.is_alive() for t in threads):
            with contextlib.suppress(OSError):
                os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
            time.sleep(0.01)

    def post(body: dict[str, Any], out: list[Any]) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=_sock(d)), timeout=300) as c:
            t = time.perf_counter()
            r = c.post("http://localhost/v1/chat/completions", json=body)
            out.append((r.status_code, time.perf_counter() - t))

    try:
        msg = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        waits = d.read_log().count("submit waits at")
        held = [threading.Thread(target=post, args=(msg, [])) for _ in range(4)]
        for t in held:
            t.start()
        while d.read_log().count("submit waits at") < waits + 4:
            time.sleep(0.01)
        refused = []
        for _ in range(rounds * 4):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(60)
            t0 = time.perf_counter()
            s.connect(_sock(d))
            assert s.recv(4096).startswith(b"HTTP/1.1 503 ")
            refused.append(time.perf_counter() - t0)
            s.close()
        release(held)
        # a 1 MB message: the gate opens at once, then render + tokenize on a worker thread
        big: list[Any] = []
        health: list[float] = []
        for _ in range(rounds):
            out: list[Any] = []
            body = {"messages": [{"role": "user", "content": "x = 1 " * 174_000}], "max_tokens": 1}
            t = threading.Thread(target=post, args=(body, out))
            t.start()
            while t.is_alive():
                with contextlib.suppress(OSError):
                    os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
                health.append(_health_s(d))
            t.join()
            big.append(out[0][1])
            assert out[0][0] == 400, out
        return {
            "refusal_s": med(refused),
            "big_message_s": med(big),
            "health_during_s": med(health),
            "health_samples": len(health),
        }
    finally:
        d.stop()


def main() -> int:
    args = bench_args(__doc__)
    model = Path(args.model) if args.model else demo_model_dir()
    profile = args.profile or "generic-x86_64"
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        slow = [slow_clients(tmp, model, profile, n, args.rounds) for n in (100, 500)]
        dl = deadline(tmp, model, profile, args.rounds)
        gated = refusal_and_tokenizing(tmp, model, profile, args.rounds)
    data = {"slow": slow, "deadline": dl, "gated": gated, "machine": platform.machine()}
    ms = 1000.0
    rows = [
        f"| {s['connections']} | {s['open_s'] * ms:.0f} | {s['evicted']:.0f} | "
        f"{s['fds_idle']} → {s['fds_held']} | {s['rss_idle_mib']:.0f} → {s['rss_held_mib']:.0f} | "
        f"{fmt({k: v * ms for k, v in s['health_s'].items()}, 1)} | "
        f"{fmt({k: v * ms for k, v in s['grpc_health_s'].items()}, 1)} |"
        for s in slow
    ]
    body = "\n".join(
        [
            "## HTTP limits (issue 32 item 3)",
            "",
            f"Measured by `benchmarks/bench_http_bounds.py` on {platform.machine()}, Python "
            f"{platform.python_version()}, the demo model, a real `edge-agent run` (default "
            "`[http]` limits unless said). Times in ms, median (min–max).",
            "",
            "Slow clients that never finish a request (a third silent, a third half a head, a "
            "third half a body), all held open while `/health` and gRPC's health are asked "
            f"{args.rounds * 4} times each; deadlines set far away, so only the limit (64) and "
            "eviction of the longest-waiting connection protect the listener:",
            "",
            "| slow connections | time to open them | evicted | daemon fds (idle → held) | "
            "RSS MiB (idle → held) | HTTP /health | gRPC health |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            "| what | time |",
            "| --- | ---: |",
            "| a silent connection closed (`header_timeout_s = 1`) | "
            f"{fmt({k: v * ms for k, v in dl['silent_closed_after_s'].items()}, 0)} |",
            "| a new connection's 503 with every connection busy (`max_connections = 4`) | "
            f"{fmt({k: v * ms for k, v in gated['refusal_s'].items()}, 2)} |",
            "| a 1 MB chat message: render + tokenize off the loop, then refused (context) | "
            f"{fmt({k: v * ms for k, v in gated['big_message_s'].items()}, 0)} |",
            f"| `/health` meanwhile ({gated['health_samples']} answered) | "
            f"{fmt({k: v * ms for k, v in gated['health_during_s'].items()}, 1)} |",
        ]
    )
    print(body)
    if not args.no_write:
        write_section("http-bounds", data, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
