"""Every command's --help ends with a worked example, and `edge-agent completion bash` gives a
script that a real bash uses to complete commands and flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent.cli import build_parser
from agent.cli.examples import EXAMPLES, commands


def test_every_command_shows_an_example() -> None:
    parser = build_parser()
    names = []
    for name, p in commands(parser):
        names.append(name)
        text = p.format_help()
        assert f"example:\n  {EXAMPLES[name]}\n" in text, name
        assert "edge-agent" in EXAMPLES[name], name
    assert set(names) == set(EXAMPLES)  # no example for a command that is gone


def test_help_as_a_user_sees_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent", "fleet", "rollout", "start", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0
    assert done.stdout.rstrip().endswith(EXAMPLES["fleet rollout start"])


def _complete(script: Path, words: list[str]) -> list[str]:
    """What bash offers after `words` (the last one being completed), through the script."""
    line = " ".join(words)
    probe = (
        f"source {script}\n"
        f"COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; COMP_LINE='{line}'; "
        f"COMP_POINT={len(line)}\n"
        "_shtab_edge_agent\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_bash_completion_completes_commands_and_flags(tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "agent", "completion", "bash"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    script = tmp_path / "edge-agent.bash"
    script.write_text(made.stdout)
    assert "client" in _complete(script, ["edge-agent", "cl"])
    assert _complete(script, ["edge-agent", "client", "st"]) == ["status"]
    assert "--max-tokens" in _complete(script, ["edge-agent", "client", "generate", "--max"])
