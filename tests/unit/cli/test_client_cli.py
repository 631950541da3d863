"""What people expect of a CLI like ollama's, against a real daemon on the demo model: the
socket from `$EDGE_AGENT_SOCKET` or the config, `-` reads the prompt from stdin, `client
status` / `info` readable by default and JSON with --json, and an interactive `client chat`
(history, several lines between \"\"\" lines, Ctrl-D leaves). Greedy everywhere: the same
request gives the same tokens, so two ways of asking are compared token for token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.model.directory import demo_model_dir
from tests.support.daemon_harness import Daemon

GREEDY = ("--temperature", "0", "--max-tokens", "12", "--json")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("client-cli"), demo_model_dir())
    yield d
    assert d.stop() == 0, d.read_log()


def cli(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "EDGE_AGENT_SOCKET"}
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        input=stdin, capture_output=True, text=True, timeout=120,
        env={**base, "EDGE_AGENT_CLIENT_KEY": "client-cli-tests", **(env or {})},
    )  # fmt: skip


def tokens(done: subprocess.CompletedProcess[str]) -> list[int]:
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1])["tokens"])


def test_the_socket_from_the_environment_and_the_config(daemon: Daemon, tmp_path: Path) -> None:
    env = {"EDGE_AGENT_SOCKET": str(daemon.socket)}
    assert cli("client", "health", env=env).stdout.strip() == "SERVING"
    config = tmp_path / "agent.toml"
    config.write_text(f'[server]\nsocket = "{daemon.socket}"\n')
    done = cli("client", "health", "--config", str(config))
    assert done.returncode == 0 and done.stdout.strip() == "SERVING", done.stderr
    # the flag wins over both
    wrong = {"EDGE_AGENT_SOCKET": str(tmp_path / "nothing.sock")}
    done = cli("client", "health", "--socket", str(daemon.socket), env=wrong)
    assert done.returncode == 0, done.stderr


def test_a_prompt_from_stdin(daemon: Daemon) -> None:
    env = {"EDGE_AGENT_SOCKET": str(daemon.socket)}
    prompt = "def parse(path):\n    "
    want = tokens(cli("client", "generate", prompt, *GREEDY, env=env))
    assert tokens(cli("client", "generate", "-", *GREEDY, stdin=prompt, env=env)) == want
    # and in-process, without the daemon
    alone = tokens(cli("generate", prompt, *GREEDY))
    assert tokens(cli("generate", "-", *GREEDY, stdin=prompt)) == alone


def test_status_and_info_read_as_text_and_as_json(daemon: Daemon) -> None:
    env = {"EDGE_AGENT_SOCKET": str(daemon.socket)}
    for what in ("status", "info"):
        text = cli("client", what, env=env)
        assert text.returncode == 0, text.stderr
        assert not text.stdout.lstrip().startswith("{")
        lines = text.stdout.splitlines()
        assert all(":" in line for line in lines), text.stdout
        doc = json.loads(cli("client", what, "--json", env=env).stdout)
        assert isinstance(doc, dict) and doc
    status = cli("client", "status", env=env).stdout
    assert "uptime:" in status and " s\n" in status  # a duration with its unit, rounded
    assert "MiB" in status and '"' not in status  # sizes readable, no quoted numbers


def test_an_interactive_chat_keeps_the_history(daemon: Daemon) -> None:
    env = {"EDGE_AGENT_SOCKET": str(daemon.socket)}
    first, second = "def add(a, b):", "class Point:\n    def norm(self):"
    typed = f'{first}\n"""\n{second}\n"""\n'  # Ctrl-D (end of input) after the second
    done = cli("client", "chat", *GREEDY, stdin=typed, env=env)
    assert done.returncode == 0, done.stderr
    replies = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(replies) == 2
    one = json.loads(cli("client", "chat", first, *GREEDY, env=env).stdout)
    assert replies[0]["tokens"] == one["tokens"]
    two = cli("client", "chat", second, "--turn", f"user:{first}",
              "--turn", f"assistant:{one['text']}", *GREEDY, env=env)  # fmt: skip
    assert replies[1]["tokens"] == tokens(two)
    assert ">>>" not in done.stdout  # no prompts when stdin is not a terminal
