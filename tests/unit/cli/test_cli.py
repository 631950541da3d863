"""The `edge-agent` command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import FIXTURES, ROOT

FIXTURES = FIXTURES / "boards"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_profile_list_names_every_shipped_profile() -> None:
    r = cli("profile", "list")
    assert r.returncode == 0, r.stderr
    names = {line.split()[0] for line in r.stdout.splitlines()}
    assert {"generic-x86_64", "raspberry-pi-5", "raspberry-pi-zero-2w", "coral-dev-board"} <= names


def test_detect_on_a_fixture_tree_says_why() -> None:
    r = cli("profile", "detect", "--root", str(FIXTURES / "raspberry-pi-5"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["profile"] == "raspberry-pi-5"
    assert any("Raspberry Pi 5" in reason for reason in doc["reasons"])


def test_bad_profile_is_one_line_and_exit_2(tmp_path: Path) -> None:
    src = (ROOT / "firmware_profiles" / "generic-x86_64.toml").read_text()
    bad = tmp_path / "generic-x86_64.toml"
    bad.write_text(src.replace("num_threads = 2", "num_threads = 0"))
    r = cli("--profile", str(bad), "profile", "show")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert str(bad) in lines[0] and "runtime.num_threads" in lines[0] and "0" in lines[0]


def test_generate_json_on_a_tiny_model(tiny_model_dir: Path) -> None:
    r = cli(
        "generate",
        "def f(x):",
        "--model",
        str(tiny_model_dir),
        "--profile",
        "generic-x86_64",
        "--max-tokens",
        "6",
        "--seed",
        "3",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) >= {"text", "tokens", "stats", "finish_reason"}
    assert set(doc["stats"]) >= {"ttft_ms", "prefill_tok_s", "decode_tok_s", "accelerator"}
    assert doc["stats"]["accelerator"] == "xnnpack"
    # exactly what the finish says: 6 tokens at the length, fewer when a stop ended it early
    n = len(doc["tokens"])
    assert doc["finish_reason"] in ("length", "stop")
    assert n == 6 if doc["finish_reason"] == "length" else n < 6
    assert doc["stats"]["generated_tokens"] == n
    again = json.loads(
        cli(
            "generate",
            "def f(x):",
            "--model",
            str(tiny_model_dir),
            "--max-tokens",
            "6",
            "--seed",
            "3",
            "--json",
        ).stdout
    )
    assert again["tokens"] == doc["tokens"]


def test_generate_streams_text_to_stdout(tiny_model_dir: Path) -> None:
    r = cli("generate", "x", "--model", str(tiny_model_dir), "--max-tokens", "5", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "tokens" in r.stderr and "decode" in r.stderr  # the summary line
    assert "INFO:" not in r.stderr  # LiteRT's native logs stay off the terminal


def test_bad_sampling_parameter_exit_2(tiny_model_dir: Path) -> None:
    r = cli("generate", "x", "--model", str(tiny_model_dir), "--top-p", "1.5")
    assert r.returncode == 2
    assert "top_p = 1.5" in r.stderr and "Traceback" not in r.stderr


def test_model_inspect_reports_layout_and_quantization(tiny_model_dir: Path) -> None:
    r = cli("model", "inspect", str(tiny_model_dir), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    by_quant = {v["quantization"]: v for v in doc["variants"]}
    assert set(by_quant) == {"fp32", "int8"}
    for v in by_quant.values():
        assert v["sha256_ok"] is True
        assert v["llm"]["kv_layout"] == "transposed"
        assert v["llm"]["context_length"] == 128
        assert v["llm"]["prefill_lengths"] == [8, 32]
    kinds8 = {w["kind"] for w in by_quant["int8"]["weights"] if w["op"] == "FULLY_CONNECTED"}
    kinds32 = {w["kind"] for w in by_quant["fp32"]["weights"] if w["op"] == "FULLY_CONNECTED"}
    assert kinds32 == {"float32"}
    assert any(k.startswith("int8") for k in kinds8)
    assert by_quant["int8"]["size"] < by_quant["fp32"]["size"] / 2
    text = cli("model", "inspect", str(tiny_model_dir)).stdout
    assert "KV layout   transposed" in text and "fused ops" in text


def test_client_key_file_is_private_and_stable(tmp_path: Path) -> None:
    from agent.api.identity import load_or_create_key, owner_of

    path = tmp_path / "cfg" / "edge-agent" / "client-key"
    key = load_or_create_key(path)
    assert len(key) == 64 and key == load_or_create_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["client-key"]  # no temporary left
    owner = owner_of(key)
    assert len(owner) == 32 and key not in owner and owner == owner_of(key)
    assert owner != owner_of(key + "x") and owner_of("") == ""


def test_client_key_comes_from_flag_env_or_file(tmp_path: Path, monkeypatch) -> None:
    from agent.api.identity import KEY_ENV, resolve_key

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv(KEY_ENV, raising=False)
    from_file = resolve_key(None)
    assert (tmp_path / "edge-agent" / "client-key").read_text().strip() == from_file
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert resolve_key(None) == "from-env"
    assert resolve_key("from-flag") == "from-flag"


def test_bad_client_key_is_refused_before_connecting(tmp_path: Path) -> None:
    r = cli(
        "client",
        "session",
        "list",
        "--socket",
        str(tmp_path / "none.sock"),
        "--client-key",
        "k\u00e9y",
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "printable ASCII" in r.stderr


def test_session_table() -> None:
    from agent.api.grpc.client import SessionEntry
    from agent.cli.client import session_table

    now = 1_000_000.0
    rows = [
        SessionEntry("a1", "bound", 42, 43008, "error", now - 600, now - 5),
        SessionEntry("b2", "disk", 1000, 1 << 20, "truncate", now - 90000, now - 7300),
    ]
    assert session_table(rows, now).splitlines() == [
        "ID  TIER   TOKENS   KiB  LAST USE",
        "a1  bound      42    42  5 s ago",
        "b2  disk     1000  1024  2 h ago",
    ]


def test_every_command_s_help_renders() -> None:
    """argparse formats help strings with %: a bare `5%` in one made `fleet rollout start
    --help` a traceback. Every (sub)command's help is rendered here, and one for real."""
    import argparse

    from agent.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        assert parser.format_help(), path
        found = [path]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += walk(sub, (*path, name))
        return found

    paths = walk(build_parser(), ())
    assert ("fleet", "rollout", "start") in paths and len(paths) > 30
    out = cli("fleet", "rollout", "start", "--help")
    assert out.returncode == 0 and "100%" in out.stdout, out.stderr
