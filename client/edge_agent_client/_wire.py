"""What the sync and asyncio clients share: the target, the client key, the request messages and
the method table."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from edge_agent_client.pb.edge_agent.v1 import agent_pb2 as pb
from edge_agent_client.types import Completion, FinishReason, Message, Stats

# as the daemon has them (agent/config/file.py, agent/api/identity.py)
DEFAULT_SOCKET = "/run/edge-agent/agent.sock"
METADATA_KEY = "edge-agent-client"
KEY_ENV = "EDGE_AGENT_CLIENT_KEY"
MAX_KEY_CHARS = 1024

SERVICE = "/edge_agent.v1.Agent/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}

MessageLike = Message | Mapping[str, str] | tuple[str, str]


def target_of(socket: str | os.PathLike[str] | None) -> str:
    """A gRPC target: a unix socket path (default the daemon's), or a full `unix:`/`dns:`
    target, or HOST:PORT."""
    s = os.fspath(socket) if socket is not None else DEFAULT_SOCKET
    if s.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return s
    if "/" in s:
        return f"unix:{s}"
    return s


def check_key(key: str) -> str:
    if not key or len(key) > MAX_KEY_CHARS or not (key.isascii() and key.isprintable()):
        raise ValueError(f"a client key must be 1 to {MAX_KEY_CHARS} printable ASCII characters")
    return key


def default_key_path() -> Path:
    """`$XDG_CONFIG_HOME/edge-agent/client-key` (default `~/.config/...`): the command-line
    client's key file, so an app and `edge-agent client` see the same sessions."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "edge-agent" / "client-key"


def load_or_create_key(path: Path) -> str:
    """The key stored at `path`; a new random one (mode 0600, directory 0700) if absent, created
    atomically so two clients starting at once end up with the same key."""
    with contextlib.suppress(FileNotFoundError):
        return check_key(path.read_text().strip())
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return check_key(path.read_text().strip())


def resolve_key(key: str | None) -> str:
    """`key` if given ("" = no key: the anonymous namespace), else $EDGE_AGENT_CLIENT_KEY, else
    the key file (created on first use), the way `edge-agent client` finds its key."""
    if key is not None:
        return check_key(key) if key else ""
    env = os.environ.get(KEY_ENV)
    if env:
        return check_key(env)
    return load_or_create_key(default_key_path())


def metadata_of(key: str) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, key),) if key else ()


def _message(m: MessageLike) -> pb.ChatMessage:
    if isinstance(m, Message):
        return pb.ChatMessage(role=m.role, content=m.content)
    if isinstance(m, tuple):
        role, content = m
        return pb.ChatMessage(role=role, content=content)
    return pb.ChatMessage(role=m["role"], content=m["content"])


def generate_request(
    prompt: str | Sequence[MessageLike],
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: Sequence[str],
    session_id: str | None,
    json_schema: str | Mapping[str, Any] | None,
    json_object: bool,
    regex: str | None,
    grammar: str | None,
    speculation: str | None = None,
    logit_bias: Mapping[int, float] | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    repeat_last_n: int | None = None,
) -> pb.GenerateRequest:
    """The GenerateRequest for a prompt (a string) or chat messages (a sequence)."""
    if isinstance(stop, str):
        raise TypeError("stop is a sequence of strings, not one string")
    request = pb.GenerateRequest(
        stop=list(stop), session_id=session_id or "", speculation=speculation or ""
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.chat.messages.extend(_message(m) for m in prompt)
        if not request.chat.messages:
            request.chat.SetInParent()  # an empty conversation: the daemon says what is wrong
    if max_tokens is not None:
        request.max_tokens = max_tokens
    sampling = request.sampling
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if top_k is not None:
        sampling.top_k = top_k
    if seed is not None:
        sampling.seed = seed
    for token, bias in (logit_bias or {}).items():
        sampling.logit_bias[token] = bias
    if presence_penalty is not None:
        sampling.presence_penalty = presence_penalty
    if frequency_penalty is not None:
        sampling.frequency_penalty = frequency_penalty
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if repeat_last_n is not None:
        sampling.repeat_last_n = repeat_last_n
    kinds = [json_schema is not None, json_object, regex is not None, grammar is not None]
    if sum(kinds) > 1:
        raise ValueError("at most one of json_schema, json_object, regex and grammar")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        request.constraint.json_schema = text
    elif json_object:
        request.constraint.json_object = True
    elif regex is not None:
        request.constraint.regex = regex
    elif grammar is not None:
        request.constraint.grammar = grammar
    return request


class Collector:
    """Chunks folded into a `Completion`."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.stats: Stats | None = None
        self.error = ""
        self.request_id = ""

    def add(
        self,
        text: str,
        ids: Sequence[int],
        reason: FinishReason | None,
        stats: Stats | None,
        error: str,
        request_id: str,
    ) -> None:
        self.text.append(text)
        self.token_ids.extend(ids)
        self.finish_reason = reason or self.finish_reason
        self.stats = stats or self.stats
        self.error = error or self.error
        self.request_id = request_id or self.request_id

    def completion(self, cancelled: bool) -> Completion:
        reason: FinishReason = self.finish_reason or ("cancelled" if cancelled else "error")
        return Completion(
            "".join(self.text),
            tuple(self.token_ids),
            reason,
            self.stats,
            self.error,
            self.request_id,
        )


# method → (request serializer, response parser); responses are parsed by the message class
UNARY: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], Any]]] = {
    name: (lambda m: m.SerializeToString(), response.FromString)
    for name, response in dict[str, Any](
        {
            "Tokenize": pb.TokenizeResponse,
            "Detokenize": pb.DetokenizeResponse,
            "GetModelInfo": pb.ModelInfo,
            "GetStatus": pb.AgentStatus,
            "CreateSession": pb.Session,
            "ForkSession": pb.Session,
            "ListSessions": pb.ListSessionsResponse,
            "DeleteSession": pb.DeleteSessionResponse,
        }
    ).items()
}


def health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest{service} by hand: the client does not depend on
    grpcio-health-checking for one string field."""
    data = service.encode()
    return (b"\x0a" + _varint(len(data)) + data) if data else b""


def health_status(data: bytes) -> str:
    """HealthCheckResponse.status (field 1, an enum) as its name."""
    i = 0
    while i < len(data):
        tag, i = _read_varint(data, i)
        if tag & 7 == 0:
            value, i = _read_varint(data, i)
            if tag >> 3 == 1:
                return HEALTH_STATUS.get(value, str(value))
        elif tag & 7 == 2:
            size, i = _read_varint(data, i)
            i += size
        else:
            raise ValueError(f"unexpected wire type {tag & 7} in a HealthCheckResponse")
    return HEALTH_STATUS[0]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i
