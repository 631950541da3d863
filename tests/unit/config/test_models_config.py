"""`[models]` and `--model NAME=PATH`: several named models, their keep-alive and pinning;
bad input is one line naming the key and what is allowed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agent.base.errors import ConfigError
from agent.cli.run import model_args
from agent.config.file import parse_config
from agent.config.models import DEFAULT_KEEP_ALIVE_S, ModelEntry, parse_keep_alive
from agent.daemon.plan import Overrides, apply_overrides
from tests.unit.cli.test_cli import cli

SRC = "/etc/edge-agent/agent.toml"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        ("0", 0.0),
        (30, 30.0),
        (1.5, 1.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("250ms", 0.25),
        (-1, math.inf),
        ("-1", math.inf),
        ("-5m", math.inf),
    ],
)
def test_keep_alive_reads_seconds_and_ollamas_durations(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", "1d", True, None, [1], float("nan")])
def test_keep_alive_refuses_anything_else(value: object) -> None:
    assert parse_keep_alive(value) is None


def test_models_section_in_the_files_order() -> None:
    cfg = parse_config(
        {
            "models": {
                "keep_alive": "10m",
                "chat": {"path": "/m/chat", "pinned": True},
                "code": {"path": "/m/code.litertlm", "quantization": "int8", "keep_alive": 0},
            }
        },
        SRC,
    )
    assert cfg.models.keep_alive_s == 600.0
    assert cfg.models.entries == (
        ModelEntry("chat", Path("/m/chat"), None, None, True),
        ModelEntry("code", Path("/m/code.litertlm"), "int8", 0.0, False),
    )
    assert parse_config({}, SRC).models.entries == ()
    assert parse_config({}, SRC).models.keep_alive_s == DEFAULT_KEEP_ALIVE_S


@pytest.mark.parametrize(
    ("section", "key", "fragment"),
    [
        ({"keep_alive": "soon"}, "models.keep_alive", "duration"),
        ({"chat": {"path": "/m", "keep_alive": "x"}}, "models.chat.keep_alive", "duration"),
        ({"chat": {}}, "models.chat.path", "absolute path"),
        ({"chat": {"path": "relative"}}, "models.chat.path", "absolute"),
        ({"chat": {"path": "/m", "pin": True}}, "models.chat.pin", "did you mean 'pinned'"),
        ({"chat": "/m"}, "models.chat", "[models.NAME] table"),
        ({"bad name": {"path": "/m"}}, "models.bad name", "a model name"),
    ],
)
def test_bad_models_entries_name_the_key(section: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"models": section}, SRC)
    text = str(e.value)
    assert text.startswith(f"{SRC}: {key} = ") and fragment in text and "\n" not in text


def test_model_path_beside_models_tables_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no \\[model\\] path beside"):
        parse_config({"model": {"path": "/m/a"}, "models": {"b": {"path": "/m/b"}}}, SRC)


def test_command_line_models_replace_the_config(tmp_path: Path) -> None:
    cfg = parse_config({"models": {"chat": {"path": "/m/chat", "pinned": True}}}, SRC)
    one, named = model_args([str(tmp_path / "a"), f"b={tmp_path / 'x'}"])
    assert one is None
    assert named == (ModelEntry("a", tmp_path / "a"), ModelEntry("b", tmp_path / "x"))
    assert apply_overrides(cfg, Overrides(models=named)).models.entries == named
    # one --model PATH: the one model, as ever (it replaces [models] too)
    one, named = model_args([str(tmp_path / "a")])
    assert one == tmp_path / "a" and named == ()
    got = apply_overrides(cfg, Overrides(model=one))
    assert got.models.entries == () and got.model.path == one
    # a path holding "=" after a "/" is a path; named, it may hold one too
    assert model_args([f"n={tmp_path}/x=y"])[1] == (ModelEntry("n", tmp_path / "x=y"),)
    with pytest.raises(ConfigError, match="'x=y' is not valid; allowed: a model name"):
        model_args([f"{tmp_path}/x=y", "b=/m"])  # its stem is no name: NAME=PATH


def test_a_name_given_twice_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = cli("run", "--model", f"a={tmp_path}/x", "--model", f"a={tmp_path}/y")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model" in lines[0] and "'a'" in lines[0], r.stderr
