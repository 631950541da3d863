#!/usr/bin/env python3
"""Daemon benchmark: the gRPC path against in-process, concurrency and fairness, idle cost.

Starts a real `edge-agent run` on a temporary unix socket (demo model, detected profile
unless --profile), then measures, alternating where it compares:

* decode tokens/s seen by the client through gRPC vs by an in-process `Engine.generate`
  consumer on the same model, variant, prompt and seed; time to first token both ways;
* 1, 2, 4 and 8 concurrent clients: aggregate tokens/s, per-client tokens/s and Jain's
  fairness index over the per-client rates;
* start-up time to READY=1, and the idle daemon's RSS and CPU over 10 s.

Writes docs/bench/daemon.json and a section of docs/PERFORMANCE.md.

    python benchmarks/bench_daemon.py [--profile NAME] [--model DIR] [--rounds 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.api.grpc.client import Client, build_request  # noqa: E402
from agent.engine.engine import Engine  # noqa: E402
from agent.engine.sampler import SamplingParams  # noqa: E402
from agent.engine.types import GenerateRequest  # noqa: E402
from agent.model.directory import demo_model_dir  # noqa: E402
from agent.profile import resolve_profile  # noqa: E402
from benchmarks._report import bench_args, fmt, med, section_name, write_section  # noqa: E402
from tests.support.daemon_harness import Daemon  # noqa: E402

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 0.0


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(stream: Iterable[Any]) -> tuple[float, float, int]:
    """Consumer-side (time to first token ms, decode tok/s after it, tokens) of a stream of
    messages or events that carry `token_ids`."""
    t0 = time.perf_counter()
    first = last = 0.0
    n = first_n = 0
    for msg in stream:
        if msg.token_ids:
            last = time.perf_counter()
            if not n:
                first, first_n = last, len(msg.token_ids)
            n += len(msg.token_ids)
    rate = (n - first_n) / (last - first) if last > first else 0.0
    return (first - t0) * 1e3, rate, n


def grpc_run(sock: str, tokens: int, seed: int) -> tuple[float, float, int]:
    """One request streamed through the daemon's socket, measured at the client."""
    c = Client(sock, timeout=300)
    req = build_request(
        PROMPT, None, max_tokens=tokens, temperature=0.8, top_k=40, top_p=0.95, seed=seed, stop=[]
    )
    try:
        return measure(c.stream(req))
    finally:
        c.close()


def local_run(engine: Engine, tokens: int, seed: int) -> tuple[float, float, int]:
    """The same request streamed in-process through `Engine.generate`."""
    req = GenerateRequest(PROMPT, max_tokens=tokens, sampling=SamplingParams(0.8, 40, 0.95, seed))
    return measure(engine.generate(req))


def concurrent(sock: str, clients: int, tokens: int) -> dict[str, Any]:
    rates: list[float] = [0.0] * clients
    counts: list[int] = [0] * clients

    def one(i: int) -> None:
        _, rates[i], counts[i] = grpc_run(sock, tokens, 100 + i)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "clients": clients,
        "aggregate_tok_s": sum(counts) / wall,
        "per_client_tok_s": rates,
        "jain": jain(rates),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile, _ = resolve_profile(args.profile)
    model_dir = Path(args.model) if args.model else demo_model_dir()
    tmp = Path(tempfile.mkdtemp(prefix="edge-agent-bench-"))
    config = "[limits]\nmax_active = 8\nqueue_capacity = 16\n"
    t0 = time.perf_counter()
    d = Daemon(tmp, model_dir, config, profile=profile.name)
    startup_s = time.perf_counter() - t0
    try:
        pid = d.proc.pid
        time.sleep(2.0)
        cpu0, w0 = proc_cpu_s(pid), time.perf_counter()
        time.sleep(10.0)
        idle_cpu_pct = 100 * (proc_cpu_s(pid) - cpu0) / (time.perf_counter() - w0)
        idle_rss = proc_rss_mib(pid)
        sock = str(d.socket)
        engine = Engine.load(profile, model_dir)
        quant = engine.info.quantization
        engine_name = engine.info.name
        grpc_run(sock, 16, 0)  # warm-up both
        local_run(engine, 16, 0)
        g_ttft, g_rate, l_ttft, l_rate = [], [], [], []
        for r in range(args.rounds):
            t, rate, _ = local_run(engine, args.tokens, r)
            l_ttft.append(t)
            l_rate.append(rate)
            t, rate, _ = grpc_run(sock, args.tokens, r)
            g_ttft.append(t)
            g_rate.append(rate)
        engine.close()
        conc = [concurrent(sock, n, args.tokens) for n in (1, 2, 4, 8)]
        busy_rss = proc_rss_mib(pid)
    finally:
        d.stop()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "profile": profile.name,
        "threads": profile.runtime.num_threads,
        "model": f"{engine_name} ({model_dir.name})",
        "quantization": quant,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "args": f" --model {args.model}" if args.model else "",
        "startup_to_ready_s": startup_s,
        "ready_status": d.ready.get("STATUS", ""),
        "idle_cpu_pct": idle_cpu_pct,
        "idle_rss_mib": idle_rss,
        "rss_after_load_mib": busy_rss,
        "inprocess_tok_s": med(l_rate),
        "grpc_tok_s": med(g_rate),
        "grpc_vs_inprocess": statistics.median(g_rate) / statistics.median(l_rate),
        "inprocess_ttft_ms": med(l_ttft),
        "grpc_ttft_ms": med(g_ttft),
        "concurrency": conc,
    }


def table(r: dict[str, Any]) -> str:
    def f(d: dict[str, float], digits: int = 1) -> str:
        return fmt(d, digits)

    lines = [
        f"Measured {r['date']} on {r['machine']}, profile `{r['profile']}` ({r['threads']} "
        f"threads), model {r['model']} {r['quantization']}; client-side rates, median (min–max) of "
        f"{r['rounds']} alternating rounds of {r['tokens']} tokens. Command: "
        f"`python benchmarks/bench_daemon.py{r['args']}`.",
        "",
        "| path | decode tok/s | time to first token (ms) |",
        "|---|---|---|",
        f"| in-process `Engine.generate` | {f(r['inprocess_tok_s'])} | "
        f"{f(r['inprocess_ttft_ms'], 2)} |",
        f"| gRPC over the unix socket | {f(r['grpc_tok_s'])} | {f(r['grpc_ttft_ms'], 2)} |",
        "",
        f"gRPC / in-process decode speed: **{r['grpc_vs_inprocess']:.3f}x** (goal ≥ 0.95x).",
        "",
        "| concurrent clients | aggregate tok/s | per-client tok/s (min–max) | Jain's index |",
        "|---|---|---|---|",
    ]
    for c in r["concurrency"]:
        per = c["per_client_tok_s"]
        lines.append(
            f"| {c['clients']} | {c['aggregate_tok_s']:.0f} | {min(per):.0f}–{max(per):.0f} | "
            f"{c['jain']:.3f} |"
        )
    lines += [
        "",
        f"Start-up to READY=1 (process spawn, profile, sha256 check, model load, socket bind): "
        f"{r['startup_to_ready_s']:.2f} s. Idle daemon: {r['idle_cpu_pct']:.2f}% CPU over 10 s, "
        f"RSS {r['idle_rss_mib']:.0f} MiB (after the benchmark: "
        f"{r['rss_after_load_mib']:.0f} MiB).",
    ]
    return "\n".join(lines)


def main() -> None:
    args = bench_args(__doc__)
    r = run(args)
    print(json.dumps({k: v for k, v in r.items() if k != "concurrency"}, indent=1))
    for c in r["concurrency"]:
        print(c["clients"], f"{c['aggregate_tok_s']:.0f} tok/s, jain {c['jain']:.3f}")
    if not args.no_write:
        name = section_name("daemon", args)
        write_section(name, r, table(r))
        print(f"wrote docs/PERFORMANCE.md and docs/bench/{name}.json")


if __name__ == "__main__":
    main()
