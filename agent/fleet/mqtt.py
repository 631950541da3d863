"""One way to make a paho-mqtt client for the fleet link, used by the agent and by the operator
tools: protocol (MQTT 5 by default, 3.1.1 for old brokers), TLS and mutual TLS, username and a
password read from a file, and the payload's properties: MQTT 5's Content-Type and Payload
Format Indicator, the older `content-type` user property, response topic and correlation data.
`outgoing` encodes a message with its properties, `decode_message` reads one back
(`agent.fleet.codec` does the encoding)."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import paho.mqtt.client as mqtt
from google.protobuf.message import Message as ProtoMessage
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.base.errors import ConfigError
from agent.config.file import BROKER_FORMAT, Broker, FleetConfig, parse_broker
from agent.fleet.codec import (
    PROTOBUF,
    ContentType,
    content_type,
    decode,
    encode,
    format_indicator,
    parse_content_type,
)

CONTENT_TYPE_KEY = "content-type"  # the user property older operator tools read
M = TypeVar("M", bound=ProtoMessage)


@dataclass(frozen=True, slots=True)
class MqttOptions:
    """How to reach the broker: the connection half of `FleetConfig`. `other_brokers`: the
    rest of a cluster's nodes, tried in order after `broker` (docs/FLEET.md, "Broker
    clusters")."""

    broker: Broker
    other_brokers: tuple[Broker, ...] = ()
    protocol: str = "5"
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None
    keepalive_s: int = 60
    encoding: str = PROTOBUF  # what we publish: "protobuf" or "json"; we read both

    @classmethod
    def from_config(cls, fleet: FleetConfig) -> MqttOptions:
        assert fleet.broker is not None
        names = {f.name for f in dataclasses.fields(cls)} - {"broker"}
        return cls(fleet.broker, **{n: getattr(fleet, n) for n in names})

    @property
    def v5(self) -> bool:
        return self.protocol == "5"

    @property
    def brokers(self) -> tuple[Broker, ...]:
        """Every broker, the first one first."""
        return (self.broker, *self.other_brokers)

    def to_pairs(self) -> tuple[tuple[str, str], ...]:
        """Every field as text (the broker as its URL, unset ones left out): what a rollout's
        state keeps so that `resume` connects as `start` did. No secret is in it: the password
        stays in its file."""
        out = [("broker", self.broker.url())]
        if self.other_brokers:
            out.append(("other_brokers", " ".join(b.url() for b in self.other_brokers)))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = value.resolve()  # a resume may run from another directory
            if f.name not in ("broker", "other_brokers") and value is not None:
                out.append((f.name, str(value)))
        return tuple(out)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]], source: str) -> MqttOptions:
        """`to_pairs` read back; `source` names where they came from in an error."""
        got = dict(pairs)
        if "broker" not in got:
            raise ConfigError(source, "connection.broker", None, BROKER_FORMAT)
        paths = ("ca_file", "cert_file", "key_file", "password_file")
        try:
            return cls(
                broker=parse_broker(source, "broker", got["broker"]),
                other_brokers=tuple(
                    parse_broker(source, "other_brokers", url)
                    for url in got.get("other_brokers", "").split()
                ),
                protocol=got.get("protocol", "5"),
                keepalive_s=int(got.get("keepalive_s", "60")),
                encoding=got.get("encoding", PROTOBUF),
                username=got.get("username"),
                **{p: Path(got[p]) if p in got else None for p in paths},
            )
        except ValueError as exc:  # keepalive_s
            raise ConfigError(source, "connection", got, f"a kept connection ({exc})") from exc


def new_client(client_id: str, opts: MqttOptions, *, persistent: bool) -> mqtt.Client:
    """A configured, unconnected client. `persistent`: the broker keeps our subscriptions and
    queued QoS 1 messages across disconnects (MQTT 5: with the expiry given at connect)."""
    if opts.v5:
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    else:
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=not persistent,
            protocol=mqtt.MQTTv311,
        )
    if opts.broker.tls:
        try:
            client.tls_set(
                ca_certs=str(opts.ca_file) if opts.ca_file else None,
                certfile=str(opts.cert_file) if opts.cert_file else None,
                keyfile=str(opts.key_file) if opts.key_file else None,
                cert_reqs=ssl.CERT_REQUIRED,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                "[fleet]",
                "fleet.ca_file/cert_file/key_file",
                str(exc),
                "readable PEM files (CA, and certificate + key together)",
            ) from exc
    if opts.username is not None:
        client.username_pw_set(opts.username, _password(opts.password_file))
    return client


def _password(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            "[fleet]", "fleet.password_file", str(path), f"a readable file ({exc.strerror})"
        ) from exc


def connect_properties(opts: MqttOptions, session_expiry_s: int) -> Properties | None:
    """MQTT 5 CONNECT properties: how long the broker keeps our session after a disconnect."""
    if not opts.v5:
        return None
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = session_expiry_s
    return props


def publish_properties(
    opts: MqttOptions,
    message_name: str,
    *,
    response_topic: str | None = None,
    correlation: bytes | None = None,
) -> Properties | None:
    """PUBLISH properties naming the payload (MQTT 5; None on 3.1.1): Content-Type and the
    `content-type` user property in `opts.encoding`, the Payload Format Indicator."""
    if not opts.v5:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    ctype = content_type(message_name, opts.encoding)
    props.ContentType = ctype
    props.PayloadFormatIndicator = format_indicator(opts.encoding)
    props.UserProperty = [(CONTENT_TYPE_KEY, ctype)]
    if response_topic is not None:
        props.ResponseTopic = response_topic
    if correlation is not None:
        props.CorrelationData = correlation
    return props


def outgoing(
    opts: MqttOptions,
    msg: ProtoMessage,
    *,
    response_topic: str | None = None,
    correlation: bytes | None = None,
) -> tuple[bytes, Properties | None]:
    """`msg` encoded as `opts.encoding` says, and the PUBLISH properties that name it."""
    props = publish_properties(
        opts, msg.DESCRIPTOR.full_name, response_topic=response_topic, correlation=correlation
    )
    return encode(msg, opts.encoding), props


def payload_content(msg: mqtt.MQTTMessage) -> ContentType | None:
    """What a received message says it carries: MQTT 5's Content-Type, else the `content-type`
    user property; None without either (MQTT 3.1.1)."""
    props: Any = getattr(msg, "properties", None)
    value = getattr(props, "ContentType", None) if props is not None else None
    if not value:
        value = next((v for k, v in _user_properties(msg) if k == CONTENT_TYPE_KEY), None)
    return parse_content_type(value) if value else None


def payload_type(msg: mqtt.MQTTMessage) -> str | None:
    """The message name a received message's content type gives, if any."""
    content = payload_content(msg)
    return content.message if content is not None else None


def decode_message(cls: type[M], msg: mqtt.MQTTMessage) -> M:
    """A received payload as a `cls`, in either encoding (`agent.fleet.codec.decode`); raises
    `agent.fleet.codec.PayloadError`."""
    return decode(cls, bytes(msg.payload), payload_content(msg))


def response_route(msg: mqtt.MQTTMessage) -> tuple[str | None, bytes | None]:
    """The MQTT 5 response topic and correlation data of a request, if set."""
    props = getattr(msg, "properties", None)
    if props is None:
        return None, None
    topic = getattr(props, "ResponseTopic", None)
    corr = getattr(props, "CorrelationData", None)
    return topic, bytes(corr) if corr is not None else None


def _user_properties(msg: mqtt.MQTTMessage) -> list[tuple[str, str]]:
    props: Any = getattr(msg, "properties", None)
    pairs = getattr(props, "UserProperty", None) if props is not None else None
    return list(pairs or [])
