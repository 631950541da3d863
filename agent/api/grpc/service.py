"""The edge_agent.v1.Agent servicer: its methods, and the handlers that parse requests
leniently and turn domain errors into gRPC status codes (`agent.base.errors.GRPC_STATUS`).

Wire messages become domain values in `agent.api.grpc.convert` and never travel inward; a
streamed Generate takes its events through `agent.api.bridge`.

Every call that touches a session runs as its caller's owner (`agent.api.identity`): the hash
of the client key in the call's metadata, or "" for everyone when `[sessions] share = true`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from agent.api.bridge import EventPipe, merge_events
from agent.api.grpc.convert import (
    ToolReader,
    model_info_message,
    session_message,
    status_message,
    to_request,
    to_response,
)
from agent.api.identity import key_from_metadata, owner_of
from agent.base.errors import (
    ERROR_TRAILER,
    AgentError,
    InvalidRequest,
    Overloaded,
    Unavailable,
    grpc_status_name,
)
from agent.config.file import AgentConfig
from agent.config.models import KEEP_ALIVE_RULE, parse_keep_alive
from agent.engine.engine import Engine
from agent.engine.stopping import STOPPING_CUT
from agent.engine.types import TokenEvent
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.status.metrics import Metrics
from agent.status.value import AgentStatus

log = logging.getLogger("agent.api.grpc.server")  # the server's lines keep their logger name

SERVICE = pb.DESCRIPTOR.services_by_name["Agent"].full_name


class Backend(Protocol):
    """What the server needs from the daemon."""

    def engine(self) -> Engine:
        """The engine serving new requests (raises Unavailable when there is none)."""
        ...

    def status(self) -> AgentStatus:
        """The agent's status now (raises Unavailable before a model is loaded)."""
        ...

    async def engine_for(self, model: str = "", keep_alive_s: float | None = None) -> Engine:
        """The named model's engine ("" the default), loaded if it is not (NotFound for a name
        not served, BudgetError when it cannot fit)."""
        ...

    def current(self, model: str = "") -> Engine | None:
        """The named model's engine now, without loading it."""
        ...

    @property
    def config(self) -> AgentConfig:
        """The configuration in force (a reload may replace it)."""
        ...

    @property
    def metrics(self) -> Metrics | None:
        """Where every Generate's outcome and stats are counted (None: not counted)."""
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


def keep_alive_of(text: str) -> float | None:
    """A request's keep_alive ("": the configured one), as `[models]`' keep_alive reads it."""
    if not text:
        return None
    seconds = parse_keep_alive(text)
    if seconds is None:
        raise InvalidRequest(f"keep_alive = {text!r} is not valid; allowed: {KEEP_ALIVE_RULE}")
    return seconds


def _counted(sink: Callable[[TokenEvent], None], metrics: Metrics) -> Callable[[TokenEvent], None]:
    """`sink`, counting the request's last event first: on the engine thread, so a request
    whose client went away (nobody reads its pipe) is counted too, and before the client
    can see the end."""

    def put(event: TokenEvent) -> None:
        if event.finish_reason is not None:
            metrics.observe("grpc", event)
        sink(event)

    return put


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
        pipe: EventPipe[TokenEvent] = EventPipe(
            asyncio.get_running_loop(), interval, flush_at, first_alone=True
        )
        metrics = self._backend.metrics
        sink = pipe.put if metrics is None else _counted(pipe.put, metrics)
        try:
            _check(request)
            keep_alive = keep_alive_of(request.keep_alive)
            for again in (False, True):
                engine = await self._backend.engine_for(request.model, keep_alive)
                domain = to_request(request, engine, self._max_tokens, self.owner(context))
                tools = ToolReader.of(domain, engine)  # a chat with tools: its calls at the end
                timeout = context.time_remaining()
                try:
                    # submit compiles a constraint and tokenizes: a worker thread's work
                    handle = await _submit_off_loop(
                        lambda: engine.submit(domain, sink, timeout=timeout)  # noqa: B023
                    )
                    break
                except Unavailable:
                    # a reload or an update switched models between the look and the submit:
                    # (or its model was unloaded): the old engine refuses, so once more on
                    # the one that serves now
                    if again or self._backend.current(request.model) is engine:
                        raise
        except AgentError as exc:
            log.info("generate refused: %s", exc)
            if metrics is not None:
                metrics.refused("grpc", "overloaded" if isinstance(exc, Overloaded) else "refused")
            await _abort(context, exc)
            return
        try:
            while True:
                # Whatever the engine produced while the last message was being sent goes
                # out as one message: per-message cost does not then cap tokens/s.
                batch = await pipe.take()
                handle.consumed(len(batch))
                event = merge_events(batch)
                if handle.refused is not None:  # the agent stopped before it started
                    log.info("generate %s refused: %s", handle.id, handle.refused)
                    await _abort(context, handle.refused)
                yield to_response(event, handle.id, tools)
                if event.finish_reason == "cancelled" and event.error == STOPPING_CUT:
                    # the agent is stopping: the message above held the tokens so far and
                    # FINISH_REASON_CANCELLED; the status says the answer is not complete
                    await context.abort(grpc.StatusCode.CANCELLED, event.error)
                if event.finish_reason is not None:
                    return
        finally:
            # client gone, deadline passed or server stopping: stop within one token
            if not handle.done.is_set():
                handle.cancel()

    async def Tokenize(self, request: pb.TokenizeRequest, owner: str) -> pb.TokenizeResponse:
        engine = await self._backend.engine_for(request.model)
        ids = engine.tokenizer.encode(request.text)
        if request.add_bos and engine.meta.bos_id is not None:
            ids = [engine.meta.bos_id, *ids]
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest, owner: str) -> pb.DetokenizeResponse:
        text = (await self._backend.engine_for(request.model)).tokenizer.decode(
            list(request.token_ids)
        )
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, owner: str) -> pb.ModelInfo:
        engine = await self._backend.engine_for(request.model)
        return model_info_message(engine.info, engine.tier_stats())

    async def CreateSession(self, request: pb.CreateSessionRequest, owner: str) -> pb.Session:
        engine = await self._backend.engine_for(request.model)
        return pb.Session(id=engine.create_session(owner, request.policy or "error"))

    async def ForkSession(self, request: pb.ForkSessionRequest, owner: str) -> pb.Session:
        engine = await self._backend.engine_for(request.model)
        return pb.Session(id=engine.fork_session(request.id, owner))

    async def ListSessions(
        self, request: pb.ListSessionsRequest, owner: str
    ) -> pb.ListSessionsResponse:
        sessions = (await self._backend.engine_for(request.model)).list_sessions(owner)
        return pb.ListSessionsResponse(sessions=[session_message(s) for s in sessions])

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, owner: str
    ) -> pb.DeleteSessionResponse:
        (await self._backend.engine_for(request.model)).delete_session(request.id, owner)
        return pb.DeleteSessionResponse()

    def GetStatus(self, request: pb.GetStatusRequest, owner: str) -> pb.AgentStatus:
        return status_message(self._backend.status())


async def _submit_off_loop(submit: Callable[[], Any]) -> Any:
    """`submit()` (it returns a request's handle) on a worker thread; if the call is cancelled
    meanwhile, the request it queued is cancelled as soon as the thread returns it."""
    future = asyncio.get_running_loop().run_in_executor(None, submit)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:

        def cancel_queued(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                f.result().cancel()

        future.add_done_callback(cancel_queued)
        raise


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
            result = method(request, service.owner(context))
            return await result if inspect.isawaitable(result) else result
        except AgentError as exc:
            log.info("%s refused: %s", name, exc)
            await _abort(context, exc)
            raise  # unreachable: abort raises

    return handle


def handlers(service: AgentService) -> grpc.GenericRpcHandler:
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
    by_name = {
        name: grpc.unary_unary_rpc_method_handler(
            _unary(service, method), _lenient(request), response.SerializeToString
        )
        for name, (method, request, response) in unary.items()
    }
    by_name["Generate"] = grpc.unary_stream_rpc_method_handler(
        service.Generate, _lenient(pb.GenerateRequest), pb.GenerateResponse.SerializeToString
    )
    missing = set(pb.DESCRIPTOR.services_by_name["Agent"].methods_by_name) - set(by_name)
    if missing:
        raise RuntimeError(f"Agent methods without a handler: {sorted(missing)}")
    return grpc.method_handlers_generic_handler(SERVICE, by_name)
