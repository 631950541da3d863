"""Exit codes of the command line as scripts meet them (agent/base/exitcodes.py, README "Exit
codes").

Real `python -m agent ...` subprocesses against a real daemon on a unix socket. The daemon runs
the demo model without its stop token (tests/support/endless.py): a 1000-token request there
generates
1000 tokens whatever the sampler draws (~1 s here at ~1 ms a token), so a Ctrl-C, a SIGTERM or
a 50 ms deadline always meets a generation that is still running (the demo model itself may
sample its EOS after 40 tokens).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sentencepiece

from agent.base import exitcodes
from agent.model.directory import demo_model_dir, load_model_dir
from tests.support.daemon_harness import Daemon
from tests.support.endless import endless_model_dir

PROMPT = "def f(x):"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "EDGE_AGENT_CLIENT_KEY": "exit-code-tests", **extra}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def client(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("client", *args, "--socket", str(daemon.socket))


def popen_client(daemon: Daemon, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "client", *args, "--socket", str(daemon.socket)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("edge-agent: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


def prompt_tokens(text: str) -> int:
    """The prompt's length as SentencePiece itself counts it, plus the BOS the model adds."""
    meta = load_model_dir(demo_model_dir())
    sp = sentencepiece.SentencePieceProcessor(model_file=str(demo_model_dir() / "tokenizer.model"))
    return len(sp.encode(text)) + (1 if meta.add_bos and meta.bos_id is not None else 0)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("exits")
    d = Daemon(tmp, endless_model_dir(tmp / "model"), "[watchdog]\ntick_s = 0.2\n")
    yield d
    assert d.stop() == 0, d.read_log()


def wait_active(daemon: Daemon, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until the daemon runs a request (the client's, the only one)."""
    c = daemon.client()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            if int(c.status().get("active_requests", 0)) >= 1:
                return
            time.sleep(0.005)
    finally:
        c.close()
    raise AssertionError("the request never ran")


def tokens_generated(daemon: Daemon) -> int:
    c = daemon.client()
    try:
        return int(c.status()["tokens_generated"])
    finally:
        c.close()


# ----------------------------------------------------------------------------- 0 and 130


def test_ctrl_c_mid_stream_exits_130_with_the_partial_text_and_no_traceback(
    daemon: Daemon,
) -> None:
    before = tokens_generated(daemon)
    proc = popen_client(daemon, "generate", PROMPT, "--max-tokens", "1000", "--seed", "1")
    assert proc.stdout is not None
    first = os.read(proc.stdout.fileno(), 1)  # the stream has begun
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    stderr = err.decode()
    assert proc.returncode == exitcodes.INTERRUPTED == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "interrupted" in one_line(stderr)
    summary = next(line for line in stderr.splitlines() if line.startswith("["))
    n = int(summary[1:].split()[0])
    assert summary.startswith(f"[{n} tokens, cancelled") and 1 <= n < 1000, summary
    assert len(first + rest) > 0  # what arrived was printed
    c = daemon.client()
    deadline = time.monotonic() + 30
    while int(c.status().get("active_requests", 0)) > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    c.close()
    assert tokens_generated(daemon) - before < 1000  # the daemon stopped it, not the length


def test_ctrl_c_with_json_prints_what_arrived(daemon: Daemon) -> None:
    proc = popen_client(daemon, "generate", PROMPT, "--max-tokens", "1000", "--seed", "1", "--json")
    wait_active(daemon, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert "Traceback" not in err.decode()
    doc = json.loads(out)
    assert doc["finish_reason"] == "cancelled" and "interrupted" in doc["error"]
    assert len(doc["tokens"]) < 1000


# ----------------------------------------------------------------------------- 4: deadline


def test_a_deadline_is_exit_4_where_a_complete_answer_is_0(daemon: Daemon) -> None:
    """1000 tokens that cannot stop early take ~1 s here: a 50 ms deadline ends them (a model
    would need 50 us a token to finish in time), where 4 tokens and no deadline end with 0."""
    done = client(daemon, "generate", PROMPT, "--max-tokens", "4", "--seed", "1", "--json")
    assert done.returncode == exitcodes.OK == 0, done.stderr
    assert json.loads(done.stdout)["finish_reason"] == "length"
    long = ("generate", PROMPT, "--max-tokens", "1000", "--seed", "1", "--timeout", "0.05")
    r = client(daemon, *long)
    assert r.returncode == exitcodes.DEADLINE == 4, r.stderr
    assert "DEADLINE_EXCEEDED" in one_line(r.stderr) and "--timeout 0.05" in r.stderr
    js = client(daemon, *long, "--json")
    assert js.returncode == 4, js.stderr
    doc = json.loads(js.stdout)
    assert "DEADLINE_EXCEEDED" in doc["error"] and len(doc["tokens"]) < 1000


# ----------------------------------------------------------------------------- 3: unreachable


def test_no_daemon_is_exit_3_naming_the_socket(tmp_path: Path) -> None:
    missing = tmp_path / "run" / "agent.sock"
    for args in (("generate", "x"), ("health",), ("session", "list"), ("info",)):
        r = cli("client", *args, "--socket", str(missing))
        assert r.returncode == exitcodes.UNREACHABLE == 3, (args, r.stderr)
        line = one_line(r.stderr)
        assert str(missing) in line and "systemctl status edge-agent" in line, line
        assert "no socket there" in line


def test_a_stale_socket_or_a_file_is_exit_3_and_left_alone(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))  # bound, never listening: what a killed daemon leaves
    try:
        r = cli("client", "generate", "x", "--socket", str(stale))
        assert r.returncode == 3, r.stderr
        assert str(stale) in one_line(r.stderr) and "nothing is listening" in r.stderr
    finally:
        s.close()
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me\n")
    r = cli("client", "status", "--socket", str(plain))
    assert r.returncode == 3, r.stderr
    assert str(plain) in one_line(r.stderr) and "it is not a socket" in r.stderr
    assert plain.read_text() == "keep me\n"
    with socket.socket() as tcp:  # a free loopback port: bound, not listening
        tcp.bind(("127.0.0.1", 0))
        port = tcp.getsockname()[1]
        r = cli("client", "health", "--socket", f"127.0.0.1:{port}")
    assert r.returncode == 3 and f"127.0.0.1:{port}: nothing listens there" in one_line(r.stderr)


# ----------------------------------------------------------------------------- 2: bad input


def _overflow_text(prompt: int, max_tokens: int, context: int) -> str:
    return (
        f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {prompt + max_tokens} tokens "
        f"is beyond the model's context of {context}"
    )


def test_bad_requests_to_the_daemon_are_exit_2(daemon: Daemon) -> None:
    """Empty prompt, over the daemon's own max_tokens limit, out-of-range sampling, argparse,
    and a prompt + max_tokens beyond the context (RESOURCE_EXHAUSTED on the wire, but no retry
    makes it fit): each one line and exit 2."""
    r = client(daemon, "generate", "", "--max-tokens", "5")
    assert r.returncode == exitcodes.USAGE == 2
    assert "INVALID_ARGUMENT: prompt is empty" in one_line(r.stderr)
    r = client(daemon, "generate", PROMPT, "--max-tokens", "100000")  # the daemon's own limit
    assert r.returncode == 2 and "above this agent's limit 4096" in one_line(r.stderr)
    r = client(daemon, "generate", PROMPT, "--top-p", "1.5")
    assert r.returncode == 2 and "top_p = 1.5" in one_line(r.stderr)
    r = cli("client", "generate")  # argparse
    assert r.returncode == 2 and "Traceback" not in r.stderr
    ctx = load_model_dir(demo_model_dir()).context_length
    p = prompt_tokens(PROMPT)
    over = client(daemon, "generate", PROMPT, "--max-tokens", str(ctx - p + 1), "--seed", "1")
    assert over.returncode == 2, over.stderr
    line = one_line(over.stderr)
    assert "RESOURCE_EXHAUSTED" in line and _overflow_text(p, ctx - p + 1, ctx) in line
    assert over.stdout == ""  # not one token
    fits = client(daemon, "generate", PROMPT, "--max-tokens", str(ctx - p), "--json", "--seed", "1")
    assert fits.returncode == 0, fits.stderr
    assert 1 <= len(json.loads(fits.stdout)["tokens"]) <= ctx - p
    # a session turn: refused before the session changes
    sid = client(daemon, "session", "create").stdout.strip()
    r = client(daemon, "generate", PROMPT, "--session", sid, "--max-tokens", str(ctx))
    assert r.returncode == 2 and _overflow_text(p, ctx, ctx) in one_line(r.stderr)
    rows = json.loads(client(daemon, "session", "list", "--json").stdout)["sessions"]
    assert [(s["id"], s["tokens"]) for s in rows if s["id"] == sid] == [(sid, 0)]
    assert client(daemon, "session", "delete", sid).returncode == 0


def test_prompt_plus_max_tokens_beyond_the_context_is_refused_in_process() -> None:
    ctx = load_model_dir(demo_model_dir()).context_length
    p = prompt_tokens(PROMPT)
    for n in (ctx - p + 1, 100000):
        r = cli("generate", PROMPT, "--profile", "generic-x86_64", "--max-tokens", str(n))
        assert r.returncode == 2, r.stderr
        assert _overflow_text(p, n, ctx) in one_line(r.stderr) and r.stdout == ""
    ok = cli("generate", PROMPT, "--max-tokens", str(ctx - p), "--seed", "1", "--json")
    assert ok.returncode == 0, ok.stderr
    assert 1 <= len(json.loads(ok.stdout)["tokens"]) <= ctx - p


# ----------------------------------------------------------------------------- 5 and 6


def test_an_unknown_session_is_refused_exit_5(daemon: Daemon) -> None:
    for args in (("generate", PROMPT, "--session", "nope"), ("session", "delete", "nope")):
        r = client(daemon, *args)
        assert r.returncode == exitcodes.REFUSED == 5, r.stderr
        assert "NOT_FOUND" in one_line(r.stderr) and "nope" in r.stderr


def test_a_full_queue_and_a_busy_session_are_exit_6(tmp_path: Path) -> None:
    """With the engine stalled, a session's turn waits in the one queue place: another request
    finds the queue full, another turn of the session finds it busy. Both may pass later."""
    from agent.api.grpc.client import Client, build_request

    d = Daemon(
        tmp_path,
        demo_model_dir(),
        "[limits]\nmax_active = 1\nqueue_capacity = 1\n"
        "[watchdog]\ntick_s = 0.2\nengine_stall_s = 2\n",
    )
    c = Client(str(d.socket), timeout=60, client_key=_env()["EDGE_AGENT_CLIENT_KEY"])
    try:
        sid = c.create_session()
        d.signal(signal.SIGUSR2)  # fault injection: the engine thread stalls, nothing runs
        # the engine thread is asleep (not merely about to take the turn in) once the daemon
        # says it has not answered for engine_stall_s (an idle engine answers every 0.5 s)
        d.wait_log("engine thread has not answered for")
        turn = build_request(
            PROMPT,
            None,
            max_tokens=5,
            temperature=None,
            top_k=None,
            top_p=None,
            seed=1,
            stop=[],
            session=sid,
        )
        waiting = c.stream(turn)  # takes the one place in the queue; the session is busy
        deadline = time.monotonic() + 30
        while int(c.status().get("queue_depth", 0)) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert int(c.status().get("queue_depth", 0)) == 1, c.status()
        full = client(d, "generate", PROMPT, "--max-tokens", "2")
        assert full.returncode == exitcodes.BUSY == 6, full.stderr
        assert "RESOURCE_EXHAUSTED" in one_line(full.stderr) and "queue is full" in full.stderr
        busy = client(d, "generate", "\n", "--session", sid, "--max-tokens", "2")
        assert busy.returncode == 6, busy.stderr
        assert "FAILED_PRECONDITION" in one_line(busy.stderr)
        assert "already has a request running" in busy.stderr
        waiting.cancel()
    finally:
        c.close()
        d.proc.kill()  # the stalled engine would hold a drain for an hour
        d.stop()


def test_a_request_the_daemon_cancels_is_exit_7(tmp_path: Path) -> None:
    d = Daemon(tmp_path, endless_model_dir(tmp_path / "model"), "[limits]\ndrain_timeout_s = 0\n")
    try:
        running = popen_client(d, "generate", PROMPT, "--max-tokens", "1000", "--seed", "1")
        assert running.stdout is not None
        first = os.read(running.stdout.fileno(), 1)  # the answer has begun
        d.signal(signal.SIGTERM)  # no drain: what still runs is cancelled
        rest, err = running.communicate(timeout=60)
        stderr = err.decode()
        assert running.returncode == exitcodes.CANCELLED == 7, stderr
        assert "the daemon ended the request" in one_line(stderr)
        summary = next(line for line in stderr.splitlines() if line.startswith("["))
        assert summary.startswith("[") and int(summary[1:].split()[0]) < 1000, summary
        assert len(first + rest) > 0
    finally:
        d.stop()


# ----------------------------------------------------------------------------- 1: failed


def test_a_model_that_fails_is_exit_1(tiny_model_factory, tmp_path: Path) -> None:
    """A model whose logits are NaN ends every request with an error: exit 1, never 0."""
    from tests.unit.runtime.test_prepared_check import nan_model_dir

    d = nan_model_dir(tiny_model_factory, tmp_path)
    r = cli("generate", "hello", "--model", str(d), "--max-tokens", "4", "--json")
    assert r.returncode == exitcodes.FAILED == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["finish_reason"] == "error" and doc["tokens"] == []
    assert "non-finite logits" in doc["error"]
    assert "non-finite logits" in one_line(r.stderr)
    (tmp_path / "daemon").mkdir()
    daemon = Daemon(tmp_path / "daemon", d)
    try:
        r = client(daemon, "generate", "hello", "--max-tokens", "4")
        assert r.returncode == 1, r.stderr
        assert "non-finite logits" in one_line(r.stderr)
    finally:
        assert daemon.stop() == 0, daemon.read_log()


def test_a_truncate_session_drops_history_to_fit_an_explicit_max_tokens(daemon: Daemon) -> None:
    """Policy truncate: a turn whose max_tokens does not fit beside the history drops old turns
    (the first kept) until it does; one that cannot fit even then is refused, the session as
    it was."""
    ctx = load_model_dir(demo_model_dir()).context_length

    def tokens(sid: str) -> int:
        rows = json.loads(client(daemon, "session", "list", "--json").stdout)["sessions"]
        return next(int(s["tokens"]) for s in rows if s["id"] == sid)

    def turn(sid: str, text: str, n: int) -> subprocess.CompletedProcess[str]:
        return client(daemon, "generate", text, "--session", sid, "--max-tokens", str(n), "--json")

    sid = json.loads(client(daemon, "session", "create", "--policy", "truncate", "--json").stdout)[
        "id"
    ]
    assert turn(sid, "# system prompt\n", 2).returncode == 0
    filler = "x = 1\n" * 40
    while tokens(sid) < ctx // 2:
        r = turn(sid, filler, 4)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["stats"]["truncated_tokens"] == 0
    held = tokens(sid)
    want = ctx - held + 8  # does not fit beside the whole history
    r = turn(sid, "\n", want)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["stats"]["truncated_tokens"] > 0 and len(doc["tokens"]) <= want
    kept = tokens(sid) - len(doc["tokens"])  # what the turn was prefilled beside
    assert kept + want <= ctx
    before = tokens(sid)
    r = turn(sid, "\n", ctx)  # cannot fit beside even the first turn
    assert r.returncode == 2 and "beyond the model's context" in one_line(r.stderr)
    assert tokens(sid) == before
    assert client(daemon, "session", "delete", sid).returncode == 0
