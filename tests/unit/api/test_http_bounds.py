"""The HTTP listener is bounded, against a real daemon process on real sockets (issue 32 item 3):
slow clients (a connection that sends nothing, a trickled head, a trickled body, an idle
keep-alive) are closed at their deadlines; with RLIMIT_NOFILE low, 250 of them take down neither
HTTP /health nor gRPC health; over the connection limit with every connection busy a new one is
refused with a 503, counted in /metrics; JSON endpoints want application/json (415); Host and
Origin checks refuse what a web page or DNS rebinding would send (403); 405 carries Allow;
100k-deep JSON is a 400; a request is rendered and tokenized off the event loop (a fault
injection gate holds it there while /health answers); a loose key file is a warning; the unit's
LimitNOFILE leaves room for the default limits."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import resource
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agent.api.http.connections import fd_headroom
from agent.api.http.faults import GATE_ENV
from agent.api.identity import load_or_create_key, loose_key_file
from agent.config.file import HttpConfig
from tests.support.daemon_harness import Daemon
from tests.support.paths import ROOT

# connection floods against a daemon's descriptor limit: alone, after the parallel run (a
# daemon slowed by the other worker's load accepts in bursts the limit is not sized for)
pytestmark = pytest.mark.serial

WAIT_S = 60.0  # a bound on waiting for an event, never a measured time
KEY = "bounds-test-key"


def tcp_address(d: Daemon) -> str:
    return wait_log(d, r"http: OpenAI-compatible API on [^\n]*?(127\.0\.0\.1:\d+)").group(1)


def wait_log(d: Daemon, pattern: str) -> re.Match[str]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        m = re.search(pattern, d.read_log())
        if m:
            return m
        time.sleep(0.02)
    raise AssertionError(f"no {pattern!r} in the log:\n" + d.read_log())


def http_sock(d: Daemon) -> Path:
    return d.socket.with_name("agent-http.sock")


def unix(d: Daemon, method: str, url: str, **kw: Any) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(http_sock(d))), timeout=WAIT_S) as c:
        return c.request(method, f"http://localhost{url}", **kw)


def tcp(d: Daemon, method: str, url: str, **kw: Any) -> httpx.Response:
    with httpx.Client(timeout=WAIT_S) as c:
        return c.request(method, f"http://{tcp_address(d)}{url}", **kw)


def connect(d: Daemon, over_tcp: bool) -> socket.socket:
    if over_tcp:
        host, _, port = tcp_address(d).rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=WAIT_S)
        return s
    deadline = time.monotonic() + WAIT_S
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(WAIT_S)
        try:
            s.connect(str(http_sock(d)))
            return s
        except BlockingIOError:  # the listen queue is full: a unix socket does not wait
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def read_to_close(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a recv timeout fails the test)."""
    got = b""
    while True:
        try:
            piece = s.recv(65536)
        except ConnectionResetError:
            return got
        if not piece:
            return got
        got += piece


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def chat(content: str, max_tokens: int = 2) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


AUTH = {"Authorization": f"Bearer {KEY}"}

# ------------------------------------------------------------ a daemon with short deadlines

SHORT = """
[watchdog]
tick_s = 0.2
[http]
key_file = "{key}"
header_timeout_s = 1
body_timeout_s = 1
keep_alive_s = 1
allowed_hosts = ["board.local"]
allowed_origins = ["https://console.example"]
"""


@pytest.fixture(scope="module")
def short(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("short")
    key = tmp / "http.key"
    key.write_text(KEY + "\n")
    key.chmod(0o644)  # readable by every user: served, with a warning
    d = Daemon(tmp, tiny_model_dir, SHORT.format(key=key), args=("--http", "127.0.0.1:0"))
    yield d
    assert d.stop() == 0, d.read_log()


def test_a_key_file_others_can_read_is_a_warning(short: Daemon, tmp_path: Path) -> None:
    assert re.search(
        r"http\.key_file .*http\.key: mode 0644: every user on this machine can "
        r"read the key \(chmod o-rwx",
        short.read_log(),
    ), short.read_log()
    assert unix(short, "GET", "/health", headers=AUTH).status_code == 200  # served all the same
    key = tmp_path / "k"
    key.write_text("x\n")
    for mode, loose in ((0o600, False), (0o640, False), (0o660, True), (0o604, True)):
        key.chmod(mode)
        assert (loose_key_file(key) is not None) is loose, oct(mode)
    key.chmod(0o640)  # a client's own key: not even its group
    assert "chmod g-rwx" in (loose_key_file(key, group_may_read=False) or "")


def test_a_client_key_others_can_read_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "client-key"
    key = load_or_create_key(path)  # created 0600: no warning
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert load_or_create_key(path) == key
    assert "every user on this machine can read the key" in caplog.text


def test_slow_clients_are_closed_at_their_deadlines(short: Daemon) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    for over_tcp in (False, True):
        silent = connect(short, over_tcp)  # connects, sends nothing
        trickle = connect(short, over_tcp)  # the head, a byte at a time, never finished
        body = connect(short, over_tcp)  # a whole head, then half its body
        body.sendall(
            head
            + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
            + b'Content-Length: 1000\r\n\r\n{"model": '
        )
        idle = connect(short, over_tcp)  # one request answered, then nothing
        idle.sendall(
            b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
            + f"Authorization: Bearer {KEY}\r\n\r\n".encode()
        )
        closed = threading.Event()

        def trickling(s: socket.socket = trickle, closed: threading.Event = closed) -> None:
            for byte in head + b"X-Slow: " + b"a" * 10_000:  # far past the deadline
                if closed.is_set():
                    return
                with contextlib.suppress(OSError):
                    s.send(bytes([byte]))
                time.sleep(0.05)

        t = threading.Thread(target=trickling, daemon=True)
        t.start()
        try:
            assert read_to_close(silent) == b""  # nothing asked: closed without an answer
            assert read_to_close(trickle).startswith(b"HTTP/1.1 408 ")
            closed.set()
            got = read_to_close(body)
            assert got.startswith(b"HTTP/1.1 408 "), got
            assert b"request body did not arrive within 1 s" in got
            answered = read_to_close(idle)
            assert answered.startswith(b"HTTP/1.1 200 ") and answered.count(b"HTTP/1.1") == 1
        finally:
            closed.set()
            t.join()
            for s in (silent, trickle, body, idle):
                s.close()
    metrics = unix(short, "GET", "/metrics", headers=AUTH).text
    for reason in ("header_timeout", "body_timeout"):
        m = re.search(
            rf'edge_agent_http_connections_dropped_total{{reason="{reason}"}} (\S+)', metrics
        )
        assert m and float(m.group(1)) >= 2, metrics
    assert unix(short, "GET", "/health", headers=AUTH).status_code == 200


def test_json_endpoints_want_application_json(short: Daemon) -> None:
    body = json.dumps(chat("x")).encode()
    for headers in (
        {},
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
    ):
        r = unix(short, "POST", "/v1/chat/completions", content=body, headers={**AUTH, **headers})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
    r = unix(
        short,
        "POST",
        "/v1/chat/completions",
        content=body,
        headers={**AUTH, "Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text
    # the official SDK, over both listeners, as apps use it
    for base in ("http://localhost/v1", f"http://{tcp_address(short)}/v1"):
        transport = httpx.HTTPTransport(uds=str(http_sock(short))) if "localhost" in base else None
        c = openai.OpenAI(
            base_url=base, api_key=KEY, max_retries=0, http_client=httpx.Client(transport=transport)
        )
        out = c.chat.completions.create(**chat("def f(x):"))
        assert out.choices[0].message.role == "assistant"


def test_405_says_what_is_allowed(short: Daemon) -> None:
    r = unix(short, "GET", "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = unix(short, "POST", "/health", headers=AUTH, json={})
    assert r.status_code == 405 and "GET" in r.headers["allow"].split(", "), r.headers


@pytest.mark.parametrize("kind", ["array", "object", "in a message", "just over the limit"])
def test_deep_json_is_a_400(short: Daemon, kind: str) -> None:
    n = 100_000
    data = {
        "array": "[" * n + "]" * n,
        "object": '{"a":' * n + "1" + "}" * n,
        "in a message": '{"messages": [{"role": "user", "content": ' + "[" * n + "]" * n + "}]}",
        "just over the limit": '{"stop": ' + "[" * 128 + "]" * 128 + "}",
    }[kind]
    r = unix(
        short,
        "POST",
        "/v1/chat/completions",
        content=data.encode(),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "request body nests deeper than 128 levels"
    assert "Traceback" not in short.read_log()
    assert unix(short, "GET", "/health", headers=AUTH).status_code == 200


def test_host_and_origin_of_a_web_page_are_refused(short: Daemon) -> None:
    port = tcp_address(short).rpartition(":")[2]
    body = chat("x")

    def post(via: Any, **headers: str) -> httpx.Response:
        return via(short, "POST", "/v1/chat/completions", json=body, headers={**AUTH, **headers})

    # DNS rebinding: the page's own name, resolved to 127.0.0.1
    r = post(tcp, Host=f"evil.example:{port}")
    assert r.status_code == 403 and "Host 'evil.example:" in r.json()["error"]["message"], r.text
    assert tcp(short, "GET", "/health", headers={**AUTH, "Host": "evil.example"}).status_code == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"board.local:{port}"):
        assert post(tcp, Host=host).status_code == 200, host
    # a page posting cross-site: its Origin
    for origin in (
        "http://evil.example",
        "null",
        f"http://localhost:{int(port) + 1}",
        f"https://127.0.0.1:{port}",
        "http://evil.example.localhost",
    ):
        r = post(tcp, Origin=origin)
        assert r.status_code == 403 and "Origin" in r.json()["error"]["message"], (origin, r.text)
        assert post(unix, Origin=origin).status_code == (200 if "localhost:" in origin else 403)
    for origin in (
        f"http://127.0.0.1:{port}",
        f"http://localhost:{port}",
        "https://console.example",
    ):
        assert post(tcp, Origin=origin).status_code == 200, origin
    # the unix socket, which no browser reaches: any Host, or none
    assert post(unix, Host="anything.example").status_code == 200
    assert "refused: Host 'evil.example" in short.read_log()


def test_ollamas_endpoints_take_the_same_key_host_and_origin_rules(short: Daemon) -> None:
    """Ollama's API (agent.api.http.ollama) on the same listeners: no key is a 401 in Ollama's
    error shape; a web page's Host or Origin is refused before any endpoint runs."""
    for path in ("/api/tags", "/api/version"):
        r = unix(short, "GET", path)
        assert r.status_code == 401 and set(r.json()) == {"error"}, r.text
        assert "API key" in r.json()["error"]
        assert unix(short, "GET", path, headers=AUTH).status_code == 200
    body = {"model": "x", "messages": [{"role": "user", "content": "x"}], "stream": False}
    r = tcp(
        short, "POST", "/api/chat", json=body, headers={**AUTH, "Origin": "http://evil.example"}
    )
    assert r.status_code == 403, r.text
    port = tcp_address(short).rpartition(":")[2]
    r = tcp(short, "GET", "/api/tags", headers={**AUTH, "Host": f"evil.example:{port}"})
    assert r.status_code == 403, r.text
    assert tcp(short, "GET", "/api/tags", headers=AUTH).status_code == 200


def test_the_unit_leaves_room_for_the_limits(short: Daemon) -> None:
    unit = (ROOT / "systemd" / "edge-agent.service").read_text()
    (nofile,) = re.findall(r"^LimitNOFILE=(\d+)$", unit, re.M)
    in_use = fd_count(short.proc.pid)  # a serving daemon, its listeners open
    assert int(nofile) >= in_use + fd_headroom(2) + HttpConfig().max_connections


# ---------------------------------------------------------------------- a low open-file limit

LOWFD = """
[watchdog]
tick_s = 0.2
[http]
header_timeout_s = 600
body_timeout_s = 600
keep_alive_s = 600
"""


def test_250_slow_connections_with_few_descriptors_leave_health_up(
    short: Daemon, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # room for the headroom and ~16 HTTP connections beside what a daemon has open
    nofile = fd_count(short.proc.pid) + fd_headroom(2) + 16
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))  # inherited by the daemon
    try:
        d = Daemon(tmp_path, tiny_model_dir, LOWFD, args=("--http", "127.0.0.1:0"))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    slow: list[socket.socket] = []
    try:
        assert unix(d, "GET", "/health").status_code == 200
        for i in range(250):  # 240 that never finish a request, then 10 idle after one
            s = connect(d, over_tcp=i % 2 == 0)
            slow.append(s)
            if i >= 240:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
            elif i % 3 == 1:
                s.sendall(b"GET /health HTTP/1.1\r\nHo")  # a head begun
            elif i % 3 == 2:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
                )  # a body begun
        for _ in range(3):
            assert unix(d, "GET", "/health").status_code == 200
            assert tcp(d, "GET", "/health").status_code == 200
            assert d.client(timeout=WAIT_S).health() == "SERVING"
        limit = int(wait_log(d, r"http: connection limit 64 lowered to (\d+)").group(1))
        assert 4 <= limit < 240
        metrics = unix(d, "GET", "/metrics").text
        m = re.search(r'edge_agent_http_connections_dropped_total{reason="evicted"} (\S+)', metrics)
        assert m and float(m.group(1)) >= 250 - limit, metrics
        assert f"edge_agent_http_connection_limit {limit}.0" in metrics
        assert "Too many open files" not in d.read_log()
    finally:
        for s in slow:
            s.close()
        assert d.stop() == 0, d.read_log()


# ---------------------------------------------------------------------- requests held at intake

GATED = """
[watchdog]
tick_s = 0.2
[http]
max_connections = 4
"""


@pytest.fixture
def gated(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    d = Daemon(tmp_path, tiny_model_dir, GATED, env={GATE_ENV: str(gate)})
    yield d, gate
    with contextlib.suppress(OSError):  # nobody may still wait at the gate
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    assert d.stop() == 0, d.read_log()


def release(gate: Path, threads: list[threading.Thread]) -> None:
    """Open the gate (a writer that comes and goes) until the clients' threads have ended."""
    deadline = time.monotonic() + WAIT_S
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # ENXIO: no request waits at the gate now
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        time.sleep(0.05)


def wait_count(d: Daemon, text: str, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while d.read_log().count(text) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.read_log().count(text) == n, d.read_log()


def test_a_1_mib_message_is_tokenized_off_the_event_loop(gated: tuple[Daemon, Path]) -> None:
    d, gate = gated
    result: list[httpx.Response] = []
    big = chat("x = 1 " * 174_000, max_tokens=1)  # a 1 MB message
    t = threading.Thread(
        target=lambda: result.append(unix(d, "POST", "/v1/chat/completions", json=big))
    )
    t.start()
    try:
        wait_count(d, "fault injection: http submit waits at", 1)  # held where it tokenizes
        assert unix(d, "GET", "/health").status_code == 200  # the event loop is free
        assert d.client(timeout=WAIT_S).health() == "SERVING"
    finally:
        release(gate, [t])
    assert result and result[0].status_code in (200, 400), result
    if result[0].status_code == 400:
        assert result[0].json()["error"]["code"] == "context_length_exceeded"


def test_over_the_limit_with_every_connection_busy_is_a_503(gated: tuple[Daemon, Path]) -> None:
    d, gate = gated
    held = [
        threading.Thread(
            target=unix,
            args=(d, "POST", "/v1/completions"),
            kwargs={"json": {"prompt": f"{i}", "max_tokens": 1}},
        )
        for i in range(4)  # four requests waiting at the gate: four busy connections
    ]
    for t in held:
        t.start()
    try:
        wait_count(d, "fault injection: http submit waits at", 4)
        with connect(d, over_tcp=False) as s:  # the fifth: answered at once, then closed
            got = read_to_close(s)
        assert got.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1\r\n" in got, got
        assert b"too many connections (at most 4)" in got
    finally:
        release(gate, held)
    metrics = unix(d, "GET", "/metrics").text
    assert 'edge_agent_http_connections_dropped_total{reason="refused"} 1.0' in metrics, metrics
    assert "http: connection refused (1 since the last report; limit 4, open 4)" in d.read_log()
