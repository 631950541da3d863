"""Constraints that would crash or balloon llguidance are refused before it compiles them, and
compiles run off the event loop: against a real daemon process over its real HTTP and gRPC
sockets, with real llguidance.

The hostile inputs are the ones that killed the daemon (SIGSEGV, a stack overflow inside
llguidance's compiler) or took 80-150 MiB each: a Lark grammar of 2,800 chained rules, a
schema of 900 nested ``$ref``→``properties`` levels, ``a{1000000}``-class regexes, a ``$ref``
cycle whose refusal dumped the library's state. Each is a 400 / INVALID_ARGUMENT in our words,
and the daemon answers the next request.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from agent.base.errors import InvalidRequest, Overloaded
from agent.constraint.limits import LIMITS, check_lark, check_pattern, check_schema, parse_schema
from agent.constraint.worker import GATE_ENV, CompileWorker
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from tests.support.daemon_harness import Daemon

CONFIG = "[limits]\nmax_active = 2\nqueue_capacity = 4\n"


def lark_chain(n: int) -> str:
    """`n` rules, each only the next one: llguidance recurses once per rule."""
    rules = [f"r{i}: r{i + 1}" for i in range(n - 1)]
    return "\n".join(["start: r0", *rules, f'r{n - 1}: "x"'])


def ref_chain(n: int, ident: str | None = None) -> dict[str, Any]:
    """`n` levels of ``$ref`` → an object whose one property refs the next. With `ident`, the
    schema is its own resource (``$id``): its refs resolve in it wherever it is embedded, as
    a tool's parameters are in the call's schema."""
    defs: dict[str, Any] = {
        str(i): {"properties": {"a": {"$ref": f"#/$defs/{i + 1}"}}} for i in range(n - 1)
    }
    defs[str(n - 1)] = {"type": "integer"}
    head = {"$id": ident} if ident else {}
    return {**head, "$ref": "#/$defs/0", "$defs": defs}


CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
BALLOONS = [  # each compiled for 0.4-1.5 s and kept 80-170 MiB, then failed at the first token
    ("regex", "a{1000000}"),
    ("regex", "((a{100}){100}){100}"),
    ("json_schema", json.dumps({"type": "string", "pattern": "^(a{1000}){1000}$"})),
    ("grammar", "start: /x{1000000}/"),
]


# ---------------------------------------------------------------- the checks, without a daemon


def refusal(fn: Any, *args: Any) -> str:
    with pytest.raises(InvalidRequest) as err:
        fn(*args)
    return str(err.value)


def test_the_limits_name_what_and_where() -> None:
    assert "2801 rule definitions; at most 1000" in refusal(check_lark, lark_chain(2800))
    message = refusal(check_schema, ref_chain(900))
    assert message.startswith("json_schema: nesting depth exceeds 64 at $.$ref(#/$defs/0)")
    embedded = {"properties": {"arguments": ref_chain(1_000, "urn:p")}}  # refs in its resource
    assert "nesting depth exceeds 64 at $.properties.arguments.$ref" in refusal(
        check_schema, embedded
    )
    assert "repetition {1000000}" in refusal(check_pattern, "a{1000000}")
    assert "over 100000 positions" in refusal(check_pattern, "((a{100}){100}){100}")
    assert "nesting exceeds 64" in refusal(check_pattern, "(" * 65 + "a" + ")" * 65)
    assert "$ref cycle at $: #/$defs/a -> #/$defs/b -> #/$defs/a" in refusal(check_schema, CYCLE)
    assert "is not in this schema" in refusal(check_schema, {"$ref": "http://example.com/s.json"})
    pattern = {"type": "object", "properties": {"k": {"type": "string", "pattern": "a{200000}"}}}
    assert "pattern at $.properties.k" in refusal(check_schema, pattern)
    embedded = "start: %json " + json.dumps(CYCLE)
    assert "grammar: %json at character 7: $ref cycle" in refusal(check_lark, embedded)
    # a 100k-deep JSON text is refused before json.loads could recurse into it
    assert "JSON nesting exceeds 128" in refusal(parse_schema, "[" * 100_000 + "]" * 100_000)


def test_what_real_constraints_use_passes() -> None:
    check_pattern(r"[a-z]{1,6} [a-z]{1,6}|\d{3}-\d{4}|[{}]{2}")
    check_lark(lark_chain(LIMITS.max_rules - 1))
    check_lark('start: item ~ 2..5\nitem: /[a-z]{1,20}/ "," | ("(" [item] ")")\n')
    tree = {  # a recursive schema: recursion is a rule for llguidance, not an unfolding
        "$defs": {"n": {"type": "object", "properties": {"c": {"items": {"$ref": "#/$defs/n"}}}}},
        "$ref": "#/$defs/n",
    }
    check_schema(tree)
    check_schema(ref_chain(LIMITS.max_schema_depth // 2))


def test_a_compile_past_its_deadline_is_refused_and_the_worker_goes_on() -> None:
    worker = CompileWorker(queue_max=1)
    started, release = threading.Event(), threading.Event()

    def held() -> None:
        started.set()
        release.wait()

    with pytest.raises(InvalidRequest, match=r"regex \(3 characters\) did not compile within"):
        worker.run(held, timeout=0.05, what="regex (3 characters)")
    started.wait()  # the worker runs it, so the queue is empty
    with pytest.raises(InvalidRequest, match="did not compile within"):
        worker.run(lambda: None, timeout=0.01)  # queued behind it: the queue is full now
    with pytest.raises(Overloaded, match="waiting to be compiled"):
        worker.run(lambda: None, timeout=0.01)
    release.set()
    worker.drain()
    assert worker.run(lambda: 42) == 42
    assert worker.run(lambda: threading.current_thread().name) == "edge-agent-constraints"


class _Bytes:
    """A 256-byte vocabulary and EOS, what llguidance's TokenizerWrapper reads."""

    tokens = [bytes([i]) for i in range(256)] + [b""]
    eos_token_id = 256
    bos_token_id = None
    special_token_ids = (256,)

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


def test_the_worker_has_the_big_stack_the_limits_rely_on() -> None:
    """A chain past the main thread's crash depth (~2,650 rules on 8 MiB) compiles on the
    worker: it has its 64 MiB stack (crash there: ~21,300), the margin the rule limit of 1,000
    relies on. Not a daemon: if this is wrong it is the test process that dies."""
    import llguidance as llg

    lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), n_vocab=257)
    grammar = llg.LLMatcher.grammar_from_lark(lark_chain(2_800))
    worker = CompileWorker()
    assert worker.run(lambda: llg.LLMatcher(lltok, grammar, log_level=0).is_error()) is False


# ---------------------------------------------------------------- through a real daemon


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("constraint-safety")
    d = Daemon(tmp, tiny_model_dir, CONFIG, args=("--http", str(tmp / "h.sock")))
    d.http = tmp / "h.sock"  # type: ignore[attr-defined]
    yield d
    assert d.stop() == 0, d.read_log()


def post(d: Daemon, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    transport = httpx.HTTPTransport(uds=str(d.http))  # type: ignore[attr-defined]
    with httpx.Client(transport=transport, timeout=120) as c:
        return c.post(f"http://localhost{path}", json=body)


def grpc_generate(d: Daemon, **kw: Any) -> grpc.RpcError | pb.GenerateResponse:
    kw.setdefault("chat", pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")]))
    kw.setdefault("max_tokens", 4)
    client = d.client(timeout=120)
    try:
        messages = list(client.stream(pb.GenerateRequest(**kw)))
        return messages[-1]
    except grpc.RpcError as exc:
        return exc
    finally:
        client.close()


def status(d: Daemon) -> dict[str, int]:
    client = d.client(timeout=30)
    try:
        return {k: int(v) for k, v in client.status().items() if str(v).isdigit()}
    finally:
        client.close()


def still_serving(d: Daemon) -> None:
    """The daemon is alive and a follow-up constrained request on each API succeeds."""
    assert d.proc.poll() is None, d.read_log()[-3000:]
    r = post(
        d,
        {
            "messages": [{"role": "user", "content": "two words:"}],
            "max_tokens": 12,
            "temperature": 0,
            "response_format": {"type": "regex", "regex": "[a-z]{1,5}"},
        },
    )
    assert r.status_code == 200, r.text
    out = grpc_generate(d, constraint=pb.Constraint(regex="[a-z]{1,5}"), max_tokens=8)
    assert isinstance(out, pb.GenerateResponse), out


def http_body(route: str, kind: str, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    if route == "tools":
        params = json.loads(text)
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        body["tool_choice"] = "required"
    elif kind == "json_schema":
        schema = json.loads(text)
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema},
        }
    else:
        body["response_format"] = {"type": kind, kind: text}
    return body


def grpc_kw(route: str, kind: str, text: str) -> dict[str, Any]:
    if route == "tools":
        return {"tools": [pb.Tool(name="f", parameters=text)], "tool_choice": "required"}
    return {"constraint": pb.Constraint(**{kind: text})}


# the refs of a tool's parameters resolve in the call's schema, where they sit under arguments
CRASHERS = [
    ("response_format", "grammar", lark_chain(2_800), "2801 rule definitions; at most 1000"),
    ("response_format", "json_schema", json.dumps(ref_chain(900)), "nesting depth exceeds 64"),
    ("tools", "json_schema", json.dumps(ref_chain(1_000, "urn:p")), "nesting depth exceeds 64"),
]


@pytest.mark.parametrize("api", ["http", "grpc"])
@pytest.mark.parametrize(("route", "kind", "text", "words"), CRASHERS, ids=["lark", "ref", "tools"])
def test_what_crashed_the_daemon_is_refused_naming_the_limit(
    daemon: Daemon, api: str, route: str, kind: str, text: str, words: str
) -> None:
    if api == "http":
        r = post(daemon, http_body(route, kind, text))
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"], r.text
    else:
        err = grpc_generate(daemon, **grpc_kw(route, kind, text))
        assert isinstance(err, grpc.RpcError), err
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert words in (err.details() or ""), err.details()
    still_serving(daemon)


def test_a_ref_cycle_is_one_line_in_our_words(daemon: Daemon) -> None:
    r = post(daemon, http_body("response_format", "json_schema", json.dumps(CYCLE)))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "$ref cycle" in message and "never reaches a value" in message, message
    for internal in ("<state>", "Parser:", "NoExtensionBias", "\n"):
        assert internal not in message
    err = grpc_generate(daemon, constraint=pb.Constraint(json_schema=json.dumps(CYCLE)))
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "$ref cycle" in (err.details() or "") and "<state>" not in (err.details() or "")


def test_a_deep_grpc_schema_is_invalid_argument_not_unknown(daemon: Daemon) -> None:
    deep = "[" * 30_000 + "]" * 30_000  # under the 64 KiB limit; json.loads gave up at ~1,000
    for kw in (grpc_kw("tools", "", deep), grpc_kw("", "json_schema", deep)):
        err = grpc_generate(daemon, **kw)
        assert isinstance(err, grpc.RpcError), err
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert "JSON nesting exceeds 128" in (err.details() or "")
    still_serving(daemon)


def test_a_constraint_failing_while_it_generates_is_one_line_not_a_traceback(
    daemon: Daemon,
) -> None:
    """The tiny model has no ``{`` piece: after two letters this grammar forces one, which
    only shows while generating. The request ends with ERROR naming the character, the
    daemon logs one line for it (it logged a traceback: an engine bug's treatment), HTTP
    answers 400 (it was a 500), and the daemon goes on serving."""
    since = len(daemon.read_log())
    last = grpc_generate(daemon, constraint=pb.Constraint(regex=r"[a-z]{2}\{"), max_tokens=12)
    assert isinstance(last, pb.GenerateResponse), last
    assert last.finish_reason == pb.FINISH_REASON_ERROR, last
    assert "constraint: the grammar needs '{' next" in last.error, last.error
    log = daemon.read_log()[since:]
    assert "failed: constraint: the grammar needs '{' next" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    r = post(daemon, http_body("response_format", "regex", r"[a-z]{2}\{"))
    assert r.status_code == 400, r.text  # the request's fault: it was a 500
    assert "the grammar needs '{' next" in r.json()["error"]["message"], r.text
    # streamed: the 200 has gone out, so the error is the last event, typed as the client's
    streamed = post(daemon, {**http_body("response_format", "regex", r"[a-z]{2}\{"),
                             "stream": True})  # fmt: skip
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert events and events[-1]["error"]["type"] == "invalid_request_error", streamed.text
    assert "the grammar needs '{' next" in events[-1]["error"]["message"]
    still_serving(daemon)


def test_balloons_are_refused_and_twelve_of_them_keep_rss_flat(daemon: Daemon) -> None:
    """Twelve a{1000000}-class requests: refused before compiling, so RSS stays within a
    bound (they took it from 404 MiB to 2.09 GiB when each was compiled and cached)."""
    before = status(daemon)["rss_bytes"]
    for i in range(12):
        kind, text = BALLOONS[i % len(BALLOONS)]
        r = post(daemon, http_body("response_format", kind, text))
        assert r.status_code == 400, r.text
        assert "bounded repetitions multiplied out" in r.json()["error"]["message"], r.text
    grown = status(daemon)["rss_bytes"] - before
    assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB"  # one such compile took 80+
    still_serving(daemon)


# ---------------------------------------------------------------- compiles off the event loop


@pytest.fixture
def gated(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    """A daemon whose compiles wait at a FIFO the test writes to (fault injection)."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    d = Daemon(
        tmp_path,
        tiny_model_dir,
        CONFIG,
        env={GATE_ENV: str(gate)},
        args=("--http", str(tmp_path / "h.sock")),
    )
    d.http = tmp_path / "h.sock"  # type: ignore[attr-defined]
    yield d, gate
    assert d.stop() == 0, d.read_log()


def answers_while_held(d: Daemon, since: int) -> int:
    """Once a compile waits at the gate (an event: the daemon logs it), HTTP /health, gRPC
    health and GetStatus answer; where the log line ended."""
    at = d.wait_log("constraint compile waiting at the test gate", timeout=60, since=since)
    transport = httpx.HTTPTransport(uds=str(d.http))  # type: ignore[attr-defined]
    with httpx.Client(transport=transport, timeout=30) as c:
        assert c.get("http://localhost/health").status_code == 200
    client = d.client(timeout=30)
    try:
        assert client.health() == "SERVING"
        assert client.status()["active_requests"] == 0  # the compile holds no engine slot
    finally:
        client.close()
    return at


def release(gate: Path) -> None:
    with open(gate, "wb") as f:
        f.write(b"x")


def test_health_answers_while_a_constraint_compiles(gated: tuple[Daemon, Path]) -> None:
    """A compile held in progress (the gate) over gRPC, then over HTTP: the daemon answers
    health and status meanwhile, and each request completes once its compile goes on. On the
    event loop, the compile held every other call."""
    d, gate = gated
    results: dict[str, Any] = {}

    def over_grpc() -> None:
        results["grpc"] = grpc_generate(d, constraint=pb.Constraint(regex="[a-z]{1,4}"))

    def over_http() -> None:
        results["http"] = post(d, http_body("response_format", "regex", "[a-z]{1,5}"))

    since = 0
    for run in (over_grpc, over_http):
        caller = threading.Thread(target=run)
        caller.start()
        since = answers_while_held(d, since)
        assert caller.is_alive()  # still at the gate: the answers came while it compiled
        release(gate)
        caller.join(60)
    assert isinstance(results["grpc"], pb.GenerateResponse), results["grpc"]
    assert results["http"].status_code == 200, results["http"].text
