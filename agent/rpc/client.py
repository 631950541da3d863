"""`edge-agent client ...`: talk to a running daemon over its socket.

`Client` sends its client key (when it has one) as `edge-agent-client` metadata on every call;
the daemon's sessions answer only to the key that created them (`agent.rpc.identity`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.config import DEFAULT_SOCKET
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.pb.edge_agent.v1 import agent_pb2_grpc as pb_grpc
from agent.rpc.identity import METADATA_KEY, check_key

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
        self.channel = grpc.insecure_channel(target_of(socket))
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

    def generate(self, request: pb.GenerateRequest, echo: bool = False) -> Reply:
        text: list[str] = []
        tokens: list[int] = []
        last = pb.GenerateResponse()
        for msg in self.stream(request):
            text.append(msg.text)
            tokens.extend(msg.token_ids)
            if echo:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
            last = msg
        stats = MessageToDict(last.stats, preserving_proto_field_name=True)
        return Reply(
            "".join(text), tokens, FINISH_NAMES.get(last.finish_reason, "?"), stats, last.error
        )

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
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(stop=list(stop), session_id=session or "")
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
    return req


def reply_json(reply: Reply) -> str:
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
    if reply.error:
        doc["error"] = reply.error
    return json.dumps(doc, ensure_ascii=False)
