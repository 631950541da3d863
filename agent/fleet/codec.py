"""Fleet payloads, in one place: which message each topic carries, how a message is encoded
(protobuf or its JSON mapping), the content type that names it and MQTT 5's payload format
indicator, and decoding that never misreads (docs/FLEET.md, "Payloads").

Pure: bytes in, messages out; `agent.fleet.mqtt` reads the MQTT properties and calls this.

Decoding picks the encoding from the content type when there is one; without one (MQTT 3.1.1,
or a stock tool that sets none) it sniffs: JSON if the payload starts with ``{``. That is safe
because a protobuf encoder never starts a message with byte 0x7B (field 15 with the
deprecated start-group wire type, which proto3 messages do not have). A payload that does not
decode as the encoding picked raises `PayloadError`; there is no second guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from agent.base.errors import AgentError
from agent.fleet.topics import Parsed
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

M = TypeVar("M", bound=ProtoMessage)

PROTOBUF: Final = "protobuf"
JSON: Final = "json"
ENCODINGS: Final = (PROTOBUF, JSON)
MEDIA_TYPES: Final = {PROTOBUF: "application/x-protobuf", JSON: "application/json"}
FORMAT_INDICATORS: Final = {PROTOBUF: 0, JSON: 1}  # MQTT 5: 0 unspecified bytes, 1 UTF-8
_ENCODING_OF: Final = {media: enc for enc, media in MEDIA_TYPES.items()}

# The message each topic carries, after `<prefix>/<device>/`: what a receiver without a
# content type (MQTT 3.1.1, `fleet decode`) decodes, and the table in docs/FLEET.md.
TOPIC_TYPES: Final[tuple[tuple[str, type[ProtoMessage]], ...]] = (
    ("state", fpb.DeviceState),
    ("health", fpb.Health),
    ("event", fpb.Event),
    ("update/status", fpb.Event),
    ("update/block", opb.BlockRequest),
    ("update/data", opb.Block),
    ("cmd/<name>", fpb.Command),
    ("resp/<requester>", fpb.CommandResponse),
)
_BY_TOPIC: Final = dict(TOPIC_TYPES)

# Command bodies that are messages themselves, and the signed bytes inside them: `render`
# shows them decoded.
_BODIES: Final[dict[str, tuple[type[ProtoMessage], str, type[ProtoMessage]]]] = {
    "update": (opb.SignedManifest, "manifest", opb.Manifest),
    "cancel": (opb.SignedCancel, "cancel", opb.Cancel),
}


class PayloadError(AgentError):
    """A payload that is not the message it should be, in either encoding."""


@dataclass(frozen=True, slots=True)
class ContentType:
    """A payload's content type: `encoding` is "protobuf", "json", or "" for a content type
    that is neither; `message` the ``type=`` parameter (a message's full name), if given."""

    raw: str
    encoding: str
    message: str | None = None


def content_type(message_name: str, encoding: str = PROTOBUF) -> str:
    """The content type of a payload: ``application/json; type=edge_agent.fleet.v1.Health``."""
    return f"{MEDIA_TYPES[encoding]}; type={message_name}"


def parse_content_type(value: str) -> ContentType:
    """What a content type says; encoding "" if it is neither of ours."""
    head, _, rest = value.partition(";")
    message = None
    for param in rest.split(";"):
        key, _, v = param.strip().partition("=")
        if key.strip().lower() == "type" and v.strip():
            message = v.strip().strip('"')
    return ContentType(value, _ENCODING_OF.get(head.strip().lower(), ""), message)


def format_indicator(encoding: str) -> int:
    """MQTT 5's Payload Format Indicator for `encoding`."""
    return FORMAT_INDICATORS[encoding]


def topic_type(parsed: Parsed) -> type[ProtoMessage]:
    """The message a fleet topic carries."""
    if parsed.kind == "update":
        return _BY_TOPIC[f"update/{parsed.name}"]
    if parsed.kind == "cmd":
        return fpb.Command
    if parsed.kind == "resp":
        return fpb.CommandResponse
    return _BY_TOPIC[parsed.kind]


def encode(msg: ProtoMessage, encoding: str = PROTOBUF) -> bytes:
    """`msg` as protobuf bytes or as its canonical JSON mapping (UTF-8, compact)."""
    if encoding == JSON:
        return to_json(msg).encode()
    if encoding != PROTOBUF:
        raise ValueError(f"encoding {encoding!r} is not one of {ENCODINGS}")
    data: bytes = msg.SerializeToString()
    return data


def sniff(payload: bytes | bytearray) -> str:
    """The encoding of a payload without a content type (see the module docstring)."""
    return JSON if payload[:1] == b"{" else PROTOBUF


def decode(cls: type[M], payload: bytes, content: ContentType | None = None) -> M:
    """`payload` as a `cls`, in the encoding `content` names (sniffed without one).

    Raises PayloadError if the content type is not ours or names another message, or the
    payload does not decode. JSON fields this build does not know are ignored, as protobuf
    ignores unknown fields: a newer agent's messages still read."""
    name = cls.DESCRIPTOR.full_name
    if content is not None and not content.encoding:
        raise PayloadError(f"content type {content.raw!r} is neither protobuf nor JSON")
    if content is not None and content.message and content.message != name:
        raise PayloadError(f"content type names {content.message}, not {name}")
    encoding = content.encoding if content is not None else sniff(payload)
    msg: M = cls()
    if encoding == PROTOBUF:
        try:
            msg.ParseFromString(payload)
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise PayloadError(f"not a protobuf {name}: {exc}") from exc
        return msg
    try:
        json_format.Parse(payload.decode("utf-8"), msg, ignore_unknown_fields=True)
    except UnicodeDecodeError as exc:
        raise PayloadError(f"not a JSON {name}: not UTF-8 ({exc.reason})") from exc
    except (json_format.ParseError, RecursionError, ValueError) as exc:
        raise PayloadError(f"not a JSON {name}: {exc}") from exc
    return msg


def to_dict(msg: ProtoMessage) -> dict[str, Any]:
    """The protobuf JSON mapping of `msg` (lowerCamelCase names, enums by name, 64-bit
    integers as strings, bytes as base64, default values left out)."""
    doc: dict[str, Any] = json_format.MessageToDict(msg)
    return doc


def to_json(msg: ProtoMessage) -> str:
    """`to_dict` as compact JSON text: what `encoding = "json"` puts on the wire."""
    return json.dumps(to_dict(msg), separators=(",", ":"), ensure_ascii=False)


def render(parsed: Parsed, msg: ProtoMessage) -> dict[str, Any]:
    """`to_dict`, with the body of an ``update`` or ``cancel`` command decoded: a SignedManifest
    (or SignedCancel) with its signed Manifest (Cancel) inside, each marked with ``@type``. A
    body that does not decode stays base64."""
    doc = to_dict(msg)
    spec = _BODIES.get(parsed.name) if parsed.kind == "cmd" else None
    if spec is None or not isinstance(msg, fpb.Command) or not msg.body:
        return doc
    outer_cls, field, inner_cls = spec
    try:
        outer = outer_cls.FromString(msg.body)
        inner = inner_cls.FromString(getattr(outer, field))
    except (DecodeError, RuntimeError, ValueError):
        return doc
    body = {"@type": outer_cls.DESCRIPTOR.full_name, **to_dict(outer)}
    body[field] = {"@type": inner_cls.DESCRIPTOR.full_name, **to_dict(inner)}
    doc["body"] = body
    return doc
