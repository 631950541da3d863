"""The agent config's `[fleet]` section (docs/FLEET.md, docs/CONFIG.md): the broker, how to
reach it, the device's id, group and tags, and the payload encoding. `agent.config.file` parses the
file and hands this module the section's table."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.base.errors import ConfigError
from agent.base.tomltable import Table

FLEET = (
    "broker",
    "protocol",
    "ca_file",
    "cert_file",
    "key_file",
    "username",
    "password_file",
    "device_id",
    "topic_prefix",
    "keepalive_s",
    "session_expiry_s",
    "health_interval_s",
    "health_min_interval_s",
    "max_command_bytes",
    "max_events",
    "group",
    "tags",
    "encoding",
)
FLEET_ENCODINGS = ("protobuf", "json")
GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:=/-]{0,127}")
MAX_TAGS = 32
MQTT_PROTOCOLS = ("5", "3.1.1")
BROKER_FORMAT = "mqtt://HOST:PORT or mqtts://HOST:PORT (mqtts: TLS)"
MAX_BROKERS = 16


@dataclass(frozen=True, slots=True)
class Broker:
    host: str
    port: int
    tls: bool

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"


# device ids become topic levels and usernames in the broker's ACL (%u): no wildcards, no '/'
DEVICE_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
DEVICE_ID_RULE: Final = "1-128 of A-Z a-z 0-9 _ . : - (a letter or digit first, no / + #)"


def is_device_id(text: str) -> bool:
    """Whether `text` can be a device id: a topic level and a broker username. The one place
    the rule is checked (the config, the fleet link's topics, the operator's tools, the CLI)."""
    return DEVICE_ID_RE.fullmatch(text) is not None


def check_device_id(device_id: str) -> str:
    """`device_id`, or ValueError saying the rule (`is_device_id`)."""
    if not is_device_id(device_id):
        raise ValueError(f"device id {device_id!r} is not valid: {DEVICE_ID_RULE}")
    return device_id


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The MQTT fleet link (docs/FLEET.md). No broker: the fleet link is off."""

    broker: Broker | None = None  # the first broker tried
    other_brokers: tuple[Broker, ...] = ()  # the rest of `broker = [...]`: failover, in order
    protocol: str = "5"  # "5" | "3.1.1" (old brokers)
    ca_file: Path | None = None  # TLS: the CA that signed the broker's certificate
    cert_file: Path | None = None  # mutual TLS: this device's certificate and key
    key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None  # read at connect; the password never sits in config
    device_id: str | None = None  # default: /etc/machine-id
    topic_prefix: str = "fleet/v1"
    keepalive_s: int = 60
    session_expiry_s: int = 3600  # the broker keeps our subscription and QoS 1 queue this long
    health_interval_s: float = 60.0  # heartbeat: health is republished at least this often
    health_min_interval_s: float = 5.0  # on change: not more often than this
    max_command_bytes: int = 64 * 1024  # larger command payloads get RESOURCE_EXHAUSTED
    max_events: int = 1000  # events kept on disk while the broker is unreachable
    group: str = ""  # the device group rollouts and `fleet watch --group` target ("" = none)
    tags: tuple[str, ...] = ()  # free-form labels announced in birth and health
    encoding: str = "protobuf"  # payloads: "protobuf" (binary) or "json" (its JSON mapping)


def parse_broker(source: str, key: str, value: str) -> Broker:
    """`mqtt://HOST:PORT` or `mqtts://HOST:PORT` (the port defaults to 1883 / 8883)."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("mqtt", "mqtts") or not rest or "/" in rest:
        raise ConfigError(source, key, value, BROKER_FORMAT)
    tls = scheme == "mqtts"
    default_port = "8883" if tls else "1883"
    if rest.startswith("["):  # [IPv6]:PORT
        host, _, tail = rest[1:].partition("]")
        port = (
            tail.removeprefix(":") if tail.startswith(":") else (default_port if not tail else "")
        )
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    else:
        host, port = rest, default_port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(source, key, value, BROKER_FORMAT)
    return Broker(host, int(port), tls)


def parse_brokers(source: str, key: str, value: object) -> tuple[Broker, ...]:
    """`broker = "mqtt://..."` or `broker = ["mqtt://a", "mqtt://b"]`: the nodes of one
    cluster, tried in order (docs/FLEET.md, "Broker clusters"); at least one, no repeats."""
    items = value if isinstance(value, list) else [value]
    if not items or len(items) > MAX_BROKERS:
        raise ConfigError(source, key, value, f"1 to {MAX_BROKERS} of {BROKER_FORMAT}")
    brokers: list[Broker] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if isinstance(value, list) else key
        if not isinstance(item, str):
            raise ConfigError(source, where, item, BROKER_FORMAT)
        broker = parse_broker(source, where, item)
        if broker in brokers:
            raise ConfigError(source, where, item, "each broker once")
        brokers.append(broker)
    return tuple(brokers)


def parse_fleet(t: Table, source: str) -> FleetConfig:
    d = FleetConfig()
    brokers = parse_brokers(source, "fleet.broker", t.raw["broker"]) if "broker" in t.raw else ()
    device = t.optional_text("device_id")
    if device is not None and not is_device_id(device):
        raise t.error("device_id", device, DEVICE_ID_RULE)
    prefix = t.optional_text("topic_prefix") or d.topic_prefix
    if any(c in prefix for c in "+#") or prefix.startswith("/") or prefix.endswith("/"):
        raise t.error("topic_prefix", prefix, "topic levels without wildcards, e.g. fleet/v1")
    fleet = FleetConfig(
        broker=brokers[0] if brokers else None,
        other_brokers=brokers[1:],
        protocol=t.choice("protocol", MQTT_PROTOCOLS) if "protocol" in t.raw else d.protocol,
        ca_file=t.absolute_path("ca_file"),
        cert_file=t.absolute_path("cert_file"),
        key_file=t.absolute_path("key_file"),
        username=t.optional_text("username"),
        password_file=t.absolute_path("password_file"),
        device_id=device,
        topic_prefix=prefix,
        keepalive_s=t.integer("keepalive_s", 5, 3600, d.keepalive_s),
        session_expiry_s=t.integer("session_expiry_s", 0, 7 * 24 * 3600, d.session_expiry_s),
        health_interval_s=t.number("health_interval_s", 1, 86400, default=d.health_interval_s),
        health_min_interval_s=t.number(
            "health_min_interval_s", 0.1, 3600, default=d.health_min_interval_s
        ),
        max_command_bytes=t.size("max_command_bytes", 1024, 64 << 20, d.max_command_bytes),
        max_events=t.integer("max_events", 1, 1_000_000, d.max_events),
        group=_fleet_group(t),
        tags=_fleet_tags(t),
        encoding=t.choice("encoding", FLEET_ENCODINGS) if "encoding" in t.raw else d.encoding,
    )
    if (fleet.cert_file is None) != (fleet.key_file is None):
        missing = "key_file" if fleet.key_file is None else "cert_file"
        raise t.error(missing, None, "cert_file and key_file together (mutual TLS)")
    return fleet


def _fleet_group(t: Table) -> str:
    group = t.optional_text("group") or ""
    if group and not GROUP_RE.fullmatch(group):
        raise t.error("group", group, "1-64 of A-Z a-z 0-9 _ . : - (a letter or digit first)")
    return group


def _fleet_tags(t: Table) -> tuple[str, ...]:
    tags = t.text_list("tags", ())
    for tag in tags:
        if not TAG_RE.fullmatch(tag):
            raise t.error(
                "tags", tag, "1-128 of A-Z a-z 0-9 _ . : = / - each (a letter or digit first)"
            )
    if len(tags) > MAX_TAGS or len(set(tags)) != len(tags):
        raise t.error("tags", list(tags), f"at most {MAX_TAGS} distinct tags")
    return tags
