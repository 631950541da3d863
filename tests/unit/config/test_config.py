"""The agent configuration file: defaults, validation messages, loopback-only TCP."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.base.errors import ConfigError
from agent.config.file import DEFAULT_SOCKET, AgentConfig, load_config, parse_config

SRC = "/etc/edge-agent/agent.toml"


def test_defaults_when_the_default_file_is_absent(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr("agent.config.file.DEFAULT_PATH", tmp_path / "absent.toml")
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
        ({"fleet": {"broker": "tcp://h:1883"}}, "fleet.broker", "mqtt://HOST:PORT"),
        ({"fleet": {"broker": "mqtt://h:0"}}, "fleet.broker", "mqtts://HOST:PORT"),
        ({"fleet": {"broker": "mqtt://h:1883/x"}}, "fleet.broker", "mqtt://HOST:PORT"),
        ({"fleet": {"protocol": "4"}}, "fleet.protocol", "'5', '3.1.1'"),
        ({"fleet": {"device_id": "a/b"}}, "fleet.device_id", "no / + #"),
        ({"fleet": {"topic_prefix": "fleet/#"}}, "fleet.topic_prefix", "without wildcards"),
        ({"fleet": {"ca_file": "ca.crt"}}, "fleet.ca_file", "an absolute path"),
        ({"fleet": {"cert_file": "/etc/c.crt"}}, "fleet.key_file", "cert_file and key_file"),
        ({"fleet": {"health_interval_s": 0}}, "fleet.health_interval_s", "from 1"),
        ({"fleet": {"brokr": "mqtt://h"}}, "fleet.brokr", "did you mean 'broker'"),
        ({"updates": {"trusted_keys_dir": "keys"}}, "updates.trusted_keys_dir", "absolute"),
        ({"updates": {"max_trial_restarts": 0}}, "updates.max_trial_restarts", "from 1 to 100"),
        ({"updates": {"trial_s": -1}}, "updates.trial_s", "from 0"),
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


def test_fleet_section() -> None:
    assert AgentConfig().fleet.broker is None  # no broker: the fleet link is off
    cfg = parse_config(
        {
            "fleet": {
                "broker": "mqtts://[::1]",
                "protocol": "3.1.1",
                "ca_file": "/etc/edge-agent/fleet/ca.crt",
                "cert_file": "/etc/edge-agent/fleet/dev.crt",
                "key_file": "/etc/edge-agent/fleet/dev.key",
                "device_id": "dev-0042",
                "health_interval_s": 30,
            }
        },
        SRC,
    ).fleet
    assert cfg.broker is not None and (cfg.broker.host, cfg.broker.port) == ("::1", 8883)
    assert cfg.broker.tls and cfg.broker.url() == "mqtts://[::1]:8883"
    assert cfg.protocol == "3.1.1" and cfg.device_id == "dev-0042"
    assert cfg.health_interval_s == 30.0 and cfg.topic_prefix == "fleet/v1"
    plain = parse_config({"fleet": {"broker": "mqtt://broker.lan"}}, SRC).fleet.broker
    assert plain is not None and (plain.port, plain.tls) == (1883, False)


def test_updates_section() -> None:
    cfg = parse_config(
        {"updates": {"trusted_keys_dir": "/etc/k", "trial_s": 10, "max_trial_restarts": 2}}, SRC
    ).updates
    assert (str(cfg.trusted_keys_dir), cfg.trial_s, cfg.max_trial_restarts) == ("/etc/k", 10.0, 2)
    assert cfg.max_payload_bytes == 4 << 30 and AgentConfig().updates.trial_s == 300.0
