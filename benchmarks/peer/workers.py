"""The contenders, each run in a fresh process (`bench_peer.py --worker <engine> ...`): load
once, warm up with the same request, serve the measured requests, print one RESULT line."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peer.measure import PROMPT_TEXTS, peak_rss_mib, prompt_text, stream_timing
from benchmarks.peer.spec import CACHE, ENGINES, HISTORY, PROMPTS, TURN


def worker_edge(a: argparse.Namespace) -> dict[str, Any]:
    from agent.engine.engine import Engine
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest
    from agent.profile import load_profile

    if a.task == "continue":
        return {"engine": "edge", **continue_edge(a), "peak_rss_mib": peak_rss_mib()}
    profile = load_profile(Path(a.profile))
    t0 = time.perf_counter()
    engine = Engine.load(profile, Path(a.model), quantization=a.quant, kv_windows=not a.no_windows)
    load_s = time.perf_counter() - t0
    windows = engine.loaded.runner.layout.all_windows()  # exported or added at load
    out: dict[str, Any] = {"engine": "edge", "kv_windows": [w.length for w in windows]}
    out["load_s"] = load_s

    def run(prompt: str, tokens: int) -> tuple[float, float, int, list[int], Any]:
        req = GenerateRequest(prompt, max_tokens=tokens, sampling=SamplingParams(0.0))
        return stream_timing(engine.generate(req))

    run(prompt_text(64), 8)  # warm-up: page faults, XNNPACK's first runs
    if a.task == "main":
        _, rate, n, _, _ = run(prompt_text(64), a.tokens)
        out.update(decode_tok_s=rate, decoded=n)
        for p in PROMPTS:
            ttft, _, _, _, last = run(prompt_text(f"fresh{p}"), 1)
            prompt = last.stats.prompt_tokens
            out.update({f"ttft{p}_ms": ttft, f"prompt{p}_tokens": prompt})
            out[f"cached{p}_tokens"] = last.stats.cached_tokens  # 0: all of it prefilled
            out[f"prefill{p}_tok_s"] = prompt / ttft * 1e3
    elif a.task == "window":
        ttft, rate, n, ids, _ = run(prompt_text(a.prompt), a.tokens)
        out.update(decode_tok_s=rate, decoded=n, ids=ids, ttft_ms=ttft)
    engine.close()
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def continue_edge(a: argparse.Namespace) -> dict[str, Any]:
    """TTFT of a 16-token turn after a ~1,000-token conversation, at the consumer: bound, then
    from the disk tier after a restart (a new Engine on the same state directory)."""
    from agent.engine.engine import Engine
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest
    from agent.profile import load_profile

    greedy = SamplingParams(0.0)
    state = Path(tempfile.mkdtemp(prefix="bench-state-"))
    profile = load_profile(Path(a.profile))
    e = Engine.load(profile, Path(a.model), quantization=a.quant, state_dir=state)
    history, turn = prompt_text(a.history), prompt_text(TURN + 1)
    warm = GenerateRequest(prompt_text(64), max_tokens=8, sampling=greedy)
    e.complete(warm)  # both engines warmed up like the others (a daemon that has served)
    sid = e.create_session()
    e.complete(GenerateRequest(history, max_tokens=1, sampling=greedy, session_id=sid))
    later = e.fork_session(sid)
    hist_tokens = len(e.session_tokens(sid))
    bound_ms, _, _, _, bound = stream_timing(
        e.generate(GenerateRequest(turn, max_tokens=1, sampling=greedy, session_id=sid))
    )
    e.close()  # a graceful stop writes every session to the disk tier
    e = Engine.load(profile, Path(a.model), quantization=a.quant, state_dir=state)
    e.complete(warm)
    disk_ms, _, _, _, _ = stream_timing(
        e.generate(GenerateRequest(turn, max_tokens=1, sampling=greedy, session_id=later))
    )
    e.close()
    shutil.rmtree(state, ignore_errors=True)
    return {
        "history_tokens": hist_tokens,
        "turn_tokens": bound.stats.prompt_tokens,
        "bound_ttft_ms": bound_ms,
        "disk_ttft_ms": disk_ms,
    }


def worker_grpc(a: argparse.Namespace) -> dict[str, Any]:
    from agent.api.grpc.client import Client, build_request
    from tests.support.daemon_harness import Daemon

    tmp = Path(tempfile.mkdtemp(prefix="bench-grpc-"))
    d = Daemon(tmp, Path(a.model), "", profile=a.profile, args=("--quantization", a.quant))
    out: dict[str, Any] = {"engine": "grpc"}

    def run(prompt: str, tokens: int) -> tuple[float, float, int, list[int], Any]:
        c = Client(str(d.socket), timeout=600)
        req = build_request(
            prompt, None, max_tokens=tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=[]
        )
        try:
            return stream_timing(c.stream(req))
        finally:
            c.close()

    try:
        run(prompt_text(64), 8)
        _, rate, n, _, _ = run(prompt_text(64), a.tokens)
        out.update(decode_tok_s=rate, decoded=n)
        for p in PROMPTS:
            out[f"ttft{p}_ms"], _, _, _, _ = run(prompt_text(f"fresh{p}"), 1)
        out["peak_rss_mib"] = peak_rss_mib(d.proc.pid)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def worker_litertlm(a: argparse.Namespace) -> dict[str, Any]:
    """LiteRT-LM's Python API (its C engine underneath) on the bundle, one engine for all
    requests like our daemon, warmed up the same way, timed at the consumer of its stream."""
    import litert_lm

    cache = CACHE / ("litertlm-cold" if a.cold else "litertlm-cache")
    if a.cold:  # its packed weights are made again, as edge-agent's are
        shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    engine = litert_lm.Engine(
        a.bundle,
        backend=litert_lm.Backend.CPU(thread_count=a.threads),
        cache_dir=str(cache),
        enable_benchmark=True,
    )

    def run(prompt: str, tokens: int, session: Any = None) -> tuple[float, float, int, Any]:
        s = session or engine.create_session(apply_prompt_template=False, max_output_tokens=tokens)
        t0 = time.perf_counter()
        s.run_prefill([prompt])
        first = last = 0.0
        for _chunk in s.run_decode_async():
            last = time.perf_counter()
            first = first or last
        info = s.get_benchmark_info()
        n = info.last_decode_token_count
        rate = (n - 1) / (last - first) if n > 1 and last > first else 0.0
        if session is None:
            s.close()
        return (first - t0) * 1e3, rate, n, info

    out: dict[str, Any] = {"engine": "litertlm", "load_s": time.perf_counter() - t0}
    run(prompt_text(64), 8)  # warm-up, as for edge-agent
    if a.task == "main":
        _, rate, n, info = run(prompt_text(64), a.tokens)
        out.update(
            decode_tok_s=rate, decoded=n, own_decode_tok_s=info.last_decode_tokens_per_second
        )
        for p in PROMPTS:
            ttft, _, _, info = run(prompt_text(f"fresh{p}"), 1)
            prompt = info.last_prefill_token_count
            out.update({f"ttft{p}_ms": ttft, f"prompt{p}_tokens": prompt})
            out[f"prefill{p}_tok_s"] = prompt / ttft * 1e3
    elif a.task == "window":
        _, rate, n, _ = run(prompt_text(a.prompt), a.tokens)
        out.update(decode_tok_s=rate, decoded=n)
    elif a.task == "continue":
        history, turn = prompt_text(a.history), prompt_text(TURN + 1)
        # re-prefilling the history and the turn in a new session: what a restart, or a
        # conversation that was not the one kept in memory, costs
        out["reprefill_ttft_ms"], _, _, info = run(history + turn, 1)
        out["reprefill_tokens"] = info.last_prefill_token_count
        # its session kept alive in the process: only the turn is prefilled
        live = engine.create_session(apply_prompt_template=False, max_output_tokens=2)
        live.run_prefill([history])
        out["live_ttft_ms"], _, _, _ = run(turn, 1, live)
        live.close()
    engine.close()
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=ENGINES)
    ap.add_argument(
        "--task", choices=("main", "window", "continue", "spec", "verify"), default="main"
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--quant", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--bundle", default="")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--no-windows", action="store_true")
    ap.add_argument("--cold", action="store_true", help="litertlm: start with an empty cache")
    ap.add_argument("--history", type=int, default=HISTORY)
    ap.add_argument("--prompts", required=True, help="JSON of prompt texts (prompts_file)")
    ap.add_argument("--keys", default="", help="spec: the prompts to decode, by key")
    ap.add_argument("--speculation", default="off", help="spec: edge-agent's speculation")
    a = ap.parse_args(argv)
    PROMPT_TEXTS.update(json.loads(Path(a.prompts).read_text()))
    fn = {"edge": worker_edge, "grpc": worker_grpc, "litertlm": worker_litertlm}[a.engine]
    if a.task in ("spec", "verify"):
        from benchmarks.peer import workers_spec

        fn = {
            ("edge", "spec"): workers_spec.spec_edge,
            ("litertlm", "spec"): workers_spec.spec_litertlm,
            ("edge", "verify"): workers_spec.verify_cost,
        }[(a.engine, a.task)]
    print("RESULT " + json.dumps(fn(a)), flush=True)
