#!/usr/bin/env python3
"""edge-agent against Google's LiteRT-LM and against the memory-bandwidth limit, in one run.

On the same machine and the same model files (built by the toolchain on first use, cached in
.cache/models/), alternating the contenders within every round, each in a fresh process:

* ``edge``     - edge-agent in-process (`Engine.generate`, consumer-side timing);
* ``grpc``     - edge-agent through the daemon's gRPC unix socket (client-side timing);
* ``litertlm`` - LiteRT-LM (`litert-lm-api`: its C++ engine through its Python API) on a
                 `.litertlm` bundle of the same `.tflite`, timed at the consumer of its stream.

Every contender loads once, warms up with the same request, then serves the measured requests
(a daemon's steady state); prefill tok/s is prompt tokens over time to first token.

Sections:

* ``main``: a SmolLM-135M-shaped model (30 layers, dim 576, 9 heads, 3 KV heads, FFN 1536,
  vocab 49152, KV 1024, transposed KV), random weights, int8 and int4 block 32, 2 threads and
  1: decode tok/s (64-token prompt, 128 decoded), time to first token and prefill tok/s for
  64- and 448-token prompts, peak RSS; plus the roofline (measured read bandwidth, bytes read
  per decoded token, the fraction of the ceiling each engine reaches).
* ``main-windows``: the same on the KV-1024 model exported with KV windows 256 and 512 as
  well: one file for both engines; LiteRT-LM runs its full-length signatures, edge-agent the
  smallest window that holds the request.
* ``windows``: the same shape with KV 4096 and KV windows 256 and 1024 in the one file: decode
  tok/s by used context with the windows, without them (the single-length signatures of the
  same file), and LiteRT-LM; greedy tokens compared.
* ``continue``: continuing a ~1,000-token conversation: edge-agent sessions (bound, and from
  the disk tier after a restart) against LiteRT-LM re-prefilling the history, and against a
  LiteRT-LM session kept alive in its process (976 tokens of history: LiteRT-LM cannot prefill
  closer to the end of the 1024-row cache);
* ``continue4096``: the same with exactly 1,000 tokens of history on the KV-4096 model.

Writes docs/bench/peer.json, a section of docs/PERFORMANCE.md and docs/bench/peer.png. What
is missing is skipped and said so: the toolchain extra (to build the models), the ``peer``
extra (litert-lm-api, litert-lm-builder), the ``bench`` extra (matplotlib, for the plot).

    python scripts/bench_peer.py [--rounds 3] [--tokens 128] [--threads 2 --threads 1]
                                 [--only main|main-windows|windows|continue|continue4096]
                                 [--no-write] [--report-only]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts._report import fmt, med, write_section  # noqa: E402

CACHE = ROOT / ".cache" / "bench"
MODELS = ROOT / ".cache" / "models"
TOKENIZER = ROOT / "agent" / "models" / "demo" / "tokenizer.model"
SMOLLM = ["--random", "--preset", "smollm-135m", "--tokenizer", str(TOKENIZER), "--pad-tokenizer"]
MAIN_MODEL = (
    MODELS / "smollm-kv1024",
    [*SMOLLM, "--kv-max", "1024", "--quant", "int8", "--quant", "int4_block32"],
)
# Prefill 8 besides the usual 32/128/512: near the end of a window no 32-token call fits, and
# a turn there would otherwise run up to 31 tokens one by one (measured: a 16-token turn at
# row 1,000 of the 1024-row window took 291 ms as 16 decode calls; moving up to the 4096-row
# window first cost more: the move 85-350 ms plus 208 ms for a 32-token call over 4096 rows).
WINDOW_MODEL = (
    MODELS / "smollm-kv4096w8",
    [
        *SMOLLM,
        *("--kv-max", "4096", "--window", "256", "--window", "1024", "--quant", "int8"),
        *("--prefill", "8", "--prefill", "32", "--prefill", "128", "--prefill", "512"),
    ],
)
# The main model exported with KV windows 256 and 512 as well (prefill 8/32/128/512 by
# build_model's default with windows): the same weights, and for LiteRT-LM the same
# `decode`/`prefill_<N>` signatures over 1024 rows; edge-agent runs a 64-token prompt and its
# 128 tokens in the 256-row window and a 448-token prompt in the 512-row one.
MAIN_WINDOWS_MODEL = (
    MODELS / "smollm-kv1024w",
    [
        *SMOLLM,
        *("--kv-max", "1024", "--window", "256", "--window", "512"),
        *("--quant", "int8", "--quant", "int4_block32"),
    ],
)
QUANTS = ("int8", "int4_block32")
ENGINES = ("edge", "grpc", "litertlm")
PROMPTS = (64, 448)
# Tokens of conversation before the continued turn, and of the turn. History + turn stays 32
# rows below the 1024-row cache: LiteRT-LM 0.18.1 pads its last prefill group to a signature
# length and refuses to run past the cache ("Chosen prefill work group size exceeds available
# state entries"), where edge-agent finishes with shorter signatures and decode (measured).
HISTORY = 976
TURN = 16
# On the KV-4096 model (windows 256/1024) the conversation is exactly 1,000 tokens: 999 of
# prompt plus the answer's one; LiteRT-LM runs that file's full-length signatures.
HISTORY_4096 = 999
SECTIONS = ("main", "main-windows", "windows", "continue", "continue4096")
WINDOW_USED = (128, 1000, 3000)  # used context (prompt + decoded) for the windows section
WINDOW_DECODE = 64


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------- preparation


def ensure_model(target: Path, build_args: list[str]) -> Path | None:
    """The model directory, built by the toolchain on first use; None if it cannot be."""
    if (target / "metadata.json").exists():
        return target
    if not (have("torch") and have("litert_torch")):
        print(f"SKIP building {target.name}: the toolchain extra (torch, litert-torch) is missing")
        return None
    name = f"{target.name}-random"
    cmd = [sys.executable, str(ROOT / "scripts" / "build_model.py"), *build_args]
    cmd += ["--name", name, "--out", str(target)]
    print("building", target.name, "(once; several minutes):", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return target


def pack_litertlm(model_dir: Path, quant: str) -> Path | None:
    """The `.litertlm` bundle of one variant: the same `.tflite` bytes plus the tokenizer."""
    if not (have("litert_lm") and have("litert_lm_builder")):
        return None
    from litert_lm_builder.litertlm_builder import (
        DType,
        LitertLmFileBuilder,
        Metadata,
        TfLiteModelType,
    )
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    from agent.modeldir import load_model_dir

    meta = load_model_dir(model_dir)
    variant = next(v for v in meta.variants if v.quantization == quant)
    out = CACHE / f"{model_dir.name}_{quant}_{variant.sha256[:12]}.litertlm"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    md = llm_metadata_pb2.LlmMetadata()
    if meta.bos_id is not None:
        md.start_token.token_ids.ids.append(meta.bos_id)
    for stop in sorted(meta.stop_ids):
        md.stop_tokens.add().token_ids.ids.append(stop)
    md.max_num_tokens = meta.context_length
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        md_path = Path(tmp) / "llm_metadata.pb"
        md_path.write_bytes(md.SerializeToString())
        b = LitertLmFileBuilder()
        b.add_system_metadata(Metadata(key="Authors", value="edge-agent bench", dtype=DType.STRING))
        b.add_llm_metadata(str(md_path))
        b.add_sentencepiece_tokenizer(str(meta.tokenizer_path))
        b.add_tflite_model(str(meta.path_of(variant)), TfLiteModelType.PREFILL_DECODE)
        partial = Path(tmp) / out.name
        with open(partial, "wb") as f:
            b.build(f)
        os.replace(partial, out)
    return out


def bench_profile(threads: int, quant: str, cold: bool = False) -> Path:
    """The dev profile with `threads` threads, a persistent weight cache and no prefix cache
    (LiteRT-LM has none across requests: repeated prompts must be prefilled every time).
    `cold`: its weight cache directory is emptied, so the load prepares and packs the model."""
    from agent.profile import profiles_dir

    text = (profiles_dir() / "generic-x86_64.toml").read_text()
    kind = "cold-" if cold else ""
    out = CACHE / f"bench-{kind}{threads}t-{quant.replace('_', '-')}.toml"
    weights = CACHE / f"xnnpack{'-cold' if cold else ''}" / quant
    if cold:
        shutil.rmtree(weights, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    text = text.replace('name = "generic-x86_64"', f'name = "{out.stem}"')
    text = text.replace("num_threads = 2", f"num_threads = {threads}")
    text = text.replace("prefix_max_bytes = 134_217_728", "prefix_max_bytes = 0")
    text = text.replace(
        'arena_extend_strategy = "kNextPowerOfTwo"',
        f'arena_extend_strategy = "kNextPowerOfTwo"\nxnnpack_weight_cache_dir = "{weights}"',
    )
    out.write_text(text)
    return out


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Sustained memory read bandwidth (GB/s): `threads` threads each OR-reducing their share of
    a buffer far larger than the caches (numpy releases the GIL in the reduction); best run."""
    import numpy as np

    data = np.ones(mib * 2**20 // 8, dtype=np.int64)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.bitwise_or.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def read_variant(model_dir: Path, quant: str) -> Any:
    """The parsed `.tflite` of one variant of a model directory (a `ModelFile`)."""
    from agent.modeldir import load_model_dir
    from agent.runtime.modelfile import read_model_file

    meta = load_model_dir(model_dir)
    variant = next(v for v in meta.variants if v.quantization == quant)
    return read_model_file(meta.path_of(variant))


def bytes_per_token(model: Any, kv_rows: int) -> dict[str, float]:
    """What one decode step reads: every weight except the embedding table (one row of it is
    looked up) plus the K and V of every layer over the KV length the step attends over."""
    from agent.runtime.layout import discover_layout

    weights = sum(
        b for op, _kind, _n, b in model.weights if op not in ("EMBEDDING_LOOKUP", "GATHER")
    )
    kv = discover_layout(model).kv.bytes_per_token * kv_rows
    return {"weights": weights, "kv": kv, "total": weights + kv}


def decode_rows(windows: list[int], used: int) -> int:
    """The KV rows edge-agent's decode attends over with `used` rows in use: the smallest of
    its KV windows (the lengths its worker reported, the full length last) that holds them."""
    return min(w for w in windows if w >= used)


# ----------------------------------------------------------------------------- workers


def peak_rss_mib(pid: int | str = "self") -> float:
    """The process's RSS high-water mark. Not `ru_maxrss`: that survives exec, so a worker would
    report its parent's peak (the bandwidth test's buffer)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


_PROMPTS: dict[str, str] = {}  # a worker's prompt texts by token count, from `prompts_file`


def prompt_text(n: int) -> str:
    """Text of about `n` tokens (the BOS the engine adds included): source code of this repo."""
    return _PROMPTS[str(n)]


@functools.cache
def prompts_file(model: str, lengths: tuple[int, ...]) -> Path:
    """The prompt texts of `lengths` tokens for `model`'s tokenizer, written once by the parent.

    A worker that built them would count the tokenizer's work on the whole source tree (a
    ~30 MiB list of ids, and the heap it leaves behind) in its engine's peak RSS, and LiteRT-LM's
    worker would load a tokenizer it does not use.
    """
    from agent.modeldir import load_model_dir
    from agent.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(load_model_dir(Path(model)).tokenizer_path)
    ids = tok.encode("".join(p.read_text() for p in sorted((ROOT / "agent").rglob("*.py"))))
    texts = {str(n): str(tok.decode(ids[: n - 1])) for n in lengths}
    fd, name = tempfile.mkstemp(prefix="bench-prompts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(texts, f)
    return Path(name)


def stream_timing(stream: Any) -> tuple[float, float, int, list[int], Any]:
    """(time to first token ms, decode tok/s after it, tokens, ids, last message) of a stream
    of messages or events that carry `token_ids`, measured where they arrive."""
    t0 = time.perf_counter()
    first = last = 0.0
    ids: list[int] = []
    first_n = 0
    msg = None
    for msg in stream:
        if msg.token_ids:
            last = time.perf_counter()
            if not ids:
                first, first_n = last, len(msg.token_ids)
            ids.extend(msg.token_ids)
    rate = (len(ids) - first_n) / (last - first) if last > first else 0.0
    return (first - t0) * 1e3, rate, len(ids), ids, msg


def worker_edge(a: argparse.Namespace) -> dict[str, Any]:
    from agent.engine.engine import Engine
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest
    from agent.profile import load_profile

    if a.task == "continue":
        return {"engine": "edge", **continue_edge(a), "peak_rss_mib": peak_rss_mib()}
    profile = load_profile(Path(a.profile))
    t0 = time.perf_counter()
    engine = Engine(profile, Path(a.model), quantization=a.quant, kv_windows=not a.no_windows)
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
            ttft, _, _, _, last = run(prompt_text(p), 1)
            prompt = last.stats.prompt_tokens
            out.update({f"ttft{p}_ms": ttft, f"prompt{p}_tokens": prompt})
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
    e = Engine(profile, Path(a.model), quantization=a.quant, state_dir=state)
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
    e = Engine(profile, Path(a.model), quantization=a.quant, state_dir=state)
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
    from agent.rpc.client import Client, build_request
    from tests.daemon_harness import Daemon

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
            out[f"ttft{p}_ms"], _, _, _, _ = run(prompt_text(p), 1)
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
            ttft, _, _, info = run(prompt_text(p), 1)
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
    ap.add_argument("--task", choices=("main", "window", "continue"), default="main")
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
    a = ap.parse_args(argv)
    _PROMPTS.update(json.loads(Path(a.prompts).read_text()))
    fn = {"edge": worker_edge, "grpc": worker_grpc, "litertlm": worker_litertlm}[a.engine]
    print("RESULT " + json.dumps(fn(a)), flush=True)


# ----------------------------------------------------------------------------- orchestration


def spawn(engine: str, **kw: Any) -> dict[str, Any]:
    """Run one worker in a fresh process; its RESULT line."""
    extra = (int(kw.get("history") or HISTORY), int(kw.get("prompt") or 64))
    lengths = {64, *PROMPTS, TURN + 1, *extra}
    kw["prompts"] = prompts_file(str(kw["model"]), tuple(sorted(lengths)))
    cmd = [sys.executable, __file__, "--worker", engine]
    for k, v in kw.items():
        if v is True:
            cmd.append(f"--{k.replace('_', '-')}")
        elif v not in (None, False):
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{engine} worker failed ({r.returncode}):\n{r.stderr[-4000:]}")


MAIN_KEYS = (
    "decode_tok_s",
    "ttft64_ms",
    "ttft448_ms",
    "prefill64_tok_s",
    "prefill448_tok_s",
    "peak_rss_mib",
    "load_s",
)


def collect(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    xs = [r[key] for r in rows if key in r]
    return med(xs) if xs else None


def run_main(
    a: argparse.Namespace,
    skipped: list[str],
    section: str = "main",
    spec: tuple[Path, list[str]] = MAIN_MODEL,
) -> dict[str, Any] | None:
    model = ensure_model(*spec)
    if model is None:
        skipped.append(f"{section}: no model (toolchain extra missing)")
        return None
    from agent.runtime.layout import discover_layout

    engines = [e for e in ENGINES if e != "litertlm"]
    bundles = {q: pack_litertlm(model, q) for q in QUANTS}
    if all(bundles.values()):
        engines.append("litertlm")
    else:
        skipped.append("LiteRT-LM: the peer extra (litert-lm-api, litert-lm-builder) is missing")
    # The ceiling is the best read bandwidth the machine showed: sampled before every round,
    # since a neighbour's load on a shared machine lowers a single sample by up to half.
    samples: dict[int, list[float]] = {t: [read_bandwidth(t)] for t in a.threads}
    out: dict[str, Any] = {"model": model.name, "cells": []}
    for q in QUANTS:
        parsed = read_variant(model, q)
        bpt = bytes_per_token(parsed, 1024)
        for t in a.threads:
            cold: dict[str, Any] = {}
            for e in ("edge", "litertlm"):  # the first load: nothing prepared, packed or cached
                if e in engines:
                    cold[e] = spawn(
                        e,
                        model=model,
                        quant=q,
                        profile=bench_profile(t, q, cold=True),
                        threads=t,
                        bundle=bundles[q],
                        tokens=a.tokens,
                        cold=True,
                    )
                    print(q, t, e, "cold", {k: v for k, v in cold[e].items() if k != "ids"})
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
            for r in range(a.rounds):
                samples[t].append(read_bandwidth(t))
                for e in engines if r % 2 == 0 else reversed(engines):
                    res = spawn(
                        e,
                        model=model,
                        quant=q,
                        profile=bench_profile(t, q),
                        threads=t,
                        bundle=bundles[q],
                        tokens=a.tokens,
                    )
                    runs[e].append(res)
                    print(q, t, e, r, {k: v for k, v in res.items() if k != "ids"}, flush=True)
            cell: dict[str, Any] = {"quant": q, "threads": t, "bytes_per_token": bpt, "cold": cold}
            out["edge_windows"] = runs["edge"][0]["kv_windows"]
            out["file_windows"] = [w.length for w in discover_layout(parsed).windows]
            rows = decode_rows(out["edge_windows"], 64 + a.tokens)
            out["edge_kv_rows"] = rows
            edge_bpt = bytes_per_token(parsed, rows)
            if edge_bpt != bpt:  # edge-agent decodes in a KV window: it reads fewer bytes
                cell["edge_bytes_per_token"] = edge_bpt
            for e, results in runs.items():
                stats: dict[str, Any] = {"rounds": {}}
                for k in MAIN_KEYS:
                    got = collect(results, k)
                    if got is not None:
                        stats[k] = got
                        stats["rounds"][k] = [row[k] for row in results]
                cell[e] = stats
            out["cells"].append(cell)
    out["bandwidth_gb_s"] = {t: max(v) for t, v in samples.items()}
    out["bandwidth_samples_gb_s"] = samples
    for cell in out["cells"]:
        set_ceilings(cell, out["bandwidth_gb_s"][cell["threads"]])
    return out


def set_ceilings(cell: dict[str, Any], gb_s: float) -> None:
    """The decode speed the read bandwidth allows for the bytes each engine reads per token,
    and the fraction of it each engine reached."""
    ceiling = cell["ceiling_tok_s"] = gb_s * 1e9 / cell["bytes_per_token"]["total"]
    if "edge_bytes_per_token" in cell:
        cell["edge_ceiling_tok_s"] = gb_s * 1e9 / cell["edge_bytes_per_token"]["total"]
    for e in ENGINES:
        if e in cell:
            own = cell.get("edge_ceiling_tok_s", ceiling) if e != "litertlm" else ceiling
            cell[e]["of_ceiling"] = cell[e]["decode_tok_s"]["median"] / own


def model_and_bundle(
    section: str, spec: tuple[Path, list[str]], skipped: list[str]
) -> tuple[Path | None, Path | None]:
    """A section's int8 model and its LiteRT-LM bundle, each None (and said so) if missing."""
    model = ensure_model(*spec)
    if model is None:
        skipped.append(f"{section}: no model (toolchain extra missing)")
        return None, None
    bundle = pack_litertlm(model, "int8")
    if bundle is None:
        skipped.append(f"{section}: the LiteRT-LM column (peer extra missing)")
    return model, bundle


def run_windows(a: argparse.Namespace, skipped: list[str]) -> dict[str, Any] | None:
    model, bundle = model_and_bundle("windows", WINDOW_MODEL, skipped)
    if model is None:
        return None
    t = max(a.threads)
    profile = bench_profile(t, "int8")
    rounds = min(a.rounds, 3)  # differences far above the noise: 3 rounds
    out: dict[str, Any] = {"model": model.name, "threads": t, "points": [], "rounds": rounds}
    for used in WINDOW_USED:
        prompt = used - WINDOW_DECODE
        runs: dict[str, list[dict[str, Any]]] = {"windows": [], "single": [], "litertlm": []}
        for r in range(rounds):
            common = dict(model=model, quant="int8", profile=profile, threads=t, prompt=prompt)
            runs["windows"].append(spawn("edge", task="window", tokens=WINDOW_DECODE, **common))
            runs["single"].append(
                spawn("edge", task="window", tokens=WINDOW_DECODE, no_windows=True, **common)
            )
            if bundle is not None:
                runs["litertlm"].append(
                    spawn("litertlm", task="window", tokens=WINDOW_DECODE, bundle=bundle, **common)
                )
            print("window", used, r, {k: v[-1].get("decode_tok_s") for k, v in runs.items() if v})
        point: dict[str, Any] = {"used": used, "prompt": prompt}
        for k, rows in runs.items():
            if rows:
                point[k] = {"decode_tok_s": collect(rows, "decode_tok_s")}
        point["same_tokens"] = all(
            w["ids"] == s["ids"] for w, s in zip(runs["windows"], runs["single"], strict=True)
        )
        point["decoded"] = len(runs["windows"][0]["ids"])
        out["points"].append(point)
    return out


def run_continue(
    a: argparse.Namespace,
    skipped: list[str],
    section: str = "continue",
    spec: tuple[Path, list[str]] = MAIN_MODEL,
    history: int = HISTORY,
) -> dict[str, Any] | None:
    model, bundle = model_and_bundle(section, spec, skipped)
    if model is None:
        return None
    t = max(a.threads)
    profile = bench_profile(t, "int8")
    edge, peer = [], []
    rounds = min(a.rounds, 3)  # differences far above the noise: 3 rounds
    for _ in range(rounds):
        common = dict(model=model, quant="int8", profile=profile, threads=t, history=history)
        edge.append(spawn("edge", task="continue", **common))
        if bundle is not None:
            peer.append(spawn("litertlm", task="continue", bundle=bundle, **common))
        print("continue", edge[-1], peer[-1] if peer else "")
    out: dict[str, Any] = {
        "model": model.name,
        "threads": t,
        "rounds": rounds,
        "history_tokens": edge[0]["history_tokens"],
        "turn_tokens": edge[0]["turn_tokens"],
        "bound_ttft_ms": collect(edge, "bound_ttft_ms"),
        "disk_ttft_ms": collect(edge, "disk_ttft_ms"),
    }
    if peer:
        out["reprefill_ttft_ms"] = collect(peer, "reprefill_ttft_ms")
        out["reprefill_tokens"] = peer[0]["reprefill_tokens"]
        out["live_ttft_ms"] = collect(peer, "live_ttft_ms")
    return out


# ----------------------------------------------------------------------------- report


NAMES = {"edge": "edge-agent in-process", "grpc": "edge-agent via gRPC", "litertlm": "LiteRT-LM"}


def md_main(m: dict[str, Any]) -> list[str]:
    spread = m.get("bandwidth_samples_gb_s", {})
    bw = ", ".join(
        f"{t} thread(s) {v:.1f} GB/s"
        + (
            f" (the best of {len(spread[t])} samples taken before each round; lowest "
            f"{min(spread[t]):.1f})"
            if spread.get(t)
            else ""
        )
        for t, v in m["bandwidth_gb_s"].items()
    )
    rows = m.get("edge_kv_rows")
    edge = ", ".join(str(w) for w in m.get("edge_windows", [])[:-1])
    runs = (
        f"LiteRT-LM runs its `decode` and `prefill_<N>` signatures over 1024 rows, edge-agent "
        f"decodes in the {rows}-row window and prefills a 448-token prompt in the 512-row one"
    )
    windows = ""
    if rows and rows < 1024 and m.get("file_windows"):
        windows = f" with KV windows {edge} in the same file: {runs}"
    elif rows and rows < 1024:
        windows = f", a single-length file; edge-agent adds KV windows {edge} at load: {runs}"
    lines = [
        f"Model `{m['model']}` (SmolLM-135M shape, random weights, KV 1024){windows}. Measured "
        f"read bandwidth: {bw}. Decode: 64-token prompt, {m.get('tokens', 128)} tokens, greedy.",
        "",
        "| quant | threads | engine | decode tok/s | of ceiling | TTFT 64 (ms) | TTFT 448 (ms) "
        "| prefill 448 tok/s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in m["cells"]:
        for e in ENGINES:
            s = c.get(e)
            if s is None:
                continue
            pf = s.get("prefill448_tok_s")
            lines.append(
                f"| {c['quant']} | {c['threads']} | {NAMES[e]} | {fmt(s['decode_tok_s'], 1)} | "
                f"{100 * s['of_ceiling']:.0f}% | {fmt(s['ttft64_ms'], 0)} | "
                f"{fmt(s['ttft448_ms'], 0)} | {pf['median']:.0f} | "
                f"{s['peak_rss_mib']['median']:.0f} |"
                if pf
                else f"| {c['quant']} | {c['threads']} | {NAMES[e]} | "
                f"{fmt(s['decode_tok_s'], 1)} | {100 * s['of_ceiling']:.0f}% | "
                f"{fmt(s['ttft64_ms'], 0)} | {fmt(s['ttft448_ms'], 0)} | – | "
                f"{s['peak_rss_mib']['median']:.0f} |"
            )
    lines += [
        "",
        "Ratios are paired: the median (min–max) over rounds of the ratio within a round, so a "
        "slow spell of the machine that hits one round hits both sides of its ratio.",
        "",
        "| quant | threads | bytes/token (weights + KV) | ceiling tok/s | decode edge ÷ LiteRT-LM "
        "(≥ 1 is better) | decode gRPC ÷ in-process | TTFT 64 edge ÷ LiteRT-LM (≤ 1 is better) "
        "| TTFT 448 edge ÷ LiteRT-LM | peak RSS edge ÷ LiteRT-LM (≤ 1 is better) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in m["cells"]:
        b = c["bytes_per_token"]
        e, g, p = c["edge"], c["grpc"], c.get("litertlm")
        read = f"{b['total'] / 1e6:.1f} MB ({b['weights'] / 1e6:.1f} + {b['kv'] / 1e6:.1f})"
        ceiling = f"{c['ceiling_tok_s']:.0f}"
        if "edge_bytes_per_token" in c:
            eb = c["edge_bytes_per_token"]
            read = (
                f"edge-agent {eb['total'] / 1e6:.1f} MB (KV {eb['kv'] / 1e6:.1f}), LiteRT-LM {read}"
            )
            ceiling = f"edge-agent {c['edge_ceiling_tok_s']:.0f}, LiteRT-LM {ceiling}"

        def ratio(x: dict[str, Any], y: dict[str, Any] | None, k: str) -> str:
            if not y or k not in y:
                return "–"
            xs, ys = x.get("rounds", {}).get(k), y.get("rounds", {}).get(k)
            if not xs or not ys:  # a run saved before the rounds were kept: medians
                return f"{x[k]['median'] / y[k]['median']:.2f}x (of medians)"
            return fmt(med([a / b for a, b in zip(xs, ys, strict=True)]), 2).replace(" (", "x (")

        lines.append(
            f"| {c['quant']} | {c['threads']} | {read} | {ceiling} | "
            f"{ratio(e, p, 'decode_tok_s')} | {ratio(g, e, 'decode_tok_s')} | "
            f"{ratio(e, p, 'ttft64_ms')} | {ratio(e, p, 'ttft448_ms')} | "
            f"{ratio(e, p, 'peak_rss_mib')} |"
        )
    return lines + md_cold(m["cells"])


def md_cold(cells: list[dict[str, Any]]) -> list[str]:
    """The first load of a model: one run per cell with empty caches."""
    rows = [c for c in cells if c.get("cold", {}).get("edge") and c["cold"].get("litertlm")]
    if not rows:
        return []
    lines = [
        "",
        "First load, one run per cell with empty caches: edge-agent writes its prepared copy "
        "(composites inlined, KV windows added), packs the weights, reopens the model to map "
        "them and checks the windows; LiteRT-LM packs its weights into its cache directory. "
        "Then the same requests as above.",
        "",
        "| quant | threads | load s edge-agent / LiteRT-LM | peak RSS MiB edge-agent / "
        "LiteRT-LM | peak RSS edge ÷ LiteRT-LM |",
        "|---|---|---|---|---|",
    ]
    for c in rows:
        e, p = c["cold"]["edge"], c["cold"]["litertlm"]
        lines.append(
            f"| {c['quant']} | {c['threads']} | {e['load_s']:.1f} / {p['load_s']:.1f} | "
            f"{e['peak_rss_mib']:.0f} / {p['peak_rss_mib']:.0f} | "
            f"{e['peak_rss_mib'] / p['peak_rss_mib']:.2f}x |"
        )
    return lines


def md_windows(w: dict[str, Any]) -> list[str]:
    lines = [
        f"Model `{w['model']}`: KV 4096 with KV windows 256 and 1024 in the same file, int8, "
        f"{w['threads']} threads; {WINDOW_DECODE} tokens decoded after a prompt of "
        f"(used − {WINDOW_DECODE}) tokens, greedy.",
        "",
        "| used context | windows tok/s | single-length tok/s | LiteRT-LM tok/s | windows / "
        "single | windows / LiteRT-LM | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in w["points"]:
        win, one = p["windows"]["decode_tok_s"], p["single"]["decode_tok_s"]
        peer = p.get("litertlm", {}).get("decode_tok_s")
        vs_peer = f"{win['median'] / peer['median']:.2f}x" if peer else "–"
        same = "yes" if p["same_tokens"] else "**no**"
        lines.append(
            f"| {p['used']} | {fmt(win, 1)} | {fmt(one, 1)} | {fmt(peer, 1) if peer else '–'} | "
            f"{win['median'] / one['median']:.2f}x | {vs_peer} | {same} ({p['decoded']} tokens) |"
        )
    return lines


def md_continue(c: dict[str, Any]) -> list[str]:
    lines = [
        f"A {c['history_tokens']}-token conversation continued with a {c['turn_tokens']}-token "
        f"turn (`{c['model']}`, int8, {c['threads']} threads): time to first token.",
        "",
        "| how | TTFT (ms) |",
        "|---|---|",
        f"| edge-agent session, bound | {fmt(c['bound_ttft_ms'], 1)} |",
        f"| edge-agent session, from the disk tier after a restart | {fmt(c['disk_ttft_ms'], 1)} |",
    ]
    if "reprefill_ttft_ms" in c:
        lines += [
            f"| LiteRT-LM, re-prefilling the history ({c['reprefill_tokens']} tokens) | "
            f"{fmt(c['reprefill_ttft_ms'], 1)} |",
            f"| LiteRT-LM, its session kept alive in the process | {fmt(c['live_ttft_ms'], 1)} |",
            "",
            f"Re-prefill / edge-agent: bound "
            f"**{c['reprefill_ttft_ms']['median'] / c['bound_ttft_ms']['median']:.1f}x**, "
            f"disk tier **{c['reprefill_ttft_ms']['median'] / c['disk_ttft_ms']['median']:.1f}x**.",
        ]
    return lines


def plot(res: dict[str, Any], path: Path) -> bool:
    if not have("matplotlib"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    titles = {
        "main": "single-length file (windows added at load)",
        "main-windows": "the same with KV windows exported",
    }
    for ax, (key, title) in zip(axes, titles.items(), strict=False):
        m = res.get(key)
        if not m:
            continue
        labels = []
        for x, c in enumerate(m["cells"]):
            for i, e in enumerate(ENGINES):
                s = c.get(e)
                if s:
                    d = s["decode_tok_s"]
                    ax.bar(
                        x + i * 0.27,
                        d["median"],
                        0.27,
                        yerr=[[d["median"] - d["min"]], [d["max"] - d["median"]]],
                        color=f"C{i}",
                        label=NAMES[e] if x == 0 else None,
                    )
            ceiling = c.get("edge_ceiling_tok_s", c["ceiling_tok_s"])
            ax.hlines(ceiling, x - 0.15, x + 0.7, colors="k", linestyles="dotted")
            labels.append(f"{c['quant']}\n{c['threads']}t")
        ax.set_xticks([i + 0.27 for i in range(len(labels))], labels)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"decode, KV 1024, {title}\n(dotted: edge-agent's bandwidth ceiling)")
        ax.legend(fontsize=8)
    w = res.get("windows")
    if w:
        ax = axes[2]
        used = [p["used"] for p in w["points"]]
        for i, k in enumerate(("windows", "single", "litertlm")):
            ys = [p[k]["decode_tok_s"]["median"] for p in w["points"] if k in p]
            if ys:
                label = {"windows": "edge-agent, KV windows", "single": "edge-agent, single length"}
                ax.plot(used[: len(ys)], ys, "o-", color=f"C{i}", label=label.get(k, "LiteRT-LM"))
        ax.set_xscale("log")
        ax.set_xticks(used, [str(u) for u in used])
        ax.minorticks_off()
        ax.set_xlabel("used context (tokens) of a 4096-token model")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("decode speed by used context")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def report(res: dict[str, Any]) -> str:
    lines = [
        f"Measured on {res['machine']}, Python {res['python']}; every figure is the median "
        "(min–max) of alternating rounds (the number is given per table: 3 where the differences "
        "are far above the noise), each "
        "contender in a fresh process, loaded once, warmed up with the same request, timed "
        "where its tokens arrive: LiteRT-LM "
        f"{res.get('litert_lm_version', '(not installed)')} at the consumer of its Python "
        "API's stream, edge-agent at the consumer of `Engine.generate` or at the gRPC client. "
        "Prefill tok/s = prompt tokens / time to first token. The prompts are made once by the "
        "parent process and handed to every worker in a file, so no worker's peak RSS holds "
        "a tokenizer's work on the source tree they are cut from (before 2026-11-30 each worker "
        "made its own: 30–50 MiB more peak RSS in both engines).",
        "",
    ]
    if res["skipped"]:
        lines += ["Skipped: " + "; ".join(res["skipped"]) + ".", ""]
    sections = (
        ("main", "Against LiteRT-LM and the bandwidth ceiling", md_main),
        ("main-windows", "The same, on the file with KV windows", md_main),
        ("windows", "KV windows: decode cost follows the used context", md_windows),
        ("continue", "Continuing a conversation", md_continue),
        ("continue4096", "Continuing a 1,000-token conversation on the KV-4096 model", md_continue),
    )
    for key, title, md in sections:
        part = res.get(key)
        if not part:
            continue
        lines += [f"#### {title}", ""]
        lines += [
            f"Measured {part['date']}, {part['rounds']} rounds: `{part['command']}`.",
            "",
            *md(part),
            "",
        ]
    if res.get("plot"):
        lines += ["![decode speed](bench/peer.png)", ""]
    return "\n".join(lines).rstrip()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, action="append", help="default: 2 and 1")
    ap.add_argument("--only", choices=(*SECTIONS,), action="append")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--report-only", action="store_true", help="rewrite the docs from docs/bench/peer.json"
    )
    a = ap.parse_args()
    if a.report_only:
        saved = json.loads((ROOT / "docs" / "bench" / "peer.json").read_text())
        saved["plot"] = plot(saved, ROOT / "docs" / "bench" / "peer.png")
        write_section("peer", saved, report(saved))
        return
    a.threads = a.threads or [2, 1]
    parts = a.only or list(SECTIONS)
    skipped: list[str] = []
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "rounds": a.rounds,
        "skipped": skipped,
    }
    if have("litert_lm"):
        from importlib.metadata import version

        res["litert_lm_version"] = version("litert-lm-api")
    Runner = Callable[[argparse.Namespace, list[str]], dict[str, Any] | None]
    command = "python " + " ".join(["scripts/bench_peer.py", *sys.argv[1:]])
    runners: dict[str, Runner] = {
        "main": run_main,
        "main-windows": functools.partial(
            run_main, section="main-windows", spec=MAIN_WINDOWS_MODEL
        ),
        "windows": run_windows,
        "continue": run_continue,
        "continue4096": functools.partial(
            run_continue, section="continue4096", spec=WINDOW_MODEL, history=HISTORY_4096
        ),
    }
    saved_path = ROOT / "docs" / "bench" / "peer.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    for section, run in runners.items():
        if section in parts:
            res[section] = run(a, skipped)
            if res[section]:
                res[section].update(date=res["date"], command=command)
                res[section].setdefault("rounds", a.rounds)
        elif saved.get(section):  # --only: keep the other sections of the last run, dated
            res[section] = saved[section]
            res[section].setdefault("date", saved["date"])
            res[section].setdefault("rounds", saved["rounds"])
            res[section].setdefault("command", saved["command"])
    if res.get("main"):
        res["main"]["tokens"] = a.tokens
    for s in skipped:
        print("SKIPPED:", s)
    res["command"] = command
    print(json.dumps(res, indent=1, default=str)[:3000])
    if a.no_write:
        return
    if not have("matplotlib"):
        skipped.append("the plot: matplotlib (bench extra) is missing")
    res["plot"] = plot(res, ROOT / "docs" / "bench" / "peer.png")
    write_section("peer", json.loads(json.dumps(res, default=str)), report(res))
    print(
        "wrote docs/PERFORMANCE.md, docs/bench/peer.json" + (" and peer.png" if res["plot"] else "")
    )


if __name__ == "__main__":
    main()
