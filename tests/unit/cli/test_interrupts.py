"""Ctrl-C at any moment ends a command with exit 130, one line and no traceback, at once
(agent/_entry.py). The real console script (`.venv/bin/edge-agent`) as a subprocess.

A Ctrl-C while Python still imports the CLI once printed a KeyboardInterrupt traceback, and a
Ctrl-C during a streamed generation once hung for minutes in gRPC's channel finalizer. To hit
the import window every time, the process starts with SIGINT blocked and the signal is sent at
once: it is pending from the first instruction and delivered the moment the entry point takes
SIGINT over (the code before it then has a window of a few ms that no test can aim at)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon_harness import Daemon
from tests.support.endless import endless_model_dir
from tests.unit.cli.test_cli_exits import wait_active

SCRIPT = Path(sys.executable).parent / "edge-agent"
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("interrupts")
    d = Daemon(tmp, endless_model_dir(tmp / "model"))
    yield d
    assert d.stop() == 0, d.read_log()


def spawn(argv: list[str], *, blocked: bool = False) -> subprocess.Popen[str]:
    def block() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    return subprocess.Popen(
        [str(SCRIPT), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "EDGE_AGENT_CLIENT_KEY": "interrupt-tests"},
        preexec_fn=block if blocked else None,
    )


def interrupted(proc: subprocess.Popen[str]) -> str:
    """Its stderr, once it has ended as a Ctrl-C must end it (a hang fails at 60 s)."""
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running 60 s after Ctrl-C:\n{err}") from None
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith("edge-agent: interrupted"), err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        ["profile", "list"],
        ["generate", PROMPT, "--max-tokens", "4"],
        ["client", "status"],
        ["client", "generate", PROMPT, "--max-tokens", "1000"],
        ["fleet", "watch", "--broker", "mqtt://127.0.0.1:9", "--once"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_ctrl_c_while_python_imports(daemon: Daemon, argv: list[str]) -> None:
    if argv[0] == "client":
        argv = [*argv, "--socket", str(daemon.socket)]
    proc = spawn(argv, blocked=True)
    proc.send_signal(signal.SIGINT)
    interrupted(proc)


def test_ctrl_c_while_a_generation_streams(daemon: Daemon) -> None:
    """Ten times: the finalizer hang was one try in ~45."""
    for _ in range(10):
        proc = spawn(
            ["client", "generate", PROMPT, "--max-tokens", "1000", "--socket", str(daemon.socket)]
        )
        wait_active(daemon, proc)  # type: ignore[arg-type]
        proc.send_signal(signal.SIGINT)
        interrupted(proc)
    c = daemon.client()
    try:  # and the daemon serves on
        assert c.health() == "SERVING"
    finally:
        c.close()
