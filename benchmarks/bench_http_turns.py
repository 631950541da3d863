#!/usr/bin/env python3
"""A stateless OpenAI client against a gRPC session: time to first token of turn 10.

An OpenAI-SDK app resends the whole conversation every turn; a gRPC client with a session
sends only the new message. The shared-prefix cache should make the first cost about what the
second does (issue 24: turn 10's time to first token over HTTP ≤ 1.2x the session's). One real
`edge-agent run` serves both; each conversation is new (its first message names it, so
nothing is reused across them), greedy, `REPLY` tokens per reply:

* gRPC session: CreateSession, then each turn only its user message with `session_id`;
* HTTP stateless: `POST /v1/chat/completions` with every message so far (the assistant's
  replies as the daemon wrote them), streamed through the official `openai` SDK over the unix
  socket;
* gRPC stateless (reference): the same whole conversation without a session, over gRPC.

Time to first token is the engine's (its log line per request: transport costs are not in it)
and the client's (request sent → first text). Writes docs/bench/http-turns[-<model>].json and
a section of docs/PERFORMANCE.md.

    python benchmarks/bench_http_turns.py [--model DIR] [--rounds 3]
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

import httpx  # noqa: E402
import openai  # noqa: E402

from agent.api.grpc.client import build_request  # noqa: E402
from agent.model.directory import demo_model_dir  # noqa: E402
from benchmarks._report import bench_args, fmt, med, section_name, write_section  # noqa: E402
from tests.support.daemon_harness import Daemon  # noqa: E402

TURNS = 10
REPLY = 24  # tokens per reply
LINES = [
    "def parse(path):",
    "now make it return a list of rows",
    "skip the empty lines",
    "and strip each field",
    "raise ValueError on a short row",
    "add a docstring",
    "make the separator a parameter",
    "use a generator instead",
    "add type hints",
    "write a test for it",
]


def _user(conversation: int, turn: int) -> str:
    text = LINES[turn]
    return f"# conversation {conversation}\n{text}" if turn == 0 else text


def _engine_ttft(d: Daemon, rid: str) -> float:
    """The engine's time to first token for request `rid`, from its log line."""
    for _ in range(200):
        m = re.search(rf"request {rid} \w+: \d+\+\d+ tokens, ttft ([\d.]+) ms", d.read_log())
        if m:
            return float(m.group(1))
        time.sleep(0.01)
    raise RuntimeError(f"no log line for {rid}")


def _grpc_turn(
    d: Daemon, chat: list[tuple[str, str]], session: str | None
) -> tuple[str, dict[str, Any]]:
    req = build_request(
        None,
        chat,
        max_tokens=REPLY,
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=None,
        stop=[],
        session=session,
    )
    t0 = time.perf_counter()
    first = None
    text = []
    last = None
    for m in d.client().stream(req):
        if first is None:  # the first token (its text may be empty on a random model)
            first = time.perf_counter() - t0
        text.append(m.text)
        last = m
    assert last is not None and first is not None
    return "".join(text), {
        "client_ms": first * 1000,
        "engine_ms": last.stats.ttft_ms,
        "cached": last.stats.cached_tokens,
        "prompt": last.stats.prompt_tokens,
    }


def _http_turn(d: Daemon, c: openai.OpenAI, messages: list[Any]) -> tuple[str, dict[str, Any]]:
    t0 = time.perf_counter()
    first = None
    text = []
    rid = ""
    usage = None
    for ch in c.chat.completions.create(
        model="local",
        messages=messages,
        max_tokens=REPLY,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        rid = ch.id.removeprefix("chatcmpl-")
        if ch.choices and (ch.choices[0].delta.content or ch.choices[0].finish_reason):
            if first is None:  # not the role chunk, which goes out before any token
                first = time.perf_counter() - t0
            text.append(ch.choices[0].delta.content or "")
        if ch.usage is not None:
            usage = ch.usage
    assert first is not None and usage is not None and usage.prompt_tokens_details is not None
    return "".join(text), {
        "client_ms": first * 1000,
        "engine_ms": _engine_ttft(d, rid),
        "cached": usage.prompt_tokens_details.cached_tokens,
        "prompt": usage.prompt_tokens,
    }


def run(model: Path, rounds: int, profile: str) -> dict[str, list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(Path(tmp), model, "[limits]\nmax_sessions = 16\n", profile=profile)
        try:
            http = openai.OpenAI(
                base_url="http://localhost/v1",
                api_key="x",
                http_client=httpx.Client(
                    transport=httpx.HTTPTransport(uds=str(d.socket.with_name("agent-http.sock")))
                ),
                max_retries=0,
            )
            out: dict[str, list[dict[str, Any]]] = {"session": [], "http": [], "grpc": []}
            for r in range(rounds):
                sid = d.client().create_session()  # gRPC session: the new message only
                for t in range(TURNS):
                    _, m = _grpc_turn(d, [("user", _user(r, t))], sid)
                out["session"].append(m)
                messages: list[dict[str, str]] = []  # HTTP stateless: everything, every turn
                for t in range(TURNS):
                    messages.append({"role": "user", "content": _user(r + 1000, t)})
                    reply, m = _http_turn(d, http, messages)
                    messages.append({"role": "assistant", "content": reply})
                out["http"].append(m)
                chat: list[tuple[str, str]] = []  # gRPC stateless: is HTTP's transport in it?
                for t in range(TURNS):
                    chat.append(("user", _user(r + 2000, t)))
                    reply, m = _grpc_turn(d, chat, None)
                    chat.append(("assistant", reply))
                out["grpc"].append(m)
            return out
        finally:
            d.stop()


def main() -> int:
    args = bench_args(__doc__)
    model = Path(args.model) if args.model else demo_model_dir()
    rounds = min(args.rounds, 5)
    out = run(model, rounds, args.profile or "generic-x86_64")
    rows = []
    summary: dict[str, Any] = {"model": model.name, "turns": TURNS, "reply_tokens": REPLY}
    labels = {
        "session": "gRPC session (the new message only)",
        "http": "HTTP stateless, openai SDK (the whole conversation)",
        "grpc": "gRPC stateless (the whole conversation)",
    }
    for name, label in labels.items():
        ms = out[name]
        eng = med([m["engine_ms"] for m in ms])
        cli = med([m["client_ms"] for m in ms])
        summary[name] = {"engine_ttft_ms": eng, "client_ttft_ms": cli, "turn10": ms}
        rows.append(
            f"| {label} | {ms[0]['prompt']} | {ms[0]['cached']} | {fmt(eng, 1)} | {fmt(cli, 1)} |"
        )
    s, h = summary["session"], summary["http"]
    ratio = h["engine_ttft_ms"]["median"] / s["engine_ttft_ms"]["median"]
    ratio_client = h["client_ttft_ms"]["median"] / s["client_ttft_ms"]["median"]
    summary["ratio_engine"], summary["ratio_client"] = ratio, ratio_client
    body = "\n".join(
        [
            f"### Turn {TURNS} of a conversation: stateless HTTP against a gRPC session",
            "",
            f"`benchmarks/bench_http_turns.py` on `{model.name}`: {rounds} conversations of "
            f"{TURNS} turns, greedy, {REPLY} tokens per reply; time to first token of turn "
            f"{TURNS}, median (min–max). Prompt and cached tokens: turn {TURNS} of the first "
            "conversation (the session's prompt is its whole history, its cache the KV kept).",
            "",
            "| client | prompt tokens | cached | engine TTFT (ms) | client TTFT (ms) |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
            f"**HTTP stateless / session: {ratio:.2f}x** the engine's time to first token "
            f"({ratio_client:.2f}x as the clients see it; goal ≤ 1.2x).",
            "",
            "A stateless turn takes the free KV cache its previous turn left behind, whose "
            "rows hold that turn's prompt and reply (`cached`: the longest common start with "
            "the resent conversation), and prefills only the rest: the reply's end as the "
            "client resent it and the new message; a session prefills only the new message. "
            "When another request has taken that cache, the shared-prefix cache's whole "
            "32-token blocks are the fallback. Where `cached` falls a reply short of the "
            "session's, the chat template renders the resent reply otherwise than the model "
            "wrote it (the demo's raw `# {system}\\n{user}` template puts a separator before it "
            "that its generation prompt does not end with), so that reply is prefilled again. "
            "HTTP and gRPC stateless cost the engine the same tokens. The client's time over "
            "HTTP runs to the first chunk with text (SSE chunks "
            "carry no "
            "token ids): on a random-weight model whose first tokens decode to no text, that is "
            "later than the first token.",
        ]
    )
    print(body)
    if not args.no_write:
        write_section(section_name("http-turns", args), summary, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
