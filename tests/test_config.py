"""The agent configuration file: defaults, validation messages, loopback-only TCP."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import DEFAULT_SOCKET, AgentConfig, load_config, parse_config
from agent.errors import ConfigError

SRC = "/etc/edge-agent/agent.toml"


def test_defaults_when_the_default_file_is_absent(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr("agent.config.DEFAULT_PATH", tmp_path / "absent.toml")
    cfg = load_config(None)
    assert cfg == AgentConfig()
    assert cfg.server.socket == DEFAULT_SOCKET and cfg.server.socket_mode == 0o660
    assert cfg.server.tcp is None


def test_a_named_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.toml"):
        load_config(tmp_path / "absent.toml")


def test_full_file(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text(
        """
[server]
socket = "/run/x/agent.sock"
socket_mode = "0600"
socket_group = "apps"
tcp = "127.0.0.1:50051"
max_message_bytes = 65536
[limits]
max_active = 2
queue_capacity = 8
drain_timeout_s = 5
[model]
path = "/var/lib/edge-agent/models/current"
quantization = "int8"
[log]
level = "debug"
target = "stderr"
[watchdog]
engine_stall_s = 3
tick_s = 0.5
[sessions]
share = true
"""
    )
    cfg = load_config(f)
    assert cfg.source == str(f)
    assert cfg.server.socket == Path("/run/x/agent.sock") and cfg.server.socket_mode == 0o600
    assert cfg.server.socket_group == "apps" and cfg.server.tcp == "127.0.0.1:50051"
    assert (cfg.limits.max_active, cfg.limits.queue_capacity) == (2, 8)
    assert cfg.limits.drain_timeout_s == 5.0
    assert cfg.model.quantization == "int8"
    assert (cfg.log.level, cfg.log.target) == ("debug", "stderr")
    assert (cfg.watchdog.engine_stall_s, cfg.watchdog.tick_s) == (3.0, 0.5)
    assert cfg.sessions.share is True
    assert AgentConfig().sessions.share is False  # sessions are per client unless shared


@pytest.mark.parametrize(
    ("doc", "key", "fragment"),
    [
        ({"sever": {}}, "sever", "did you mean 'server'"),
        ({"server": {"socket": "relative.sock"}}, "server.socket", "an absolute path"),
        ({"server": {"socket_mode": "rw"}}, "server.socket_mode", "octal"),
        ({"server": {"tcp": "0.0.0.0:50051"}}, "server.tcp", "a loopback address"),
        ({"server": {"tcp": "localhost:50051"}}, "server.tcp", "literal IP"),
        ({"server": {"tcp": "127.0.0.1:70000"}}, "server.tcp", "HOST:PORT"),
        ({"limits": {"max_active": 0}}, "limits.max_active", "from 1 to 256"),
        ({"limits": {"queue_capacity": "8"}}, "limits.queue_capacity", "an integer"),
        ({"log": {"level": "loud"}}, "log.level", "'debug', 'info'"),
        ({"watchdog": {"tick_s": 0}}, "watchdog.tick_s", "from 0.05"),
        ({"sessions": {"share": "yes"}}, "sessions.share", "true or false"),
        ({"sessions": {"shared": True}}, "sessions.shared", "did you mean 'share'"),
    ],
)
def test_errors_name_file_key_value_and_rule(doc, key, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(doc, SRC)
    msg = str(err.value)
    assert msg.startswith(f"{SRC}: {key} = ")
    assert fragment in msg


def test_remote_tcp_only_when_allowed() -> None:
    cfg = parse_config({"server": {"tcp": "0.0.0.0:50051", "allow_remote_tcp": True}}, SRC)
    assert cfg.server.tcp == "0.0.0.0:50051"
    assert parse_config({"server": {"tcp": "[::1]:50051"}}, SRC).server.tcp == "[::1]:50051"
