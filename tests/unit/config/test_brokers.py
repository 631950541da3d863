"""`[fleet] broker` as one URL or a list of a cluster's nodes, `--broker` given again for each,
and the list kept in a rollout's state (docs/FLEET.md, "Broker clusters")."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from agent.base.errors import ConfigError
from agent.cli.fleet.common import _connection, _connection_args
from agent.config.file import Broker, parse_broker, parse_config
from agent.fleet.mqtt import MqttOptions
from agent.operator.link import FleetError, _client_id, _Link
from tests.support.broker import Mosquitto, free_port

SRC = "/etc/edge-agent/agent.toml"


def test_one_broker_stays_a_string() -> None:
    fleet = parse_config({"fleet": {"broker": "mqtt://a.lan"}}, SRC).fleet
    assert fleet.broker == Broker("a.lan", 1883, False) and fleet.other_brokers == ()
    assert MqttOptions.from_config(fleet).brokers == (Broker("a.lan", 1883, False),)


def test_a_list_is_tried_in_order() -> None:
    urls = ["mqtts://a.lan", "mqtts://b.lan:8884", "mqtts://[::1]:8885"]
    fleet = parse_config({"fleet": {"broker": urls}}, SRC).fleet
    assert fleet.broker == Broker("a.lan", 8883, True)
    assert fleet.other_brokers == (Broker("b.lan", 8884, True), Broker("::1", 8885, True))
    opts = MqttOptions.from_config(fleet)
    assert [b.url() for b in opts.brokers] == [
        "mqtts://a.lan:8883",
        "mqtts://b.lan:8884",
        "mqtts://[::1]:8885",
    ]


@pytest.mark.parametrize(
    ("broker", "key", "says"),
    [
        ([], "fleet.broker", "1 to 16 of mqtt://HOST:PORT"),
        (["mqtt://a"] * 2, "fleet.broker[1]", "each broker once"),
        (["mqtt://a", "tcp://b"], "fleet.broker[1]", "mqtt://HOST:PORT"),
        (["mqtt://a", 5], "fleet.broker[1]", "mqtt://HOST:PORT"),
        ([f"mqtt://n{i}" for i in range(17)], "fleet.broker", "1 to 16"),
        (5, "fleet.broker", "mqtt://HOST:PORT"),
    ],
)
def test_bad_broker_lists(broker: object, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"fleet": {"broker": broker}}, SRC)
    assert key in str(err.value) and says in str(err.value)


def test_a_huge_bad_value_is_shown_cut_on_one_line() -> None:
    urls = [f"mqtt://node-{i}.lan" for i in range(300)]
    with pytest.raises(ConfigError) as err:
        parse_config({"fleet": {"broker": urls}}, SRC)
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    assert "mqtt://node-0.lan" in message and f"({len(repr(urls)):,} characters)" in message
    assert message.endswith(
        "allowed: 1 to 16 of mqtt://HOST:PORT or mqtts://HOST:PORT (mqtts: TLS)"
    )
    assert err.value.value == urls  # the whole value stays on the error


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    _connection_args(p)
    config = tmp_path / "agent.toml"
    config.write_text('[fleet]\nbroker = ["mqtt://cfg-a", "mqtt://cfg-b"]\n')
    return p.parse_args([*argv, "--config", str(config)])


def test_broker_flags_repeat_and_replace_the_configs_list(tmp_path: Path) -> None:
    opts, _ = _connection(_args(tmp_path))
    assert [b.host for b in opts.brokers] == ["cfg-a", "cfg-b"]
    opts, _ = _connection(_args(tmp_path, "--broker", "mqtt://x:1", "--broker", "mqtt://y:2"))
    assert [b.url() for b in opts.brokers] == ["mqtt://x:1", "mqtt://y:2"]
    opts, _ = _connection(_args(tmp_path, "--broker", "mqtt://x:1"))
    assert opts.brokers == (Broker("x", 1, False),)


def test_a_rollouts_state_keeps_every_broker() -> None:
    opts = MqttOptions(Broker("a", 1, False), other_brokers=(Broker("b", 2, False),))
    pairs = opts.to_pairs()
    assert ("broker", "mqtt://a:1") in pairs and ("other_brokers", "mqtt://b:2") in pairs
    assert MqttOptions.from_pairs(pairs, "state") == opts
    one = MqttOptions(Broker("a", 1, False))
    assert [k for k, _ in one.to_pairs()].count("other_brokers") == 0  # as before: one broker
    assert MqttOptions.from_pairs(one.to_pairs(), "state") == one


def test_the_operators_link_connects_to_the_first_broker_that_answers(tmp_path: Path) -> None:
    """A dead node (nothing listens on its port) first, then two that answer: the link skips
    the dead one and stays on the first live one; all dead: one error naming each."""
    dead = Broker("127.0.0.1", free_port(), False)
    live = Mosquitto(tmp_path / "a")
    other = Mosquitto(tmp_path / "b")
    try:
        urls = [parse_broker("t", "b", b.url) for b in (live, other)]
        opts = MqttOptions(dead, other_brokers=tuple(urls))
        link = _Link(opts, _client_id("t"), lambda _m: None)
        try:
            link.connect(time.monotonic() + 20)
            assert link.url == live.url and link.connected_once
        finally:
            link.close()
        nowhere = MqttOptions(dead, other_brokers=(Broker("127.0.0.1", free_port(), False),))
        link = _Link(nowhere, _client_id("t"), lambda _m: None)
        with pytest.raises(FleetError, match="no broker answered: cannot connect to mqtt://"):
            link.connect(time.monotonic() + 10)
        link.close()
    finally:
        live.stop()
        other.stop()


def test_run_broker_replaces_the_whole_list() -> None:
    """`edge-agent run --broker URL` names the one broker to use: the config's failover nodes
    do not come back behind it."""
    from agent.daemon.plan import Overrides, apply_overrides

    config = parse_config({"fleet": {"broker": ["mqtt://a.lan", "mqtt://b.lan"]}}, SRC)
    fleet = apply_overrides(config, Overrides(broker="mqtt://c.lan:1884")).fleet
    assert fleet.broker == Broker("c.lan", 1884, False) and fleet.other_brokers == ()
    assert apply_overrides(config, Overrides()).fleet.other_brokers == (
        Broker("b.lan", 1883, False),
    )
