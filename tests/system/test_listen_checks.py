"""`edge-agent run` refuses a TCP address it cannot listen on before it loads the model, and
leaves nothing behind: a busy `--http HOST:PORT` used to be found after the model had loaded
and gRPC had bound its socket (and, with `--tcp`, that socket was left on disk)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.model.directory import demo_model_dir
from tests.support.daemon_harness import NotifyListener


@pytest.fixture
def busy() -> Iterator[int]:
    """A loopback port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, str]]]:
    (tmp / "agent.toml").write_text("")
    notify = NotifyListener(tmp / "notify.sock")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agent", "run", "--profile", "generic-x86_64",
             "--model", str(demo_model_dir()), "--socket", str(tmp / "run" / "agent.sock"),
             "--config", str(tmp / "agent.toml"), "--state-dir", str(tmp / "state"), *args],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "NOTIFY_SOCKET": str(notify.path)},
        )  # fmt: skip
        notify.mark("ended")  # every message the daemon sent has been read
    finally:
        notify.close()
    return done, notify.messages


@pytest.mark.parametrize("flag", ["--http", "--tcp"])
def test_a_busy_port_is_refused_before_the_model_loads(
    tmp_path: Path, busy: int, flag: str
) -> None:
    other = "--tcp" if flag == "--http" else "--http"
    done, said = run(tmp_path, flag, f"127.0.0.1:{busy}", other, f"127.0.0.1:{free_port()}")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("edge-agent: ")]
    assert len(lines) == 1 and f"127.0.0.1:{busy}" in lines[0] and "in use" in lines[0], lines
    assert "Traceback" not in done.stderr
    # nothing was loaded: the daemon says "loading ..." to systemd before it loads a model
    assert not [m for m in said if m.get("STATUS", "").startswith("loading")], said
    # and nothing is left behind
    run_dir = tmp_path / "run"
    assert not run_dir.exists() or not any(run_dir.iterdir()), list(run_dir.iterdir())


def test_the_same_port_twice_is_refused(tmp_path: Path) -> None:
    port = free_port()
    done, _ = run(tmp_path, "--tcp", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{port}")
    assert done.returncode == 2, done.stderr
    assert "the same address as server.tcp" in done.stderr, done.stderr
