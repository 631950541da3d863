"""`profile list|show` and `systemd dropin` as docs/PROFILES.md and docs/SYSTEMD.md show them,
their `--json`, and the one-shot commands' `-v` log lines (each said once). Real subprocesses."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support.paths import FIXTURES, ROOT

PROFILES = ROOT / "firmware_profiles"
FIXTURES = FIXTURES / "boards"
DOC = (ROOT / "docs" / "PROFILES.md").read_text()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "EDGE_AGENT_PROFILE"}
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def why_lines(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    assert "why" in lines, stdout
    return [line.removeprefix("  - ") for line in lines[lines.index("why") + 1 :]]


def test_the_docs_profile_show_examples_run_verbatim(tmp_path: Path) -> None:
    commands = sorted(set(re.findall(r"edge-agent profile show[^`\n#]*", DOC)))
    assert "edge-agent profile show --profile path/to/file.toml" in commands, commands
    board = tmp_path / "path" / "to"
    board.mkdir(parents=True)
    pi5 = (PROFILES / "raspberry-pi-5.toml").read_text()
    (board / "file.toml").write_text(pi5.replace('name = "raspberry-pi-5"', 'name = "file"'))
    for command in commands:
        argv = shlex.split(command.strip())
        assert argv[0] == "edge-agent"
        r = subprocess.run(
            [sys.executable, "-m", "agent", *argv[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if k != "EDGE_AGENT_PROFILE"},
        )
        assert r.returncode == 0, (command, r.stderr)
        reasons = why_lines(r.stdout)
        assert reasons, (command, r.stdout)
        if "--profile" in argv:
            assert r.stdout.startswith("file: Raspberry Pi 5")
            assert reasons == ["profile file path/to/file.toml given explicitly"]


def test_profile_show_prints_the_reasons_detection_gives() -> None:
    root = str(FIXTURES / "raspberry-pi-5")
    shown = cli("profile", "show", "--root", root)
    assert shown.returncode == 0, shown.stderr
    detected = json.loads(cli("profile", "detect", "--root", root, "--json").stdout)
    assert shown.stdout.startswith(f"{detected['profile']}: ")
    assert why_lines(shown.stdout) == detected["reasons"]
    assert any("Raspberry Pi 5" in r and "score" in r for r in detected["reasons"])
    js = json.loads(cli("profile", "show", "--root", root, "--json").stdout)
    assert js["name"] == "raspberry-pi-5" and js["reasons"] == detected["reasons"]


def _documented_keys() -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+)` \|", DOC, flags=re.M))


def test_profile_json_is_the_toml_keys_with_the_files_values() -> None:
    r = cli("profile", "list", "--json")
    assert r.returncode == 0, r.stderr
    docs = {p["name"]: p for p in json.loads(r.stdout)["profiles"]}
    files = sorted(PROFILES.glob("*.toml"))
    assert set(docs) == {f.stem for f in files}
    documented = _documented_keys()
    for f in files:
        data = tomllib.loads(f.read_text())
        doc = docs[f.stem]
        assert set(doc) == {"name", "description", "source", "board", "runtime", "npu"} | {
            "model",
            "generation",
            "kv",
        }
        assert Path(doc["source"]).resolve() == f.resolve()
        assert (doc["name"], doc["description"]) == (data["name"], data["description"])
        for table in ("board", "runtime", "model", "generation", "kv"):
            assert set(doc[table]) <= documented, (f.name, set(doc[table]) - documented)
            for key, value in data.get(table, {}).items():
                assert doc[table][key] == value, (f.name, table, key)
        if "npu" in data:
            npu = data["npu"]
            assert doc["npu"] == {
                "kind": npu["kind"],
                "library": npu["library"],
                "options": npu.get("options", {}),
            }
        else:
            assert doc["npu"] is None
        one = json.loads(cli("profile", "show", f.stem, "--json").stdout)
        assert {k: v for k, v in one.items() if k != "reasons"} == doc


def test_systemd_dropin_json() -> None:
    for name in ("coral-dev-board", "generic-x86_64"):
        data = tomllib.loads((PROFILES / f"{name}.toml").read_text())
        text = cli("systemd", "dropin", "--profile", name, "--socket-group", "apps")
        r = cli("systemd", "dropin", "--profile", name, "--json", "--socket-group", "apps")
        assert r.returncode == 0 and text.returncode == 0, r.stderr + text.stderr
        doc = json.loads(r.stdout)
        assert set(doc) == {
            "profile",
            "path",
            "memory_high_bytes",
            "memory_max_bytes",
            "device_allow",
            "group",
            "exec_start",
            "text",
        }
        assert doc["profile"] == name and doc["group"] == "apps" and doc["exec_start"] is None
        assert doc["path"] == "etc/systemd/system/edge-agent.service.d/10-profile.conf"
        assert doc["text"] == text.stdout and "\nGroup=apps\n" in doc["text"]
        # docs/SYSTEMD.md: MemoryHigh = max_num_bytes + 128 MiB, MemoryMax = that + 64 MiB
        high = data["runtime"]["max_num_bytes"] + (128 << 20)
        assert (doc["memory_high_bytes"], doc["memory_max_bytes"]) == (high, high + (64 << 20))
        assert f"MemoryHigh={high}\n" in doc["text"]
        nodes = data["board"].get("npu_nodes", [])
        assert doc["device_allow"] == nodes
        assert re.findall(r"^DeviceAllow=(\S+) rw$", doc["text"], flags=re.M) == nodes


def _log_lines(stderr: str) -> list[str]:
    return [
        line for line in stderr.splitlines() if re.match(r"(DEBUG|INFO|WARNING|ERROR) \S+: ", line)
    ]


def test_one_shot_commands_log_each_line_once(tiny_model_dir: Path) -> None:
    for args in (
        ("-v", "generate", "x", "--model", str(tiny_model_dir), "--max-tokens", "2"),
        ("-v", "systemd", "dropin"),
        ("-v", "profile", "show"),
    ):
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        lines = _log_lines(r.stderr)
        assert lines, r.stderr
        said = [line.split(": ", 1)[1] for line in lines]
        assert len(said) == len(set(said)), lines
        picked = [line for line in lines if "picked " in line]
        assert len(picked) == 1, lines  # the detected profile's choice, once
