"""Ollama's API on the daemon's HTTP listeners, against a real daemon process on the tiny model
with a Hermes-style tool template: the official `ollama` Python client over the unix socket
(httpx's UDS transport) and loopback TCP, streaming and not; greedy output equal to the OpenAI
endpoint's for the same request (one engine path); `format` (a schema, checked by jsonschema
outside our code); tools and calls; the requests Home Assistant's Ollama integration sends
(homeassistant/components/ollama/entity.py: system prompt, tools, `keep_alive`, `options`
with num_ctx, `stream: True`); bad input → Ollama's ``{"error": ...}`` with the right status,
and the daemon keeps serving; the metrics count it under api="ollama"."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from tests.support.daemon_harness import Daemon
from tests.unit.api.test_http import tcp_address
from tests.unit.chat.test_chat import make_chat_dir
from tests.unit.chat.test_toolcalls import CITY, DIGIT, HERMES

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "add", "description": "adds", "parameters": DIGIT}},
]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def daemon(tiny_model_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    src = tiny_model_factory.model_dir(quantizations=("int8",), prefill_lens=(8, 32), kv_max=512)
    tmp = tmp_path_factory.mktemp("ollama")
    model = make_chat_dir(src, tmp / "model", HERMES)
    (tmp / "d").mkdir()
    d = Daemon(tmp / "d", model, "[limits]\nmax_active = 2\n", args=("--http", "127.0.0.1:0"))
    yield d
    assert d.stop() == 0, d.read_log()


@pytest.fixture(scope="module")
def sock(daemon: Daemon) -> Path:
    return daemon.socket.with_name("agent-http.sock")


@pytest.fixture(scope="module")
def name(sock: Path) -> str:
    return str(raw(sock, "GET", "/v1/models").json()["data"][0]["id"])


def client(sock: Path) -> ollama.Client:
    """The official client over the unix socket, as docs/API.md shows it."""
    return ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(sock)))


def raw(sock: Path, method: str, url: str, **kw: Any) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as c:
        return c.request(method, f"http://localhost{url}", **kw)


def openai_chat(sock: Path, **body: Any) -> str:
    """The reference: the OpenAI endpoint's greedy answer to the same request."""
    r = raw(sock, "POST", "/v1/chat/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_model_listing_show_ps_version(sock: Path, name: str) -> None:
    c = client(sock)
    assert c.list().models[0].model == name
    shown = c.show(name)
    assert shown.template and "tool_call" in (shown.template or "")
    assert shown.capabilities == ["completion", "tools"]
    assert shown.parameters and "num_ctx" in shown.parameters
    assert shown.details is not None and shown.details.quantization_level
    assert c.show(f"{name}:latest").template == shown.template
    (running,) = c.ps().models
    assert running.model == name and running.context_length == 512
    assert raw(sock, "GET", "/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as err:
        c.show("llama3.2")
    assert err.value.status_code == 404 and name in err.value.error
    for call, words in (
        (lambda: c.pull("llama3.2"), "model import"),
        (lambda: c.push("x/y"), "fleet update"),
        (lambda: c.embed(model=name, input="hi"), "embedding"),
    ):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 501 and words in err.value.error, err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        c.delete(name)
    assert err.value.status_code == 501 and "model import" in err.value.error
    r = raw(sock, "GET", "/api/chat")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and set(r.json()) == {"error"}
    r = raw(sock, "POST", "/api/nothing-here")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]


def test_chat_and_generate_equal_the_openai_endpoint(daemon: Daemon, sock: Path, name: str) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    want = openai_chat(sock, messages=msgs, max_tokens=12)
    c = client(sock)
    whole = c.chat(model=name, messages=msgs, options=GREEDY)
    assert whole.message.content == want and whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count and whole.prompt_eval_count and whole.total_duration
    tcp = ollama.Client(host=f"http://{tcp_address(daemon)}")
    chunks = list(tcp.chat(model=name, messages=msgs, options=GREEDY, stream=True))
    assert "".join(ch.message.content or "" for ch in chunks) == want
    assert [ch.done for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].eval_count == whole.eval_count and chunks[-1].created_at
    gen = c.generate(model=name, prompt="def f(x):", system="be brief", options=GREEDY)
    assert gen.response == want and gen.done
    streamed = c.generate(model=name, prompt="x = ", raw=True, options=GREEDY, stream=True)
    r = raw(
        sock, "POST", "/v1/completions", json={"prompt": "x = ", "max_tokens": 12, "temperature": 0}
    )
    assert "".join(ch.response or "" for ch in streamed) == r.json()["choices"][0]["text"]
    # the session extension reaches the engine: an unknown one is its NotFound
    r = raw(sock, "POST", "/api/chat", json={"model": name, "messages": msgs, "session": "nope"})
    assert r.status_code == 404 and "session" in r.json()["error"], r.text
    loaded = c.chat(model=name, messages=[], keep_alive="5m")
    assert loaded.done and loaded.done_reason == "load"


def test_format_json_schema_and_json(sock: Path, name: str) -> None:
    c = client(sock)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    for temperature in (0.0, 1.0):
        r = c.chat(
            model=name,
            messages=[{"role": "user", "content": "a record:"}],
            format=schema,
            options={"temperature": temperature, "seed": 3, "num_predict": 60},
        )
        assert r.done_reason == "stop", r.message.content
        jsonschema.validate(json.loads(r.message.content or ""), schema)
    r = c.generate(model=name, prompt="data:", format="json", options={"num_predict": 40})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response or ""), dict)
    else:  # cut before the object closed: said so, never passed off as valid
        assert r.done_reason == "length"
        assert (r.response or "").lstrip().startswith("{")


def test_tools_and_tool_calls(sock: Path, name: str) -> None:
    c = client(sock)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    # the tools reach the template exactly as the OpenAI path renders them
    want = openai_chat(sock, messages=msgs, tools=TOOLS, max_tokens=12)
    same = {"model": name, "messages": msgs, "tools": TOOLS, "options": GREEDY, "stream": False}
    assert raw(sock, "POST", "/api/chat", json=same).json()["message"]["content"] == want
    # (the client re-serializes tools through its pydantic model: its own key order, so a
    # different prompt; its request is served, its answer the shape it parses)
    assert c.chat(model=name, messages=msgs, tools=TOOLS, options=GREEDY).done
    # a forced call (the tool_choice extension): Ollama's shape, arguments an object
    forced = {"model": name, "messages": msgs, "tools": TOOLS, "tool_choice": "required"}
    r = raw(
        sock,
        "POST",
        "/api/chat",
        json={**forced, "stream": False, "options": GREEDY | {"num_predict": 64}},
    )
    assert r.status_code == 200, r.text
    (call,) = r.json()["message"]["tool_calls"]
    fn = call["function"]
    jsonschema.validate(fn["arguments"], CITY if fn["name"] == "get_weather" else DIGIT)
    lines = raw(sock, "POST", "/api/chat", json={**forced, "options": GREEDY | {"num_predict": 64}})
    chunks = [json.loads(x) for x in lines.text.splitlines()]
    assert chunks[-1]["done"] and chunks[-2]["message"]["tool_calls"] == [call]
    # the call and its result go back as history (arguments an object, tool_name)
    history = [
        *msgs,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"data": 21}', "tool_name": fn["name"]},
    ]
    back = c.chat(model=name, messages=history, tools=TOOLS, options=GREEDY)
    assert back.done and back.message.role == "assistant"


def test_home_assistant_requests(sock: Path, name: str) -> None:
    """What HA's integration sends, through the same client it uses (AsyncClient): a system
    prompt, its tools, history with a call and its result, keep_alive as "-1" (forever) or
    "300s", options with only num_ctx, stream=True, think unset; and its model listing."""
    ha_tools = [
        {
            "type": "function",
            "function": {
                "name": "HassTurnOn",
                "description": "Turns on a device",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "domain": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": [],
                },
            },
        },
    ]
    messages = [
        {"role": "system", "content": "You are a voice assistant."},
        {"role": "user", "content": "turn on the kitchen light"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "HassTurnOn", "arguments": {"name": "kitchen"}}}],
        },
        {"role": "tool", "content": '{"data": {"success": [{"name": "kitchen"}]}, "error": null}'},
        {"role": "user", "content": "and the porch"},
    ]

    async def converse(keep_alive: int | str) -> list[ollama.ChatResponse]:
        c = ollama.AsyncClient(
            host="http://localhost", transport=httpx.AsyncHTTPTransport(uds=str(sock))
        )
        assert name in [m.model for m in (await c.list()).models]
        stream = await c.chat(
            model=name,
            messages=messages,
            tools=ha_tools,
            stream=True,
            keep_alive=keep_alive,
            options={"num_ctx": 8192},
            think=None,
            format=None,
        )
        return [chunk async for chunk in stream]

    for keep_alive in (-1, "300s"):
        chunks = asyncio.run(converse(keep_alive))
        assert chunks[-1].done and chunks[-1].done_reason in ("stop", "length")
        assert all(ch.message.role == "assistant" for ch in chunks)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'["a list"]', 400, "JSON object"),
        (b'{"model": "MODEL", "messages": "hi"}', 400, "messages must be a list"),
        (b'{"model": "MODEL", "messages": [{"role": "x"}]}', 400, "role"),
        (
            b'{"model": "MODEL", "messages": [], "options": {"temperature": "hot"}}',
            400,
            "options.temperature",
        ),
        (b'{"model": "MODEL", "messages": [{"role": "user"}], "format": "yaml"}', 400, "format"),
        (b'{"model": "MODEL", "messages": [{"role": "user"}], "think": true}', 400, "thinking"),
        (
            b'{"model": "MODEL", "messages": [{"role": "user"}], "keep_alive": []}',
            400,
            "keep_alive",
        ),
        (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "not found"),
        (
            b'{"model": "MODEL", "messages": [{"role": "user"}], "options": {"num_predict": 9999}}',
            400,
            "options.num_predict = 9999 is above",
        ),
    ],
)
def test_bad_input_is_ollamas_error_and_the_daemon_keeps_serving(
    sock: Path, name: str, body: bytes, status: int, words: str
) -> None:
    headers = {"Content-Type": "application/json"}
    r = raw(
        sock, "POST", "/api/chat", content=body.replace(b"MODEL", name.encode()), headers=headers
    )
    assert r.status_code == status and words in r.json()["error"], r.text
    assert set(r.json()) == {"error"}


def test_huge_body_and_content_type_then_still_serving(sock: Path, name: str) -> None:
    big = b'{"model": "x", "prompt": "' + b"a" * (5 << 20) + b'"}'
    r = raw(
        sock, "POST", "/api/generate", content=big, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and "error" in r.json()
    r = raw(
        sock,
        "POST",
        "/api/generate",
        content=b'{"model": "x"}',
        headers={"Content-Type": "text/plain"},
    )
    assert r.status_code == 415 and "error" in r.json()
    assert client(sock).generate(model=name, prompt="hi", options={"num_predict": 2}).done
    metrics = raw(sock, "GET", "/metrics").text
    counted = re.findall(
        r'edge_agent_requests_total\{api="ollama",outcome="(\w+)"\} (\d+)', metrics
    )
    assert sum(int(n) for o, n in counted if o in ("stop", "length")) >= 1, counted
    assert sum(int(n) for o, n in counted if o == "refused") >= 1, counted
