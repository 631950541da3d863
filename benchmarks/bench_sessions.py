#!/usr/bin/env python3
"""Sessions benchmark: continuing a long conversation from each KV tier, the prefix cache,
and the daemon's peak RSS with many live sessions under a tight budget.

* Time to first token of a new turn on a session holding ~1,000 tokens, when its KV is bound,
  in host memory, or on disk, against prefilling the same history again (no session).
* Time to first token of a request sharing a ~500-token system prompt with an earlier one,
  with the prefix cache on and off.
* A real `edge-agent run` with 20 sessions of ~1,000 tokens under a budget that holds 4
  runtime KV caches: its peak RSS (VmHWM) against `max_num_bytes`.

Writes docs/bench/sessions[-<model>].json and a section of docs/PERFORMANCE.md.

    python benchmarks/bench_sessions.py [--model DIR] [--rounds 3]
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.api.grpc.client import build_request  # noqa: E402
from agent.engine.engine import Engine, EngineLimits  # noqa: E402
from agent.engine.loading import estimate_memory  # noqa: E402
from agent.engine.sampler import SamplingParams  # noqa: E402
from agent.engine.types import GenerateRequest  # noqa: E402
from agent.model.directory import demo_model_dir, load_model_dir  # noqa: E402
from agent.model.tflite.file import read_model_file  # noqa: E402
from agent.model.tflite.layout import discover_layout  # noqa: E402
from agent.profile import parse_profile, profiles_dir, resolve_profile  # noqa: E402
from benchmarks._report import bench_args, fmt, med, section_name, write_section  # noqa: E402
from tests.support.daemon_harness import Daemon  # noqa: E402

GREEDY = SamplingParams(0.0)
MIB = 1 << 20


def kv_bytes(model_dir: Path, quant: str) -> int:
    """One runtime KV cache of the model, in bytes."""
    meta = load_model_dir(model_dir)
    model = read_model_file(meta.path_of(meta.variant(quant)))
    return discover_layout(model, meta.context_length).kv.bytes_per_session


def history_text(engine: Engine, n: int) -> str:
    """About `n` tokens of real Python source."""
    src = (ROOT / "agent" / "engine" / "engine.py").read_text()
    return engine.tokenizer.decode(engine.tokenizer.encode(src)[:n])


def profile_text(budget: int, host: int, disk: int, prefix: int) -> str:
    text = (profiles_dir() / "generic-x86_64.toml").read_text()
    text = re.sub(r"(?m)^max_num_bytes = .*$", f"max_num_bytes = {budget}", text)
    for key, value in (
        ("host_max_bytes", host),
        ("disk_max_bytes", disk),
        ("prefix_max_bytes", prefix),
    ):
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    return text


def engine_with(
    model_dir: Path, tmp: Path, quant: str, caches: int, host: int, disk: int, prefix: int
) -> Engine:
    base, _ = resolve_profile("generic-x86_64")
    one = estimate_memory(base, model_dir, quant)
    kv = kv_bytes(model_dir, quant)
    folder = tmp / f"p{time.monotonic_ns()}"
    folder.mkdir()
    path = folder / "generic-x86_64.toml"
    path.write_text(profile_text(one + (caches - 1) * kv + host + prefix, host, disk, prefix))
    import tomllib

    profile = parse_profile(tomllib.loads(path.read_text()), path)
    limits = EngineLimits(max_active=1, max_sessions=64)
    return Engine.load(
        profile, model_dir, quantization=quant, limits=limits, state_dir=tmp / "state"
    )


def ttft(engine: Engine, prompt: str, session: str | None = None) -> float:
    r = GenerateRequest(prompt, max_tokens=1, sampling=GREEDY, session_id=session)
    return engine.complete(r).stats.ttft_ms


def tiers(model_dir: Path, quant: str, rounds: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, list[float]] = {"bound": [], "host": [], "disk": [], "reprefill": []}
    host = engine_with(model_dir, tmp, quant, caches=1, host=512 * MIB, disk=0, prefix=0)
    disk = engine_with(model_dir, tmp, quant, caches=1, host=0, disk=2048 * MIB, prefix=0)
    n = min(1000, host.info.context_length - 40)
    history = history_text(host, n)
    turn = "\n# next turn\ndef g():"
    tokens = 0
    for _ in range(rounds):
        for name, e in (("bound", host), ("host", host), ("disk", disk)):
            sid = e.create_session()
            ttft(e, history, sid)
            tokens = len(e.session_tokens(sid))
            if name != "bound":  # another session takes the only runtime cache
                other = e.create_session()
                ttft(e, "x = 1", other)
                e.delete_session(other)
            where = next(s.tier for s in e.list_sessions() if s.id == sid)
            assert where == name, (name, where)
            out[name].append(ttft(e, turn, sid))
            e.delete_session(sid)
        out["reprefill"].append(ttft(host, history + turn))
    host.close()
    disk.close()
    res: dict[str, Any] = {k: med(v) for k, v in out.items()}
    res["history_tokens"] = tokens
    return res


def prefix(model_dir: Path, quant: str, rounds: int, tmp: Path) -> dict[str, Any]:
    on = engine_with(model_dir, tmp, quant, caches=2, host=0, disk=0, prefix=256 * MIB)
    off = engine_with(model_dir, tmp, quant, caches=2, host=0, disk=0, prefix=0)
    system = history_text(on, 500)
    warm, cold = [], []
    for r in range(rounds):
        ttft(on, system + f"\n# user {r}a\n")  # an earlier session with the same prompt
        warm.append(ttft(on, system + f"\n# user {r}b\n"))
        cold.append(ttft(off, system + f"\n# user {r}b\n"))
    hits = on.tier_stats().prefix_hits
    on.close()
    off.close()
    return {"with_cache": med(warm), "without": med(cold), "hits": hits}


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def daemon_rss(model_dir: Path, quant: str, tmp: Path) -> dict[str, Any]:
    base, _ = resolve_profile("generic-x86_64")
    one = estimate_memory(base, model_dir, quant)
    kv = kv_bytes(model_dir, quant)
    rows = kv // load_model_dir(model_dir).context_length * 1000  # one session's used rows
    host = 6 * rows  # six sessions in RAM, the rest on disk
    budget = one + 3 * kv + host  # four runtime caches
    folder = tmp / "rss"
    folder.mkdir()
    path = folder / "generic-x86_64.toml"
    path.write_text(profile_text(budget, host, 8 * 1024 * MIB, 0))
    config = f'[model]\nquantization = "{quant}"\n[limits]\nmax_active = 1\nmax_sessions = 64\n'
    d = Daemon(folder, model_dir, config, profile=str(path))
    try:
        client = d.client(timeout=600)
        idle = vm_hwm_mib(d.proc.pid)
        text = history_text_for(model_dir, 990)
        sids = []

        def one_token(prompt: str, sid: str) -> None:
            client.generate(
                build_request(
                    prompt,
                    None,
                    max_tokens=1,
                    temperature=0.0,
                    top_k=None,
                    top_p=None,
                    seed=None,
                    stop=[],
                    session=sid,
                )
            )

        for _ in range(20):
            sids.append(client.create_session())
            one_token(text, sids[-1])
        for sid in sids:  # a second turn on each: every tier is read back
            one_token("\n# more\n", sid)
        status = client.status()
        peak = vm_hwm_mib(d.proc.pid)
    finally:
        d.stop()
    return {
        "budget_mib": budget / MIB,
        "kv_cache_mib": kv / MIB,
        "session_rows_mib": rows / MIB,
        "idle_peak_mib": idle,
        "peak_mib": peak,
        "overhead_mib": peak - budget / MIB,
        "kv": status.get("kv", {}),
    }


def history_text_for(model_dir: Path, n: int) -> str:
    from agent.tokenizer.load import load_tokenizer

    tok = load_tokenizer(load_model_dir(model_dir).tokenizer_path)
    src = (ROOT / "agent" / "engine" / "engine.py").read_text()
    return tok.decode(tok.encode(src)[:n])


def table(r: dict[str, Any]) -> str:
    t, p, m = r["tiers"], r["prefix"], r["rss"]
    re_ms = t["reprefill"]["median"]

    def x(d: dict[str, float]) -> str:
        return f"{re_ms / d['median']:.1f}x"

    lines = [
        f"Measured {r['date']} on {r['machine']}, profile `generic-x86_64` with budgets set per "
        f"row, model {r['model']} {r['quantization']}; median (min–max) of {r['rounds']} "
        f"rounds. Command: `python benchmarks/bench_sessions.py{r['args']}`.",
        "",
        f"Time to first token of a new turn on a session of {t['history_tokens']} tokens:",
        "",
        "| session KV was | TTFT ms | vs re-prefilling the history |",
        "|---|---|---|",
        f"| bound (resident) | {fmt(t['bound'], 1)} | {x(t['bound'])} faster |",
        f"| in host memory | {fmt(t['host'], 1)} | {x(t['host'])} faster (goal ≥ 10x) |",
        f"| on disk | {fmt(t['disk'], 1)} | {x(t['disk'])} faster (goal ≥ 3x) |",
        f"| (no session: prefill it all) | {fmt(t['reprefill'], 1)} | 1x |",
        "",
        f"Prefix cache, a request sharing a ~500-token system prompt with an earlier one: TTFT "
        f"{fmt(p['with_cache'], 1)} ms with the cache, {fmt(p['without'], 1)} ms without "
        f"({p['without']['median'] / p['with_cache']['median']:.1f}x).",
        "",
        f"Daemon with 20 sessions of ~1,000 tokens, budget {m['budget_mib']:.1f} MiB = the "
        f"model's plan with one KV cache + 3 more caches ({m['kv_cache_mib']:.1f} MiB each) + "
        f"a host tier of 6 sessions' rows ({m['session_rows_mib']:.2f} MiB each); the rest on "
        f"disk. Peak RSS (VmHWM) {m['peak_mib']:.0f} MiB after every session's second turn; "
        f"{m['idle_peak_mib']:.0f} MiB right after start-up. Peak RSS − max_num_bytes = "
        f"**{m['overhead_mib']:.0f} MiB** (see below for what it is made of).",
    ]
    return "\n".join(lines)


def main() -> None:
    args = bench_args(__doc__)
    model_dir = Path(args.model) if args.model else demo_model_dir()
    meta = load_model_dir(model_dir)
    quant = "int8" if "int8" in [v.quantization for v in meta.variants] else None
    assert quant is not None
    rounds = max(1, args.rounds)
    with tempfile.TemporaryDirectory(prefix="edge-agent-bench-") as d:
        tmp = Path(d)
        res: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": "x86_64, 2 CPUs",
            "model": f"{meta.name} {meta.version}",
            "quantization": quant,
            "rounds": rounds,
            "args": f" --model {args.model}" if args.model else "",
            "tiers": tiers(model_dir, quant, rounds, tmp),
        }
        print("tiers", {k: v for k, v in res["tiers"].items()}, flush=True)
        res["prefix"] = prefix(model_dir, quant, rounds, tmp)
        print("prefix", res["prefix"], flush=True)
        res["rss"] = daemon_rss(model_dir, quant, tmp)
        print("rss", res["rss"], flush=True)
    print(table(res))
    if not args.no_write:
        name = section_name("sessions", args)
        write_section(name, res, table(res))
        print(f"wrote docs/PERFORMANCE.md and docs/bench/{name}.json")


if __name__ == "__main__":
    main()
