#!/usr/bin/env python3
"""Per-client quotas and fairness (docs/API.md "Quotas per client"), measured.

* A real `edge-agent run` (the demo model, `--profile` or detected, default limits) and real
  gRPC clients with their own keys: one key calls CreateSession 300 times (the attack the
  quotas answer: it used to succeed 300 times in ~0.3 s and end every other key's session);
  how many succeed, what each refusal costs, and whether another key's session still continues.
* The same daemon with `max_active = 1`: one key starts 50 generations at once, then another
  key one; how many of the first key's requests finished between the second key's arrival and
  its end (FIFO admission: all of them; round-robin over clients: the one running, at most).
* The pure policies: a submit + admission + finish through `Scheduler` with a full queue of
  4,096 from 1 to 256 clients, and one `fair_victims` call over 64 to 4,096 sessions.

Writes docs/bench/client-quotas.json and a section of docs/PERFORMANCE.md.

    python benchmarks/bench_quotas.py [--profile NAME] [--rounds 5] [--no-write]
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from agent.api.grpc.client import Client, build_request  # noqa: E402
from agent.engine.scheduler import Scheduler  # noqa: E402
from agent.kv.quota import Holding, fair_victims  # noqa: E402
from agent.model.directory import demo_model_dir  # noqa: E402
from benchmarks._report import bench_args, fmt, med, write_section  # noqa: E402
from tests.support.daemon_harness import Daemon  # noqa: E402


def req(prompt: str, n: int, session: str | None = None):  # type: ignore[no-untyped-def]
    return build_request(
        prompt,
        None,
        max_tokens=n,
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=None,
        stop=(),
        session=session,
    )


def session_attack(d: Daemon) -> dict[str, Any]:
    bob = Client(str(d.socket), timeout=60, client_key="bench-bob")
    mallory = Client(str(d.socket), timeout=60, client_key="bench-mallory")
    sid = bob.create_session()
    bob.generate(req("def f(x):", 8, sid))
    made, refused, refusal_s = 0, 0, []
    t0 = time.perf_counter()
    for _ in range(300):
        t = time.perf_counter()
        try:
            mallory.create_session()
            made += 1
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            refused += 1
            refusal_s.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    after = bob.generate(req("\n", 8, sid))
    for s in mallory.list_sessions():
        mallory.delete_session(s.id)
    bob.delete_session(sid)
    return {
        "created": made,
        "refused": refused,
        "total_s": total,
        "refusal_ms": med([x * 1000 for x in refusal_s]),
        "other_key_continues": after.finish_reason in ("length", "stop"),
    }


def queue_fairness(d: Daemon) -> dict[str, Any]:
    a = Client(str(d.socket), timeout=300, client_key="bench-a")
    b = Client(str(d.socket), timeout=300, client_key="bench-b")
    done: list[str] = []
    lock = threading.Lock()

    def run(c: Client, name: str) -> None:
        c.generate(req("def f(x):", 16))
        with lock:
            done.append(name)

    threads = [threading.Thread(target=run, args=(a, f"a{i}")) for i in range(50)]
    for t in threads:
        t.start()
    while int(a.status().get("queue_depth", 0)) < 40:  # most of a's are queued
        time.sleep(0.01)
    with lock:
        before = len(done)  # a's that ended before b's request was even sent
    tb = threading.Thread(target=run, args=(b, "b"))
    tb.start()
    for t in (*threads, tb):
        t.join()
    return {"a_before_b": done.index("b") - before, "a_waiting": 50 - before}


def scheduler_cost(clients: int, rounds: int) -> dict[str, float]:
    """µs for one submit + admit + finish with a full 4,096 queue from `clients` clients."""
    times = []
    for _ in range(rounds):
        s: Scheduler[tuple[int, int]] = Scheduler(
            1, 4096, client=lambda x: str(x[0]), per_client=4096
        )
        for i in range(4095):
            s.submit((i % clients, i))
        n = 2000
        t = time.perf_counter()
        for i in range(n):
            s.submit((i % clients, 10_000 + i))
            (item,) = s.admit()
            s.finish(item)
        times.append((time.perf_counter() - t) / n * 1e6)
    return med(times)


def victims_cost(sessions: int, owners: int, rounds: int) -> dict[str, float]:
    """µs for one fair_victims call on a full store of `sessions` entries."""
    held = [Holding(f"s{i}", f"o{i % owners}", 1) for i in range(sessions)]
    times = []
    for _ in range(rounds):
        n = max(10, 20_000 // sessions)
        t = time.perf_counter()
        for _ in range(n):
            fair_victims(held, "new", 1, sessions)
        times.append((time.perf_counter() - t) / n * 1e6)
    return med(times)


def table(r: dict[str, Any]) -> str:
    a, q = r["attack"], r["queue"]
    lines = [
        "## Client quotas",
        "",
        f"`benchmarks/bench_quotas.py` on {r['machine']} (profile `{r['profile']}`, demo model, "
        'default limits: `max_sessions` 8, `queue_capacity` 16). docs/API.md "Quotas per '
        'client" says what is enforced.',
        "",
        "| what | result |",
        "|---|---|",
        f"| one key calls CreateSession 300 times | {a['created']} created, {a['refused']} "
        f"refused (`RESOURCE_EXHAUSTED` naming `quotas.sessions_per_client`) in "
        f"{a['total_s']:.2f} s; a refusal takes {fmt(a['refusal_ms'], 2)} ms |",
        f"| another key's session, made before, continues | "
        f"{'yes' if a['other_key_continues'] else 'NO'} (it was `DATA_LOSS` after 8) |",
        f"| `max_active = 1`: one key has {q['a_waiting']} generations queued or running, then "
        f"another key sends one; the first key's requests that finished between its arrival "
        f"and its end | {q['a_before_b']} (FIFO admission: all {q['a_waiting']}) |",
    ]
    for k, v in r["scheduler_us"].items():
        lines.append(
            f"| `Scheduler` submit + admit + finish, 4,096 waiting from {k} clients | "
            f"{fmt(v, 1)} µs |"
        )
    for k, v in r["victims_us"].items():
        lines.append(f"| `fair_victims` over {k} | {fmt(v, 1)} µs |")
    lines += [
        "",
        "Medians (min–max) of the rounds. The pure policies are Python on the engine thread,",
        "under its lock: an admission or an eviction costs this once per request or session.",
    ]
    return "\n".join(lines)


def start(folder: Path, model: Path, config: str, profile: str | None) -> Daemon:
    folder.mkdir(parents=True)
    return Daemon(folder, model, config, profile=profile or "generic-x86_64")


def main() -> None:
    args = bench_args(__doc__)
    model = Path(args.model) if args.model else demo_model_dir()
    cores = len(os.sched_getaffinity(0))
    r: dict[str, Any] = {"machine": f"{platform.machine()}, {cores} cores"}
    with tempfile.TemporaryDirectory() as tmp:
        d = start(Path(tmp) / "attack", model, "", args.profile)
        try:
            r["profile"] = d.client().status().get("profile", "?")
            r["attack"] = session_attack(d)
        finally:
            d.stop()
        config = (
            "[limits]\nmax_active = 1\nqueue_capacity = 64\n[quotas]\nwaiting_per_client = 60\n"
        )
        d = start(Path(tmp) / "queue", model, config, args.profile)
        try:
            r["queue"] = queue_fairness(d)
        finally:
            d.stop()
    r["scheduler_us"] = {c: scheduler_cost(c, args.rounds) for c in (1, 16, 256)}
    r["victims_us"] = {
        f"{n} sessions of {o} clients": victims_cost(n, o, args.rounds)
        for n, o in ((64, 8), (4096, 16), (4096, 256))
    }
    body = table(r)
    print(body)
    if not args.no_write:
        write_section("client-quotas", r, body)


if __name__ == "__main__":
    main()
