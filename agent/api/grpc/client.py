"""`edge-agent client ...`: talk to a running daemon over its socket.

`Client` sends its client key (when it has one) as `edge-agent-client` metadata on every call;
the daemon's sessions answer only to the key that created them (`agent.api.identity`).
"""

from __future__ import annotations

import json
import os
import socket as sockets
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.api.identity import METADATA_KEY, check_key
from agent.base import exitcodes
from agent.base.errors import ERROR_TRAILER
from agent.config.file import DEFAULT_SOCKET
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.pb.edge_agent.v1 import agent_pb2_grpc as pb_grpc

FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


def target_of(socket: str | None) -> str:
    """A gRPC target: a unix socket path, or HOST:PORT, or a full `unix:`/`dns:` target."""
    s = socket or str(DEFAULT_SOCKET)
    if s.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return s
    if "/" in s:
        return f"unix:{s}"
    return s


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole generation as the client collected it."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: dict[str, Any]
    error: str


@dataclass(slots=True)
class Partial:
    """What a generation stream delivered so far; `Client.generate` fills it as messages come,
    so the caller still has the text and tokens when the stream fails or is interrupted."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    last: pb.GenerateResponse | None = None

    def reply(self, finish_reason: str | None = None) -> Reply:
        """The reply so far; `finish_reason` replaces the stream's own (e.g. "cancelled")."""
        last = self.last if self.last is not None else pb.GenerateResponse()
        stats = MessageToDict(last.stats, preserving_proto_field_name=True)
        reason = FINISH_NAMES.get(last.finish_reason, "?")
        return Reply(
            "".join(self.text), list(self.tokens), finish_reason or reason, stats, last.error
        )


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a call failed, as a command line reports it: one line and an exit code."""

    exit_code: int
    message: str


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """One of the caller's sessions, as ListSessions reports it."""

    id: str
    tier: str  # "empty" | "bound" | "host" | "disk"
    tokens: int
    kv_bytes: int
    policy: str
    created_unix: float
    last_used_unix: float


class Client:
    """A blocking client of one daemon. `client_key` (None: anonymous) decides which
    sessions the calls may see and use."""

    def __init__(
        self,
        socket: str | None = None,
        timeout: float | None = None,
        client_key: str | None = None,
    ) -> None:
        self.target = target_of(socket)
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.AgentStub(self.channel)  # type: ignore[no-untyped-call]
        self.timeout = timeout
        self.metadata: tuple[tuple[str, str], ...] = (
            ((METADATA_KEY, check_key(client_key)),) if client_key is not None else ()
        )

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)

    def stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        return self._call("Generate", request)  # type: ignore[no-any-return]

    def generate(
        self, request: pb.GenerateRequest, echo: bool = False, into: Partial | None = None
    ) -> Reply:
        """Run a generation to its end; `echo` writes the text to stdout as it comes.

        Messages are collected in `into` (when given) as they arrive. Anything that ends the
        loop early (an error, KeyboardInterrupt) cancels the call first, so the daemon stops
        generating at once.
        """
        got = into if into is not None else Partial()
        call = self.stream(request)
        try:
            for msg in call:
                got.text.append(msg.text)
                got.tokens.extend(msg.token_ids)
                got.last = msg
                if echo:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
        except BaseException:
            call.cancel()  # type: ignore[attr-defined]
            raise
        return got.reply()

    def info(self) -> dict[str, Any]:
        msg = self._call("GetModelInfo", pb.GetModelInfoRequest())
        return dict(MessageToDict(msg, preserving_proto_field_name=True))

    def status(self) -> dict[str, Any]:
        """GetStatus as JSON-ready values (64-bit counters as strings, as protobuf's JSON
        mapping has them), zeros included."""
        msg = self._call("GetStatus", pb.GetStatusRequest())
        return dict(
            MessageToDict(
                msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
        )

    def create_session(self, policy: str = "") -> str:
        """A new session of this client's; `policy` "" means the agent's default ("error")."""
        return str(self._call("CreateSession", pb.CreateSessionRequest(policy=policy)).id)

    def fork_session(self, session_id: str) -> str:
        return str(self._call("ForkSession", pb.ForkSessionRequest(id=session_id)).id)

    def list_sessions(self) -> list[SessionEntry]:
        reply = self._call("ListSessions", pb.ListSessionsRequest())
        return [
            SessionEntry(
                s.id,
                s.tier,
                s.tokens,
                s.kv_bytes,
                s.policy,
                s.created_unix,
                s.last_used_unix,
            )
            for s in reply.sessions
        ]

    def delete_session(self, session_id: str) -> None:
        self._call("DeleteSession", pb.DeleteSessionRequest(id=session_id))

    def health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))


def build_request(
    prompt: str | None,
    chat: Sequence[tuple[str, str]] | None,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    stop: Sequence[str],
    session: str | None = None,
    speculation: str | None = None,
    logit_bias: Sequence[tuple[int, float]] = (),
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    repeat_last_n: int | None = None,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        stop=list(stop), session_id=session or "", speculation=speculation or ""
    )
    if chat is not None:
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
    else:
        req.prompt = prompt or ""
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if temperature is not None:
        req.sampling.temperature = temperature
    if top_k is not None:
        req.sampling.top_k = top_k
    if top_p is not None:
        req.sampling.top_p = top_p
    if seed is not None:
        req.sampling.seed = seed
    for token, bias in logit_bias:
        req.sampling.logit_bias[token] = bias  # the daemon refuses an id proto cannot carry
    if presence_penalty is not None:
        req.sampling.presence_penalty = presence_penalty
    if frequency_penalty is not None:
        req.sampling.frequency_penalty = frequency_penalty
    if repetition_penalty is not None:
        req.sampling.repetition_penalty = repetition_penalty
    if repeat_last_n is not None:
        req.sampling.repeat_last_n = repeat_last_n
    return req


def reply_json(reply: Reply, error: str | None = None) -> str:
    """`--json` output of a generation; `error` (or the stream's own) when it did not end by
    stop or length."""
    stats = reply.stats
    doc = {
        "text": reply.text,
        "tokens": reply.tokens,
        "finish_reason": reply.finish_reason,
        "stats": {
            "ttft_ms": round(float(stats.get("ttft_ms", 0.0)), 2),
            "prefill_tok_s": round(float(stats.get("prefill_tok_s", 0.0)), 1),
            "decode_tok_s": round(float(stats.get("decode_tok_s", 0.0)), 1),
            "accelerator": stats.get("accelerator", ""),
            "prompt_tokens": int(stats.get("prompt_tokens", 0)),
            "generated_tokens": int(stats.get("generated_tokens", 0)),
            "cached_tokens": int(stats.get("cached_tokens", 0)),
            "truncated_tokens": int(stats.get("truncated_tokens", 0)),
        },
    }
    if error or reply.error:
        doc["error"] = error or reply.error
    return json.dumps(doc, ensure_ascii=False)


def unreachable_reason(target: str) -> str | None:
    """Why nothing answers at a gRPC `target` (None: something accepts connections there).

    Asked only after a call failed with UNAVAILABLE and no error type from the daemon, to say
    whether a daemon was reached at all.
    """
    unix = target.startswith("unix:")
    path = target[len("unix:") :] if unix else ""
    try:
        if unix:
            if os.path.lexists(path) and not stat.S_ISSOCK(os.stat(path).st_mode):
                return "it is not a socket"
            with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as s:
                s.settimeout(2.0)
                s.connect(path)
        else:
            host, _, port = target.rpartition(":")
            if target.startswith(("dns:", "ipv4:", "ipv6:")):
                host = host.split(":", 1)[1].lstrip("/")
            with sockets.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                pass
    except FileNotFoundError:
        return "no socket there"
    except ConnectionRefusedError:
        return "nothing is listening on it (a stale socket)" if unix else "nothing listens there"
    except PermissionError:
        return "permission denied (the socket is for its group: docs/SYSTEMD.md)"
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__
    return None


def error_type_of(exc: grpc.RpcError) -> str | None:
    """The daemon's name for the error that failed a call (its `edge-agent-error` trailer)."""
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == ERROR_TRAILER:
            return str(value)
    return None


def failure_of(exc: grpc.RpcError, target: str, started: bool = False) -> Failure:
    """The exit code and the one line to print for a failed call to `target`; `started`: a
    stream had delivered messages (a daemon that goes away then ended the request: CANCELLED,
    not UNREACHABLE)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    kind = error_type_of(exc)
    if (
        started
        and kind is None
        and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    ):
        return Failure(
            exitcodes.CANCELLED,
            f"{code.name}: the daemon ended the request before it was complete ({details})",
        )
    if code == grpc.StatusCode.UNAVAILABLE and kind is None:
        why = unreachable_reason(target)
        if why is not None:
            where = target[len("unix:") :] if target.startswith("unix:") else target
            return Failure(
                exitcodes.UNREACHABLE,
                f"cannot reach the daemon at {where}: {why}; the daemon may not be running "
                "(systemctl status edge-agent), or it listens elsewhere (--socket)",
            )
    return Failure(exitcodes.for_status(code.name, kind), f"{code.name}: {details}")
