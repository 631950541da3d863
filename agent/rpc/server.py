"""grpc.aio server on a unix socket: the Agent service, grpc.health.v1 and reflection (v1 and
v1alpha, `agent.rpc.reflection`). What may be removed at the socket's path, before binding and
after serving, is `agent.rpc.unixsocket`'s to decide.

Wire messages become domain values here and never travel inward; domain errors become gRPC
status codes through `agent.errors.GRPC_STATUS`. The engine runs on its own thread; its events
reach the stream through `loop.call_soon_threadsafe` into a per-request asyncio queue, and the
consumer acknowledges each event so the engine pauses a request whose client has fallen behind.

Every call that touches a session runs as its caller's owner (`agent.rpc.identity`): the hash
of the client key in the call's metadata, or "" for everyone when `[sessions] share = true`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from agent.config import AgentConfig, ServerConfig
from agent.engine.chat import ChatMessage, check_messages
from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest, SessionInfo, TierStats, TokenEvent
from agent.errors import ERROR_TRAILER, AgentError, HostError, InvalidRequest, grpc_status_name
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.rpc import reflection, unixsocket
from agent.rpc.identity import key_from_metadata, owner_of
from agent.status import AgentStatus

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Agent"].full_name
FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
}


class Backend(Protocol):
    """What the server needs from the daemon."""

    def engine(self) -> Engine:
        """The engine serving new requests (raises Unavailable when there is none)."""
        ...

    def status(self) -> AgentStatus:
        """The agent's status now (raises Unavailable before a model is loaded)."""
        ...

    @property
    def config(self) -> AgentConfig:
        """The configuration in force (a reload may replace it)."""
        ...


class _Invalid:
    """A request that could not be parsed (bad protobuf, invalid UTF-8 in a string)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return _Invalid(f"request is not a valid {cls.DESCRIPTOR.full_name}: {exc}")

    return parse


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code = getattr(grpc.StatusCode, grpc_status_name(exc))
    kind = ((ERROR_TRAILER, type(exc).__name__),) if isinstance(exc, AgentError) else ()
    await context.abort(code, str(exc), trailing_metadata=kind)


def _check(request: Any) -> None:
    if isinstance(request, _Invalid):
        raise InvalidRequest(request.reason)


def to_request(
    msg: pb.GenerateRequest, engine: Engine, max_tokens_limit: int, owner: str = ""
) -> GenerateRequest:
    """Wire → domain, with every field checked; `owner` is the caller (see `AgentService`)."""
    which = msg.WhichOneof("input")
    messages: tuple[ChatMessage, ...] = ()
    prompt = ""
    if which == "chat":
        messages = tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages)
        check_messages(messages)
    elif which == "prompt":
        prompt = msg.prompt
    else:
        raise InvalidRequest("request has neither a prompt nor chat messages")
    defaults = engine.profile.generation
    s = msg.sampling
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else defaults.temperature,
        top_k=s.top_k if s.HasField("top_k") else defaults.top_k,
        top_p=s.top_p if s.HasField("top_p") else defaults.top_p,
        seed=s.seed if s.HasField("seed") else None,
    )
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else None
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens = {max_tokens} is above this agent's limit {max_tokens_limit}"
        )
    return GenerateRequest(
        prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=tuple(msg.stop),
        session_id=msg.session_id or None,
        owner=owner,
        messages=messages,
    )


def merge_events(events: list[TokenEvent]) -> TokenEvent:
    """Consecutive events of one request as one (text and ids joined, the last one's end)."""
    if len(events) == 1:
        return events[0]
    last = events[-1]
    return TokenEvent(
        "".join(e.text for e in events),
        tuple(t for e in events for t in e.token_ids),
        finish_reason=last.finish_reason,
        stats=last.stats,
        error=last.error,
    )


def to_response(event: TokenEvent, request_id: str) -> pb.GenerateResponse:
    """Domain → wire: one streamed message (the last one with finish reason and stats)."""
    r = pb.GenerateResponse(text=event.text, token_ids=list(event.token_ids))
    if event.finish_reason is not None:
        r.finish_reason = FINISH[event.finish_reason]
        r.request_id = request_id
        if event.error:
            r.error = event.error
        s = event.stats
        if s is not None:
            r.stats.CopyFrom(
                pb.RequestStats(
                    prompt_tokens=s.prompt_tokens,
                    generated_tokens=s.generated_tokens,
                    ttft_ms=s.ttft_ms,
                    prefill_tok_s=s.prefill_tok_s,
                    decode_tok_s=s.decode_tok_s,
                    accelerator=s.accelerator,
                    queue_ms=s.queue_ms,
                    cached_tokens=s.cached_tokens,
                    truncated_tokens=s.truncated_tokens,
                )
            )
    return r


def session_message(info: SessionInfo) -> pb.SessionInfo:
    """Domain → wire; the owner stays inside the agent."""
    return pb.SessionInfo(
        id=info.id,
        tier=info.tier,
        tokens=info.tokens,
        kv_bytes=info.kv_bytes,
        policy=info.policy,
        created_unix=info.created,
        last_used_unix=info.last_used,
    )


def tiers_message(t: TierStats) -> pb.KVTiers:
    """Domain → wire: the fields have the same names on both sides."""
    return pb.KVTiers(**{f.name: getattr(t, f.name) for f in dataclasses.fields(t)})


def status_message(st: AgentStatus) -> pb.AgentStatus:
    """Domain → wire."""
    e = st.engine
    msg = pb.AgentStatus(
        profile=st.profile,
        version=st.version,
        uptime_s=st.uptime_s,
        rss_bytes=st.rss_bytes,
        budget_bytes=st.budget_bytes,
        planned_bytes=st.planned_bytes,
        queue_depth=e.queue_depth,
        queue_capacity=e.queue_capacity,
        active_requests=e.active,
        max_active=e.max_active,
        active_sessions=st.active_sessions,
        requests_total=e.requests_total,
        requests_failed=e.requests_failed,
        requests_rejected=e.requests_rejected,
        tokens_generated=e.tokens_generated,
        ttft_ms=pb.Percentiles(p50=e.ttft_ms.p50, p95=e.ttft_ms.p95),
        decode_tok_s=pb.Percentiles(p50=e.decode_tok_s.p50, p95=e.decode_tok_s.p95),
        state=st.state,
        model=st.model,
        nonfinite_logits=e.nonfinite_logits,
    )
    if st.kv is not None:
        msg.kv.CopyFrom(tiers_message(st.kv))
    return msg


class _EventPipe:
    """Engine thread → event loop, at most one message per `interval_s`.

    An event wakes the loop at once when the last message went out `interval_s` ago or more
    (so the first token, and every token of a slow model, go out without delay), when it ends
    the request, or when `flush_at` events are waiting (the engine pauses a request whose
    consumer leaves `limits.max_pending_events` unread: the interval must not throttle a fast
    model); events in between wait for the loop's timer and go out together. Each
    message costs the loop and a Python client ~1 ms of CPU each whatever it holds, on a
    board whose cores the model's threads also want (docs/PERFORMANCE.md). 0 sends what is
    there whenever the loop is free.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float, flush_at: int) -> None:
        self._loop = loop
        self._interval = interval_s
        self._flush_at = max(1, flush_at)
        self._items: deque[TokenEvent] = deque()
        self._ready = asyncio.Event()
        self._woken = False  # a wake-up is already on its way
        self._due = 0.0  # monotonic time from which the next message may go out

    def put(self, event: TokenEvent) -> None:  # engine thread
        self._items.append(event)
        if self._woken or not self._send_now(event):
            return  # the loop's timer collects it
        self._woken = True
        self._loop.call_soon_threadsafe(self._ready.set)

    def _send_now(self, last: TokenEvent) -> bool:
        return (
            time.monotonic() >= self._due
            or last.finish_reason is not None
            or len(self._items) >= self._flush_at
        )

    async def take(self) -> list[TokenEvent]:  # event loop: at least one, up to the end
        while True:
            if self._items and self._send_now(self._items[-1]):
                break
            wait = self._due - time.monotonic()
            # until the interval is over, then until an event arrives: what came meanwhile
            # goes out then, even if the engine pauses this request after it
            timer = self._loop.call_later(wait, self._ready.set) if wait > 0 else None
            try:
                await self._ready.wait()
            finally:
                if timer is not None:
                    timer.cancel()
            self._ready.clear()
            self._woken = False
        batch = [self._items.popleft()]
        while self._items and batch[-1].finish_reason is None:
            batch.append(self._items.popleft())
        self._due = time.monotonic() + self._interval
        return batch


class AgentService:
    """The edge_agent.v1.Agent methods.

    Unary methods take the request and the caller's owner and return the response; the
    adapter (`_unary`) works out the owner and maps errors to statuses.
    """

    def __init__(self, backend: Backend, max_tokens_limit: int) -> None:
        self._backend = backend
        self._max_tokens = max_tokens_limit

    def owner(self, context: grpc.aio.ServicerContext) -> str:
        """Whose sessions this call may touch: "" for everyone when sessions are shared, else
        the hash of the client key in the metadata ("" without one)."""
        if self._backend.config.sessions.share:
            return ""
        return owner_of(key_from_metadata(context.invocation_metadata()))

    async def Generate(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        config = self._backend.config
        interval = config.server.stream_interval_ms / 1000
        flush_at = config.limits.max_pending_events // 2
        pipe = _EventPipe(asyncio.get_running_loop(), interval, flush_at)
        try:
            _check(request)
            engine = self._backend.engine()
            domain = to_request(request, engine, self._max_tokens, self.owner(context))
            handle = engine.submit(domain, pipe.put, timeout=context.time_remaining())
        except AgentError as exc:
            log.info("generate refused: %s", exc)
            await _abort(context, exc)
            return
        try:
            while True:
                # Whatever the engine produced while the last message was being sent goes
                # out as one message: per-message cost does not then cap tokens/s.
                batch = await pipe.take()
                handle.consumed(len(batch))
                event = merge_events(batch)
                yield to_response(event, handle.id)
                if event.finish_reason is not None:
                    return
        finally:
            # client gone, deadline passed or server stopping: stop within one token
            if not handle.done.is_set():
                handle.cancel()

    def Tokenize(self, request: pb.TokenizeRequest, owner: str) -> pb.TokenizeResponse:
        engine = self._backend.engine()
        ids = engine.tokenizer.encode(request.text)
        if request.add_bos and engine.meta.bos_id is not None:
            ids = [engine.meta.bos_id, *ids]
        return pb.TokenizeResponse(token_ids=ids)

    def Detokenize(self, request: pb.DetokenizeRequest, owner: str) -> pb.DetokenizeResponse:
        text = self._backend.engine().tokenizer.decode(list(request.token_ids))
        return pb.DetokenizeResponse(text=text)

    def GetModelInfo(self, request: pb.GetModelInfoRequest, owner: str) -> pb.ModelInfo:
        engine = self._backend.engine()
        i = engine.info
        return pb.ModelInfo(
            name=i.name,
            version=i.version,
            sha256=i.sha256,
            quantization=i.quantization,
            vocab_size=i.vocab_size,
            context_length=i.context_length,
            signatures=list(i.signatures),
            accelerator=i.accelerator,
            execution_path=i.execution_path,
            kv_layout=i.kv_layout,
            fallbacks=list(i.fallbacks),
            kv=tiers_message(engine.tier_stats()),
            kv_bytes_per_session=i.memory.kv_per_session,
            kv_caches=i.memory.sessions,
            prepared=i.prepared,
        )

    def CreateSession(self, request: pb.CreateSessionRequest, owner: str) -> pb.Session:
        engine = self._backend.engine()
        return pb.Session(id=engine.create_session(owner, request.policy or "error"))

    def ForkSession(self, request: pb.ForkSessionRequest, owner: str) -> pb.Session:
        return pb.Session(id=self._backend.engine().fork_session(request.id, owner))

    def ListSessions(self, request: pb.ListSessionsRequest, owner: str) -> pb.ListSessionsResponse:
        sessions = self._backend.engine().list_sessions(owner)
        return pb.ListSessionsResponse(sessions=[session_message(s) for s in sessions])

    def DeleteSession(
        self, request: pb.DeleteSessionRequest, owner: str
    ) -> pb.DeleteSessionResponse:
        self._backend.engine().delete_session(request.id, owner)
        return pb.DeleteSessionResponse()

    def GetStatus(self, request: pb.GetStatusRequest, owner: str) -> pb.AgentStatus:
        return status_message(self._backend.status())


def _unary(
    service: AgentService, method: Callable[[Any, str], Any]
) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
    """One adapter for every unary method: unparsable requests and domain errors become the
    status from the error table; the method itself only maps request (and caller) to
    response."""
    name = method.__name__

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check(request)
            return method(request, service.owner(context))
        except AgentError as exc:
            log.info("%s refused: %s", name, exc)
            await _abort(context, exc)
            raise  # unreachable: abort raises

    return handle


def _handlers(service: AgentService) -> grpc.GenericRpcHandler:
    """The Agent service's handlers, with request parsing that maps bad bytes to
    INVALID_ARGUMENT instead of a generic deserialization failure."""
    unary: dict[str, tuple[Callable[[Any, str], Any], Any, Any]] = {
        "Tokenize": (service.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
        "Detokenize": (service.Detokenize, pb.DetokenizeRequest, pb.DetokenizeResponse),
        "GetModelInfo": (service.GetModelInfo, pb.GetModelInfoRequest, pb.ModelInfo),
        "GetStatus": (service.GetStatus, pb.GetStatusRequest, pb.AgentStatus),
        "CreateSession": (service.CreateSession, pb.CreateSessionRequest, pb.Session),
        "ForkSession": (service.ForkSession, pb.ForkSessionRequest, pb.Session),
        "ListSessions": (service.ListSessions, pb.ListSessionsRequest, pb.ListSessionsResponse),
        "DeleteSession": (
            service.DeleteSession,
            pb.DeleteSessionRequest,
            pb.DeleteSessionResponse,
        ),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _unary(service, method), _lenient(request), response.SerializeToString
        )
        for name, (method, request, response) in unary.items()
    }
    handlers["Generate"] = grpc.unary_stream_rpc_method_handler(
        service.Generate, _lenient(pb.GenerateRequest), pb.GenerateResponse.SerializeToString
    )
    missing = set(pb.DESCRIPTOR.services_by_name["Agent"].methods_by_name) - set(handlers)
    if missing:
        raise RuntimeError(f"Agent methods without a handler: {sorted(missing)}")
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


class Server:
    """The gRPC server: bind, serve, flip health, stop."""

    def __init__(self, backend: Backend, config: ServerConfig, max_tokens_limit: int) -> None:
        self._config = config
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self._server = grpc.aio.server(options=opts)
        self._server.add_generic_rpc_handlers((_handlers(AgentService(backend, max_tokens_limit)),))
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable(
            self._server, (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        )
        self.addresses: list[str] = []
        self._bound: unixsocket.BoundSocket | None = None

    async def start(self) -> None:
        """Bind the unix socket (and TCP if configured), then start serving (NOT_SERVING).

        Refuses (HostError, AlreadyRunning) a socket path that is not a socket, a live socket
        or a missing parent directory, having changed nothing; see `agent.rpc.unixsocket`."""
        await self.set_serving(False)
        sock = self._config.socket
        group = self._config.socket_group
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise HostError(
                f"server.socket_group = {group!r}: no such group on this machine"
            ) from None
        with unixsocket.bind_guard(sock):
            old = os.umask(0o777 ^ self._config.socket_mode)
            try:
                self._server.add_insecure_port(f"unix:{sock}")
            except RuntimeError as exc:  # gRPC says only "Failed to bind"
                raise HostError(f"cannot bind the unix socket {sock}") from exc
            finally:
                os.umask(old)
            self._bound = unixsocket.bound(sock)
        self.addresses.append(f"unix:{sock}")
        if self._config.tcp:
            host = self._config.tcp.rpartition(":")[0]
            try:
                port = self._server.add_insecure_port(self._config.tcp)
            except RuntimeError as exc:
                raise HostError(
                    f"cannot listen on {self._config.tcp}: the port is in use or the address is "
                    "not one of this machine's"
                ) from exc
            self.addresses.append(f"{host}:{port}")
        await self._server.start()
        os.chmod(sock, self._config.socket_mode)
        if gid != -1:
            os.chown(sock, -1, gid)
        log.info("listening on %s", ", ".join(self.addresses))

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Stop serving; remove the socket only if it is still the one `start` bound."""
        await self.set_serving(False)
        await self._server.stop(grace)
        if self._bound is not None:
            unixsocket.remove_if_ours(self._bound)
            self._bound = None
