#!/usr/bin/env python3
"""Several models in one daemon (`[models]`): what an unloaded model costs and what a load costs.

Starts a real `edge-agent run` on a temporary unix socket with two named models (the demo
model's int8 and int4_block32 variants, or `--model`'s), every one with `keep_alive = 0`, and
measures:

* the daemon's RSS once every model has unloaded (idle, nothing loaded), against its RSS at
  READY with the default model loaded;
* load-on-first-request latency: a 1-token greedy request to an unloaded model, from the call to
  its last message (the load, the prefill, one token), against the same request once loaded;
  the first load of each model in a fresh state directory (which prepares the model and packs
  its weights) apart from the later ones (which find them in the cache);
* the RSS a model's load adds and how much of it its unload returns (a request with
  `keep_alive = "0"`, then GetStatus until the model is unloaded).

Writes docs/bench/models.json and the `models` section of docs/PERFORMANCE.md.

    python benchmarks/bench_models.py [--profile NAME] [--model DIR] [--rounds 5]
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.api.grpc.client import Client, build_request  # noqa: E402
from agent.model.directory import demo_model_dir  # noqa: E402
from agent.pb.edge_agent.v1 import agent_pb2 as pb  # noqa: E402
from benchmarks._report import bench_args, fmt, med, section_name, write_section  # noqa: E402
from benchmarks.bench_daemon import proc_rss_mib  # noqa: E402
from tests.support.daemon_harness import Daemon  # noqa: E402

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def one_token(c: Client, model: str, keep_alive: str) -> float:
    """Seconds for a 1-token greedy request to `model`, from the call to its last message."""
    r = build_request(
        PROMPT, None, max_tokens=1, temperature=0.0, top_k=None, top_p=None, seed=None, stop=[]
    )
    r.model, r.keep_alive = model, keep_alive
    t0 = time.perf_counter()
    c.generate(r)
    return time.perf_counter() - t0


def models(c: Client) -> dict[str, Any]:
    return {m.name: m for m in c.stub.GetStatus(pb.GetStatusRequest()).models}


def wait_unloaded(c: Client, names: list[str]) -> None:
    """Until GetStatus says each of `names` is unloaded (an event; 120 s is only a limit)."""
    deadline = time.monotonic() + 120
    while any(models(c)[n].loaded for n in names):
        if time.monotonic() > deadline:
            raise SystemExit(f"models not unloaded: {models(c)}")
        time.sleep(0.02)


def run(model_dir: Path, profile: str | None, rounds: int) -> dict[str, Any]:
    variants = (("int8", "int8"), ("int4", "int4_block32"))
    table = "\n".join(
        f'[models.{name}]\npath = "{model_dir}"\nquantization = "{q}"\nkeep_alive = 0\n'
        for name, q in variants
    )
    names = [n for n, _ in variants]
    with tempfile.TemporaryDirectory() as tmp:
        args: dict[str, Any] = {"profile": profile} if profile else {}
        d = Daemon(Path(tmp), None, f"[watchdog]\ntick_s = 0.1\n[models]\n{table}", **args)
        try:
            c = d.client(timeout=600)
            at_ready = proc_rss_mib(d.proc.pid)
            wait_unloaded(c, names)  # keep_alive 0: the default model goes too, once idle
            idle = proc_rss_mib(d.proc.pid)
            per: dict[str, Any] = {}
            for name in names:
                cold: list[float] = []
                warm: list[float] = []
                loaded: list[float] = []
                after: list[float] = []
                first = 0.0
                for i in range(rounds + 1):
                    before = proc_rss_mib(d.proc.pid)
                    t = one_token(c, name, "-1")  # loads; stays for the warm request
                    if i == 0 and name != names[0]:  # never loaded in this state dir
                        first = t
                    else:
                        cold.append(t)
                    warm.append(one_token(c, name, "-1"))
                    loaded.append(proc_rss_mib(d.proc.pid) - before)
                    one_token(c, name, "0")  # unloads once idle
                    wait_unloaded(c, [name])
                    after.append(proc_rss_mib(d.proc.pid) - before)
                m = models(c)[name]
                per[name] = {
                    "first_load_s": first,
                    "load_request_s": med(cold),
                    "warm_request_s": med(warm),
                    "rss_added_mib": med(loaded),
                    "rss_left_after_unload_mib": med(after),
                    "planned_mib": m.estimate_bytes / (1 << 20),
                    "last_load_s": m.last_load_s,
                    "rss_unloaded_after_mib": proc_rss_mib(d.proc.pid),  # every model unloaded
                }
            final = proc_rss_mib(d.proc.pid)
        finally:
            d.stop()
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "model": str(model_dir),
        "rounds": rounds,
        "rss_at_ready_mib": at_ready,
        "rss_idle_unloaded_mib": idle,
        "rss_end_unloaded_mib": final,
        "models": per,
    }


def render(r: dict[str, Any]) -> str:
    lines = [
        "## Several models: unloaded cost, load on first request, memory returned",
        "",
        f"`python benchmarks/bench_models.py` ({r['machine']}; {Path(r['model']).name}'s int8 "
        f"and int4_block32 variants as two named models, `keep_alive = 0`; {r['rounds']} "
        "load/unload rounds each; median (min–max)).",
        "",
        f"Daemon RSS: {r['rss_at_ready_mib']:.1f} MiB at READY (default model loaded), "
        f"{r['rss_idle_unloaded_mib']:.1f} MiB idle with every model unloaded, "
        f"{r['rss_end_unloaded_mib']:.1f} MiB unloaded again after every round.",
        "",
        "| model | budget share MiB | first load ever (s) | 1-token request, unloaded (s) "
        "| same, loaded (s) | RSS added by the load (MiB) | RSS left after unload (MiB) "
        "| daemon RSS after its rounds, all unloaded (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in r["models"].items():
        first = f"{m['first_load_s']:.2f}" if m["first_load_s"] else "(at start)"
        lines.append(
            f"| {name} | {m['planned_mib']:.1f} | {first} | {fmt(m['load_request_s'])} | "
            f"{fmt(m['warm_request_s'])} | {fmt(m['rss_added_mib'], 1)} | "
            f"{fmt(m['rss_left_after_unload_mib'], 1)} | {m['rss_unloaded_after_mib']:.1f} |"
        )
    lines += [
        "",
        "A request to an unloaded model waits for its load: the difference between the two "
        "request columns is the load. The first load in a fresh state directory also prepares "
        'the model and packs its weights into the cache; later loads map them. "RSS left '
        "after unload\" is the daemon's RSS after the model unloaded minus before it loaded: "
        'what an unload does not give back (allocator and interpreter caches). "Budget '
        "share\" is what the model's load must find free in `runtime.max_num_bytes`: its "
        "one-session plan plus its own host KV tier and prefix cache at their byte budgets "
        "(the profile's `[kv]`), not RSS.",
    ]
    return "\n".join(lines)


def main() -> None:
    args = bench_args(__doc__)
    model = Path(args.model) if args.model else demo_model_dir()
    result = run(model, args.profile, args.rounds)
    body = render(result)
    print(body)
    if not args.no_write:
        name = section_name("models", args)
        write_section(name, result, body)
        print(f"wrote docs/PERFORMANCE.md and docs/bench/{name}.json")


if __name__ == "__main__":
    main()
