"""agent.systemd.notify: the notify protocol on real AF_UNIX datagram sockets, and journald
logging."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import agent
from agent.base.errors import ConfigError
from agent.systemd.notify import (
    Notifier,
    configure_logging,
    journal_fields,
    journal_stream_matches,
    journald_available,
    monotonic_usec,
    syslog_priority,
)

HAS_LIBSYSTEMD = journald_available()
BACKENDS = ["socket", "libsystemd"] if HAS_LIBSYSTEMD else ["socket"]


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.settimeout(2.0)
    return sock


def _recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode("utf-8")


def _assert_quiet(sock: socket.socket) -> None:
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(4096)
    sock.settimeout(2.0)


@pytest.fixture(params=["path", "abstract"])
def address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "path":
        return str(tmp_path / "notify.sock")
    return f"@edge-agent-test-{uuid.uuid4().hex}"


@pytest.fixture(params=BACKENDS)
def notifier_on(
    request: pytest.FixtureRequest, address: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Notifier, socket.socket]]:
    """A Notifier and the socket that receives its datagrams (sd_notify reads the env too)."""
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    sock = _listener(address)
    try:
        yield Notifier(address, backend=request.param), sock
    finally:
        sock.close()


def test_exact_datagrams(notifier_on: tuple[Notifier, socket.socket]) -> None:
    notifier, sock = notifier_on
    assert notifier.enabled
    notifier.ready("model demo loaded\non two threads")
    assert _recv(sock) == "READY=1\nSTATUS=model demo loaded on two threads"
    notifier.status("serving 2 sessions")
    assert _recv(sock) == "STATUS=serving 2 sessions"
    notifier.watchdog()
    assert _recv(sock) == "WATCHDOG=1"
    before = monotonic_usec()
    notifier.reloading("reloading profile")
    after = monotonic_usec()
    m = re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=(\d+)\nSTATUS=reloading profile", _recv(sock))
    assert m is not None
    assert before <= int(m.group(1)) <= after
    notifier.ready()
    assert _recv(sock) == "READY=1"
    notifier.extend_timeout(5_000_000)
    assert _recv(sock) == "EXTEND_TIMEOUT_USEC=5000000"
    notifier.stopping("draining 1 request")
    assert _recv(sock) == "STOPPING=1\nSTATUS=draining 1 request"
    _assert_quiet(sock)


def test_monotonic_usec_is_clock_monotonic() -> None:
    a = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    b = monotonic_usec()
    c = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert a <= b <= c


def test_one_log_line_per_transition_none_per_ping(
    notifier_on: tuple[Notifier, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    notifier = notifier_on[0]
    caplog.set_level(logging.DEBUG, logger="agent.systemd.notify")
    notifier.ready("up")
    for _ in range(5):
        notifier.watchdog()
    notifier.status("busy")
    notifier.reloading()
    notifier.ready()
    notifier.stopping()
    assert [r.getMessage() for r in caplog.records] == [
        "systemd: READY (up)",
        "systemd: RELOADING",
        "systemd: READY",
        "systemd: STOPPING",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_no_socket_is_a_quiet_no_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.DEBUG)
    for notifier in (Notifier.from_env(), Notifier.from_env({})):
        assert not notifier.enabled
        assert notifier.watchdog_interval() is None
        notifier.ready("x")
        notifier.status("x")
        notifier.watchdog()
        notifier.reloading("x")
        notifier.stopping("x")
        notifier.extend_timeout(1)
    assert caplog.records == []


def test_from_env_reads_the_environment(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = Notifier.from_env()
    assert notifier.address == address
    assert notifier.backend == ("libsystemd" if HAS_LIBSYSTEMD else "socket")
    assert notifier.watchdog_interval() == 30.0
    with _listener(address) as sock:
        notifier.ready()
        assert _recv(sock) == "READY=1"
    # An explicit mapping never goes through sd_notify (which would read os.environ instead).
    assert Notifier.from_env({"NOTIFY_SOCKET": address}).backend == "socket"


def test_unusable_address_disables(caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert "not a path or @abstract name" in caplog.text
    with pytest.raises(ValueError):
        Notifier("/x", backend="dbus")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "2500000", "WATCHDOG_PID": "SELF"}, 2.5),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "OTHER"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "thirty"}, None),
        ({"WATCHDOG_USEC": ""}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    pids = {"SELF": str(os.getpid()), "OTHER": str(os.getpid() + 1)}
    env = {k: pids.get(v, v) for k, v in env.items()}
    assert Notifier.from_env({"NOTIFY_SOCKET": "/run/x", **env}).watchdog_interval() == expected
    # The watchdog settings count even without a socket; the pings are then no-ops.
    assert Notifier.from_env(env).watchdog_interval() == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_socket_going_away_is_logged_once_and_never_raised(
    tmp_path: Path,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = str(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = Notifier(path, backend=backend)
    sock = _listener(path)
    notifier.ready()
    assert _recv(sock) == "READY=1"
    sock.close()
    os.unlink(path)

    caplog.set_level(logging.INFO, logger="agent.systemd.notify")
    caplog.clear()
    notifier.status("still here")
    notifier.watchdog()
    notifier.watchdog()
    notifier.extend_timeout(10)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert path in warnings[0].getMessage()

    # The socket comes back (a new manager instance): notifications resume and say so once.
    with _listener(path) as again:
        notifier.watchdog()
        assert _recv(again) == "WATCHDOG=1"
        notifier.watchdog()
        assert _recv(again) == "WATCHDOG=1"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"systemd notify socket {path} reachable again"
    ]


def test_extend_timeout_rejects_non_positive() -> None:
    with pytest.raises(ValueError):
        Notifier(None).extend_timeout(0)


# ---------------------------------------------------------------------------------------------
# Logging


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """Restore the root logger's handlers and level after configure_logging."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield root
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)


def _record(logger: logging.Logger, emit: str, **extra: object) -> logging.LogRecord:
    """A real record from a real logger call (captured, not built by hand)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    logger.addHandler(keep)
    logger.propagate = False
    level, logger.level = logger.level, logging.DEBUG
    try:
        if emit == "exception":
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                logger.exception("step %d failed", 7, extra=extra)
        else:
            logger.info("loaded %s", "demo", extra=extra)
    finally:
        logger.removeHandler(keep)
        logger.propagate = True
        logger.level = level
    return records[0]


def test_stderr_lines_carry_context(root_logger: logging.Logger) -> None:
    out = io.StringIO()
    assert configure_logging("info", "stderr", stream=out) == "stderr"
    log = logging.getLogger("agent.test")
    log.debug("not shown")
    log.info("plain %s", "line")
    log.warning("request done", extra={"request_id": "r-1", "session_id": "s 2", "model": 'q"x'})
    log.info("session only", extra={"session_id": 42})
    assert out.getvalue() == (
        "INFO agent.test: plain line\n"
        'WARNING agent.test: request done request_id=r-1 session_id="s 2" model="q\\"x"\n'
        "INFO agent.test: session only session_id=42\n"
    )


def test_configure_logging_replaces_its_own_handler_only(root_logger: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    before = len(root_logger.handlers)
    configure_logging("INFO", "stderr", stream=first)
    configure_logging("WARNING", "stderr", stream=second)
    assert len(root_logger.handlers) == before + 1
    logging.getLogger("agent.test").warning("once")
    assert first.getvalue() == ""
    assert second.getvalue() == "WARNING agent.test: once\n"
    assert root_logger.level == logging.WARNING


def test_configure_logging_rejects_bad_values(root_logger: logging.Logger) -> None:
    with pytest.raises(ConfigError, match="target"):
        configure_logging("INFO", "syslog")
    with pytest.raises(ConfigError, match="level"):
        configure_logging("LOUD", "stderr")


def _journal_stream_env(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}"


def test_journal_stream_detection(tmp_path: Path) -> None:
    target, other = tmp_path / "stream", tmp_path / "other"
    target.touch()
    other.touch()
    with open(target, "w") as f:
        env = {"JOURNAL_STREAM": _journal_stream_env(target)}
        assert journal_stream_matches(f.fileno(), env)
        assert not journal_stream_matches(
            f.fileno(), {"JOURNAL_STREAM": _journal_stream_env(other)}
        )
        assert not journal_stream_matches(f.fileno(), {})
        assert not journal_stream_matches(f.fileno(), {"JOURNAL_STREAM": "x:y"})


def test_auto_target_follows_journal_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root_logger: logging.Logger
) -> None:
    path = tmp_path / "stderr"
    with open(path, "w") as f:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        assert configure_logging("INFO", "auto", stream=f) == "stderr"
        monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_env(path))
        expected = "journald" if HAS_LIBSYSTEMD else "stderr"
        assert configure_logging("INFO", "auto", stream=f) == expected
        # Forced to stderr under journald: each line carries the <N> priority journald parses.
        assert configure_logging("INFO", "stderr", stream=f) == "stderr"
        logging.getLogger("agent.test").error("disk full", extra={"request_id": "r9"})
        logging.getLogger("agent.test").info("fine")
    assert (
        path.read_text()
        == "<3>ERROR agent.test: disk full request_id=r9\n<6>INFO agent.test: fine\n"
    )


def test_journal_fields_mapping() -> None:
    log = logging.getLogger("agent.test.fields")
    record = _record(log, "info", request_id="r-7", session_id="s-1", model="demo-int8")
    fields = journal_fields(record, "loaded demo")
    assert fields == {
        "MESSAGE": "loaded demo",
        "PRIORITY": "6",
        "SYSLOG_IDENTIFIER": "edge-agent",
        "LOGGER": "agent.test.fields",
        "THREAD_NAME": "MainThread",
        "CODE_FILE": __file__,
        "CODE_LINE": str(record.lineno),
        "CODE_FUNC": "_record",
        "REQUEST_ID": "r-7",
        "SESSION_ID": "s-1",
        "MODEL": "demo-int8",
    }
    bare = journal_fields(_record(log, "info"), "m")
    assert not {"REQUEST_ID", "SESSION_ID", "MODEL", "EXCEPTION_TEXT"} & set(bare)
    failed = _record(log, "exception", request_id="r-8")
    text = logging.Formatter().format(failed)  # what a handler's format() does first
    fields = journal_fields(failed, text)
    assert fields["PRIORITY"] == "3"
    assert fields["MESSAGE"].startswith("step 7 failed\nTraceback")
    assert fields["EXCEPTION_TEXT"].endswith("RuntimeError: boom")
    assert fields["REQUEST_ID"] == "r-8"


@pytest.mark.parametrize(
    ("level", "priority"),
    [(logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6), (5, 7)],
)
def test_syslog_priority(level: int, priority: int) -> None:
    assert syslog_priority(level) == priority


_JOURNAL_CHILD = textwrap.dedent(
    """
    import json, logging, os, socket, sys
    from agent.systemd.notify import configure_logging

    os.makedirs("/run/systemd/journal", exist_ok=True)
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind("/run/systemd/journal/socket")
    sink.settimeout(5)
    print(configure_logging("DEBUG", "journald"), flush=True)
    log = logging.getLogger("agent.child")
    log.info("loaded %s", "demo", extra={"request_id": "r-1", "session_id": "s-2", "model": "m"})
    try:
        raise ValueError("bad token")
    except ValueError:
        log.exception("request failed", extra={"request_id": "r-3"})

    def parse(data):
        fields, i = {}, 0
        while i < len(data):
            nl = data.index(b"\\n", i)
            line = data[i:nl]
            if b"=" in line:
                key, value = line.split(b"=", 1)
                i = nl + 1
            else:  # binary-safe form: NAME\\n<le64 size><bytes>\\n
                key, size = line, int.from_bytes(data[nl + 1 : nl + 9], "little")
                value, i = data[nl + 9 : nl + 9 + size], nl + 9 + size + 1
            fields[key.decode()] = value.decode()
        return fields

    print(json.dumps([parse(sink.recv(65536)) for _ in range(2)]))
    """
)


def test_journald_records_for_real(tmp_path: Path) -> None:
    """Real libsystemd writes to a journal socket of our own, in a private mount namespace."""
    if not HAS_LIBSYSTEMD:
        pytest.skip("systemd-python is not installed (the `systemd` extra)")
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) from util-linux")
    script = tmp_path / "child.py"
    script.write_text(_JOURNAL_CHILD)
    repo = Path(agent.__file__).resolve().parent.parent
    done = subprocess.run(
        [
            unshare,
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            'mount -t tmpfs tmpfs /run && exec "$0" "$@"',
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no private mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    chosen, payload = done.stdout.splitlines()
    assert chosen == "journald"
    info, error = json.loads(payload)
    assert info["MESSAGE"] == "loaded demo"
    assert info["PRIORITY"] == "6"
    assert info["SYSLOG_IDENTIFIER"] == "edge-agent"
    assert info["LOGGER"] == "agent.child"
    assert info["CODE_FILE"] == str(script)
    lines = _JOURNAL_CHILD.splitlines()
    call = next(i for i, line in enumerate(lines, 1) if line.startswith('log.info("loaded'))
    assert info["CODE_LINE"] == str(call)
    assert info["CODE_FUNC"] == "<module>"
    assert (info["REQUEST_ID"], info["SESSION_ID"], info["MODEL"]) == ("r-1", "s-2", "m")
    assert error["PRIORITY"] == "3"
    assert error["REQUEST_ID"] == "r-3"
    assert "SESSION_ID" not in error
    assert error["MESSAGE"].startswith("request failed\nTraceback")  # multi-line: binary-safe
    assert error["EXCEPTION_TEXT"].endswith("ValueError: bad token")
