"""The OpenAI-compatible HTTP API against a real daemon process on the tiny model: the official
`openai` SDK over the unix socket (httpx's UDS transport) and over loopback TCP, `curl
--unix-socket`, streaming and not; greedy output equal to gRPC's for the same request; bad
input → OpenAI's error JSON with the right status, and the daemon keeps serving; 8 concurrent
streams; a disconnect mid-stream frees the slot; a full queue → 429 with Retry-After; the
bearer key (401 / 200)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agent.api.grpc.client import build_request
from agent.base.errors import ConfigError
from agent.config.file import AgentConfig, HttpConfig, http_socket, parse_config
from agent.daemon.plan import Overrides, apply_overrides
from agent.model.directory import demo_model_dir
from tests.support.daemon_harness import Daemon
from tests.support.endless import endless_model_dir
from tests.support.paths import ROOT

CONFIG = "[watchdog]\ntick_s = 0.2\n[limits]\nmax_active = 8\nqueue_capacity = 8\n"


def http_client(path: Path, **kw: Any) -> openai.OpenAI:
    """The openai SDK over a unix socket, exactly as docs/API.md shows it."""
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key=kw.pop("api_key", "x"),
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(path))),
        max_retries=0,
        **kw,
    )


def raw(path: Path, method: str, url: str, **kw: Any) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), timeout=60) as c:
        return c.request(method, f"http://localhost{url}", **kw)


def tcp_address(d: Daemon) -> str:
    deadline = time.monotonic() + 30  # a safety net: the line comes with READY
    while time.monotonic() < deadline:
        m = re.search(r"http: OpenAI-compatible API on [^\n]*?(127\.0\.0\.1:\d+)", d.read_log())
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError("no TCP address in the log:\n" + d.read_log())


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("http"), tiny_model_dir, CONFIG, args=("--http", "127.0.0.1:0")
    )
    yield d
    assert d.stop() == 0, d.read_log()


@pytest.fixture(scope="module")
def sock(daemon: Daemon) -> Path:
    path = daemon.socket.with_name("agent-http.sock")
    assert path.is_socket()
    assert path.stat().st_mode & 0o777 == 0o660  # the gRPC socket's mode
    return path


def grpc_greedy(d: Daemon, **kw: Any) -> str:
    """The reference: the same engine through gRPC (the project's own client)."""
    r = build_request(
        kw.get("prompt"),
        kw.get("messages"),
        max_tokens=kw["n"],
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=None,
        stop=[],
    )
    return d.client().generate(r).text


MESSAGES = [("system", "be brief"), ("user", "def f(x):")]


def test_chat_over_the_unix_socket_equals_grpc(daemon: Daemon, sock: Path) -> None:
    c = http_client(sock)
    r = c.chat.completions.create(
        model="tiny",
        messages=[{"role": a, "content": b} for a, b in MESSAGES],
        max_tokens=12,
        temperature=0,
        extra_body={"an_unknown_field": {"is": "ignored"}},
    )
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None
    assert choice.message.content == grpc_greedy(daemon, messages=MESSAGES, n=12)


def test_chat_stream_over_tcp_equals_the_whole_response(daemon: Daemon, sock: Path) -> None:
    c = openai.OpenAI(base_url=f"http://{tcp_address(daemon)}/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "x = 1\n"}]
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=100,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 100
    # streamed, not one blob (tokens that queue up while a chunk is written go out together)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2
    whole = c.chat.completions.create(
        model="tiny",
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=100,
        temperature=0,
    )
    assert text == whole.choices[0].message.content
    assert text == grpc_greedy(daemon, messages=[("user", "x = 1\n")], n=100)


def test_completions_stream_and_not(daemon: Daemon, sock: Path) -> None:
    c = http_client(sock)
    whole = c.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    parts = list(
        c.completions.create(
            model="tiny", prompt="def f(x):", max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert whole.choices[0].text == grpc_greedy(daemon, prompt="def f(x):", n=10)
    # stop: the text ends before the stop string, as gRPC's does
    stop = whole.choices[0].text[3:5]
    if stop.strip():
        cut = c.completions.create(
            model="tiny", prompt="def f(x):", max_tokens=10, temperature=0, stop=[stop]
        )
        assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


def test_models_and_health(daemon: Daemon, sock: Path) -> None:
    c = http_client(sock)
    models = c.models.list().data
    assert [m.id for m in models] == [daemon.client().info()["name"]]
    h = raw(sock, "GET", "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    missing = raw(sock, "GET", "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_curl_over_the_unix_socket(sock: Path) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    out = subprocess.run(
        [
            curl,
            "-sS",
            "--unix-socket",
            str(sock),
            "http://localhost/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    reply = json.loads(out.stdout)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "allowed"),
        ({"max_tokens": "many"}, "max_tokens", "integer"),
        ({"max_tokens": 10**9}, "max_tokens", "limit"),
        ({"temperature": True}, "temperature", "number"),
        ({"n": 2}, "n", "one choice"),
        ({"stop": [1]}, "stop", "string"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "name"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "allowed"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, "text"),
    ],
)
def test_bad_requests_are_400_with_openai_errors(
    daemon: Daemon, sock: Path, body: dict[str, Any], param: str | None, fragment: str
) -> None:
    full = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body}
    r = raw(sock, "POST", "/v1/chat/completions", json=full)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and fragment in err["message"]
    if param is not None:
        assert err["param"] == param
    # the SDK sees the same as a typed error, and the daemon goes on serving
    c = http_client(sock)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(**full)
    ok = c.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_engine_errors_and_bad_json(daemon: Daemon, sock: Path) -> None:
    r = raw(
        sock,
        "POST",
        "/v1/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},  # else a 415 (agent.api.http.body)
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    long = "word " * 4000  # beyond the tiny model's context
    r = raw(sock, "POST", "/v1/completions", json={"prompt": long, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = raw(sock, "POST", "/v1/completions", json={"prompt": "x", "top_p": 5})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    # an unknown session is the engine's NotFound
    r = raw(
        sock,
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "session": "nope"},
    )
    assert r.status_code == 404, r.text


def test_eight_concurrent_streams_all_complete(daemon: Daemon, sock: Path) -> None:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            c = http_client(sock)
            stream = c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"item {i}:"}],
                max_tokens=30,
                temperature=0,
                stream=True,
            )
            finish = None
            for ch in stream:
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
            results[i] = str(finish)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    assert set(results.values()) <= {"stop", "length"}


def _active(d: Daemon) -> int:
    return int(d.client().status()["active_requests"])


def _wait_idle(d: Daemon, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _active(d) == 0:
            return
        time.sleep(0.01)
    raise AssertionError("a request is still running")


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    """One running request and one queued at most, on the demo model without its stop token
    (tests/support/endless.py: 900 tokens take about a second here, and no sampled EOS ends them
    sooner: long enough to hang up in the middle)."""
    tmp = tmp_path_factory.mktemp("one-slot")
    path = tmp / "h.sock"
    d = Daemon(
        tmp,
        endless_model_dir(tmp / "model"),
        "[limits]\nmax_active = 1\nqueue_capacity = 1\n",
        args=("--http", str(path)),
    )
    yield d, path
    assert d.stop() == 0, d.read_log()
    assert not path.exists()  # removed at shutdown


@pytest.fixture(scope="module")
def demo_sock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The demo model as shipped (its EOS ends a constrained answer)."""
    tmp = tmp_path_factory.mktemp("demo-http")
    path = tmp / "h.sock"
    d = Daemon(tmp, demo_model_dir(), "", args=("--http", str(path)))
    yield path
    assert d.stop() == 0, d.read_log()


LONG = {"model": "demo", "prompt": "import os\n", "max_tokens": 900, "temperature": 1.0, "seed": 3}


def test_disconnect_mid_stream_cancels_and_frees_the_slot(one_slot: tuple[Daemon, Path]) -> None:
    d, path = one_slot
    c = http_client(path)
    stream = c.completions.create(**LONG, stream=True)  # type: ignore[call-overload]
    it = iter(stream)
    next(it)
    assert _active(d) == 1
    stream.close()  # the SDK hangs up
    _wait_idle(d)
    log = d.read_log()
    assert "stream closed early; cancelled" in log
    cut = re.search(r"request r\d+ cancelled: \d+\+(\d+) tokens", log)
    assert cut is not None and int(cut.group(1)) < LONG["max_tokens"], log  # stopped early
    # a whole (non-streamed) response whose client hangs up is cancelled too
    body = json.dumps(LONG).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 10
        while _active(d) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _active(d) == 1
    _wait_idle(d)
    assert "client disconnected; cancelled" in d.read_log()
    # the one slot is free: the next request runs
    ok = c.completions.create(model="demo", prompt="x", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_full_queue_is_429_with_retry_after(one_slot: tuple[Daemon, Path]) -> None:
    d, path = one_slot
    c = http_client(path)
    running = c.completions.create(**LONG, stream=True)  # type: ignore[call-overload]
    next(iter(running))
    queued = c.completions.create(**LONG, stream=True)  # type: ignore[call-overload]
    try:
        r = raw(path, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model="demo", prompt="x", max_tokens=2)
    finally:
        running.close()
        queued.close()
    _wait_idle(d)
    assert c.completions.create(model="demo", prompt="x", max_tokens=2).choices


def test_bearer_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    key = tmp_path / "http.key"
    key.write_text("s3cret-key\n")
    d = Daemon(tmp_path, tiny_model_dir, f'[http]\nkey_file = "{key}"\n')
    try:
        path = d.socket.with_name("agent-http.sock")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}):
            r = raw(path, "GET", "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            http_client(path, api_key="wrong").models.list()
        good = http_client(path, api_key="s3cret-key")
        assert good.models.list().data
        r = good.chat.completions.create(
            model="t", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        assert d.stop() == 0, d.read_log()


def _doc_blocks(lang: str) -> list[str]:
    """The fenced `lang` blocks of docs/API.md that follow a "tested" marker."""
    doc = (ROOT / "docs" / "API.md").read_text()
    pattern = rf"<!-- tested: test_http\.py[^>]*-->\n```{lang}\n(.*?)```"
    return re.findall(pattern, doc, re.S)


def test_the_docs_examples_run_verbatim(sock: Path) -> None:
    """docs/API.md's curl and openai-SDK examples, with this daemon's socket for the default."""
    default = "/run/edge-agent/agent-http.sock"
    (curl,) = _doc_blocks("sh")
    (python,) = _doc_blocks("python")
    assert default in curl and default in python
    if shutil.which("curl"):
        out = subprocess.run(
            ["sh", "-c", curl.replace(default, str(sock))],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert json.loads(out.stdout)["object"] == "chat.completion"
    out = subprocess.run(
        [sys.executable, "-c", python.replace(default, str(sock))],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "completion_tokens=" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "listen, allow, want",
    [
        ("off", False, HttpConfig(False)),
        ("/srv/h.sock", False, HttpConfig(True, Path("/srv/h.sock"))),
        ("127.0.0.1:0", False, HttpConfig(True, None, "127.0.0.1:0")),
        ("[::1]:8080", False, HttpConfig(True, None, "[::1]:8080")),
        ("0.0.0.0:8080", True, HttpConfig(True, None, "0.0.0.0:8080")),
    ],
)
def test_http_listen_config(listen: str, allow: bool, want: HttpConfig) -> None:
    data = {"http": {"listen": listen}, "server": {"allow_remote_tcp": allow}}
    assert parse_config(data, "t.toml").http == want
    over = apply_overrides(
        parse_config({"server": {"allow_remote_tcp": allow}}, "t"), Overrides(http=listen)
    )
    assert over.http == want


@pytest.mark.parametrize(
    "table, fragment",
    [
        ({"listen": "0.0.0.0:8080"}, "allow_remote_tcp"),
        ({"listen": "h.sock"}, "absolute unix socket path"),
        ({"listen": "localhost:80"}, "literal IP"),
        ({"key_file": "http.key"}, "absolute path"),
        ({"port": 80}, "port"),
    ],
)
def test_http_config_errors_name_the_key(table: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"http": table}, "t.toml")
    assert "http." in str(err.value) and fragment in str(err.value)


def test_the_default_http_socket_is_beside_the_grpc_one() -> None:
    assert http_socket(AgentConfig()) == Path("/run/edge-agent/agent-http.sock")
    cfg = parse_config({"server": {"socket": "/tmp/x/a.sock"}}, "t")
    assert http_socket(cfg) == Path("/tmp/x/a-http.sock")


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def _valid_or_cut(text: str, finish: str | None, check: Any) -> None:
    if finish == "stop":
        check(json.loads(text))
    else:  # cut off by max_tokens before the JSON closed: said so, never passed off as valid
        assert finish == "length"
        with pytest.raises(ValueError):
            json.loads(text)


def _is_object(value: Any) -> None:
    assert isinstance(value, dict)


def test_response_format_is_valid_by_construction(demo_sock: Path) -> None:
    """response_format → the engine's constraint: the output is what the schema allows,
    checked by jsonschema (outside our code). On the demo model: a bounded schema ends."""
    jsonschema = pytest.importorskip("jsonschema")
    c = http_client(demo_sock)
    for temperature in (0.0, 1.0):
        r = c.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "a record:"}],
            max_tokens=200,
            temperature=temperature,
            seed=7,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "record", "schema": SCHEMA, "strict": True},
            },
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
    streamed = c.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "a record:"}],
        max_tokens=200,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
    )
    chunks = [ch for ch in streamed if ch.choices]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    _valid_or_cut(
        text, chunks[-1].choices[0].finish_reason, lambda v: jsonschema.validate(v, SCHEMA)
    )
    anything = c.completions.create(
        model="demo",
        prompt="data = ",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    choice = anything.choices[0]
    _valid_or_cut(choice.text, choice.finish_reason, _is_object)
    bad = raw(
        demo_sock,
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": []}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema"


def test_response_format_on_the_sentencepiece_tiny_model(sock: Path) -> None:
    """The same check against the tiny model (SentencePiece, no ``{``/``[`` piece and no byte
    fallback): a schema its vocabulary spells is valid by construction (jsonschema), and
    json_object, which it cannot start, is a 400 naming the missing ``{``, not a 200 with an
    empty "error" answer; the daemon keeps serving."""
    jsonschema = pytest.importorskip("jsonschema")
    c = http_client(sock)
    schema = {"anyOf": [{"type": "string", "maxLength": 12}, {"enum": ["self", "def"]}]}
    for temperature in (0.0, 1.0):
        r = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a word:"}],
            max_tokens=40,
            temperature=temperature,
            seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a record:"}],
            max_tokens=20,
            response_format={"type": "json_object"},
        )
    assert err.value.status_code == 400 and "needs '{' next" in str(err.value), err.value
    after = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert after.choices[0].finish_reason in ("stop", "length")


def test_response_format_regex_and_grammar_extensions(sock: Path) -> None:
    """The regex and grammar extensions of response_format: the text is what Python's `re`
    (outside our code) says the pattern matches — on the SentencePiece tiny model, with the
    space LiteRT-LM's #3510 could never emit — a Lark grammar's sentence, and a bad pattern is
    a 400 naming the field while the daemon keeps serving."""
    c = http_client(sock)
    pattern = r"[a-z]{1,6} [a-z]{1,6}"
    for temperature in (0.0, 1.0):
        r = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "two words:"}],
            max_tokens=30,
            temperature=temperature,
            seed=5,
            extra_body={"response_format": {"type": "regex", "regex": pattern}},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert re.fullmatch(pattern, r.choices[0].message.content or ""), r.choices[0]
    r = c.completions.create(
        model="tiny",
        prompt="answer:",
        max_tokens=10,
        extra_body={"response_format": {"type": "grammar", "grammar": 'start: "yes" | "no"'}},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text in ("yes", "no"), r
    bad = raw(
        sock,
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "regex", "regex": "[a-"},
        },
    )
    assert bad.status_code == 400 and "regex" in bad.text, bad.text
    missing = raw(
        sock,
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex"}},
    )
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "response_format.regex", missing.text
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text is not None


def test_metrics_count_http_requests(daemon: Daemon, sock: Path) -> None:
    """GET /metrics on the HTTP listener: the Prometheus text parses, and HTTP requests are
    counted by outcome beside gRPC's."""
    from prometheus_client.parser import text_string_to_metric_families

    c = http_client(sock)
    done = c.completions.create(model="tiny", prompt="x", max_tokens=2, seed=1)
    assert raw(sock, "POST", "/v1/completions", json={"prompt": 1}).status_code == 400
    r = raw(sock, "GET", "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]
    http_done = [
        s
        for s in samples
        if s.name == "edge_agent_requests_total" and s.labels.get("api") == "http"
    ]
    outcome = done.choices[0].finish_reason  # "length", or "stop" if the model drew its EOS
    assert sum(s.value for s in http_done if s.labels["outcome"] == outcome) >= 1
    assert any(s.labels["outcome"] == "refused" and s.value >= 1 for s in http_done)


def test_ollama_stream_disconnect_frees_the_slot_and_a_full_queue_is_429(
    one_slot: tuple[Daemon, Path],
) -> None:
    """Ollama's API (agent.api.http.ollama) shares the request path: a client hanging up
    mid-stream cancels its request, and a full queue is a 429 in Ollama's error shape."""
    import ollama  # the Ollama client, only here (tests/unit/api/test_ollama.py: the rest)

    d, path = one_slot
    name = raw(path, "GET", "/v1/models").json()["data"][0]["id"]
    body = {"model": name, "prompt": "import os\n", "raw": True}
    options = {"num_predict": 900, "temperature": 1.0, "seed": 3}
    c = ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(path)))
    running = c.generate(**body, options=options, stream=True)
    next(running)
    assert _active(d) == 1
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), timeout=60) as h:
        url = "http://localhost/api/generate"
        with h.stream("POST", url, json={**body, "options": options}) as queued:
            assert queued.status_code == 200  # queued behind the running one
            r = raw(path, "POST", "/api/generate", json={**body, "stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert set(r.json()) == {"error"}
    running.close()  # the client hangs up
    _wait_idle(d)
    deadline = time.monotonic() + 30  # both cancelled ones logged (a condition, not a sleep)
    while time.monotonic() < deadline:
        if len(re.findall(r"ollama r\d+: stream closed early; cancelled", d.read_log())) == 2:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("not both streams cancelled:\n" + d.read_log())
    again = c.generate(**body, options={"num_predict": 3})
    assert again.done and again.done_reason in ("stop", "length")
