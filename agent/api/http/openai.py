"""The OpenAI-compatible endpoints, as a Starlette app on the daemon's engine.

`POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent events, or
whole), `GET /v1/models`, `GET /health`, and `GET /metrics` when the daemon counts. Requests
go to the same engine, queue and limits as gRPC's (`Backend`); OpenAI JSON becomes the
engine's request in `agent.api.http.convert`, and domain errors become statuses in
`agent.api.http.errors`. The engine runs on its own thread: its events reach the handler through
`loop.call_soon_threadsafe` (`agent.api.bridge`), and each is acknowledged, so the engine pauses a
request whose client reads slowly (`limits.max_pending_events`): nothing queues without bound.

A client that goes away cancels its request: a stream's generator is cancelled when the
connection drops (Starlette listens for the disconnect beside it), a whole response's wait
sees the disconnect (`_wait_or_gone`); either way `handle.cancel()` stops it within a token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent.api.bridge import EventPipe, merge_events
from agent.api.http import body as json_body
from agent.api.http import convert, faults, replies
from agent.api.http.errors import HttpError, describe, error_body, failure_kind
from agent.api.identity import owner_of
from agent.base.errors import AgentError, ConstraintFailed, Overloaded, Unavailable
from agent.config.file import AgentConfig
from agent.engine.engine import Engine
from agent.engine.request import RequestHandle
from agent.engine.types import TokenEvent
from agent.status.value import ModelState

log = logging.getLogger("agent.api.http")

CLIENT_HEADER: Final = "edge-agent-client"  # the same client key as gRPC's metadata entry


class Counter(Protocol):
    """What the endpoints report to (`agent.status.metrics.Metrics`)."""

    def observe(self, api: str, event: TokenEvent) -> None: ...

    def refused(self, api: str, outcome: str = "refused") -> None: ...

    def render(self) -> tuple[bytes, str]: ...

    @property
    def registry(self) -> CollectorRegistry:
        """Where the listener's own figures are registered (`agent.api.http.connections`)."""
        ...


class Backend(Protocol):
    """What the endpoints need from the daemon (the same as gRPC's)."""

    def engine(self) -> Engine:
        """The engine serving new requests (raises Unavailable when there is none)."""
        ...

    @property
    def config(self) -> AgentConfig:
        """The configuration in force (a reload may replace it)."""
        ...

    async def engine_for(self, model: str = "", keep_alive_s: float | None = None) -> Engine:
        """The named model's engine, loaded if it is not (as gRPC's `Backend`)."""
        ...

    def current(self, model: str = "") -> Engine | None: ...

    def model_states(self) -> tuple[ModelState, ...]:
        """Every named model, the default first."""
        ...


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = describe(exc)
    return JSONResponse(body, status_code=status, headers=headers)


class Api:
    """The endpoints; `key` set: every request needs ``Authorization: Bearer <key>``."""

    def __init__(
        self,
        backend: Backend,
        max_tokens_limit: int,
        key: str | None = None,
        metrics: Counter | None = None,
    ) -> None:
        self._backend = backend
        self._max_tokens = max_tokens_limit
        self._key = key.encode() if key else None
        self._metrics = metrics
        self._created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/health", self._guard(self.health), methods=["GET"]),
            Route("/metrics", self._guard(self.metrics), methods=["GET"]),
        ]

        async def http_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return JSONResponse(
                error_body(
                    f"{request.method} {request.url.path}: {exc.detail}",
                    "invalid_request_error",
                    None,
                    code,
                ),
                status_code=exc.status_code,
                headers=exc.headers,  # 405: Allow
            )

        return Starlette(routes=routes, exception_handlers={HTTPException: http_error})

    # ------------------------------------------------------------------ plumbing

    def _guard(
        self, endpoint: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """The bearer key first; domain errors become OpenAI error JSON with their status."""
        name = endpoint.__name__

        async def handle(request: Request) -> Response:
            try:
                self._authorize(request)
                return await endpoint(request)
            except AgentError as exc:
                log.info("http %s refused: %s", name, exc)
                if self._metrics is not None and name in ("chat", "completions"):
                    outcome = "overloaded" if isinstance(exc, Overloaded) else "refused"
                    self._metrics.refused("http", outcome)
                return _error_response(exc)
            except ClientDisconnect:  # gone while sending its body: nobody to answer
                log.info("http %s: client disconnected while sending its request", name)
                return Response(status_code=499)
            except Exception as exc:
                log.exception("http %s failed", name)
                return _error_response(exc)

        return handle

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._key):
            raise HttpError(
                "a valid API key is needed: Authorization: Bearer <key>",
                status=401,
                code="invalid_api_key",
            )

    async def _body(self, request: Request) -> dict[str, Any]:
        json_body.check_content_type(request.headers.get("content-type"))
        limit = self._backend.config.server.max_message_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise HttpError(f"request body is {size} bytes; at most {limit}", status=413)
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                raise HttpError(f"request body is over {limit} bytes", status=413)
        return await asyncio.to_thread(json_body.parse, bytes(data))

    def _owner(self, request: Request) -> str:
        if self._backend.config.sessions.share:
            return ""
        return owner_of(request.headers.get(CLIENT_HEADER, ""))

    async def _submit(
        self, engine: Engine, parsed: convert.Parsed
    ) -> tuple[RequestHandle, EventPipe[TokenEvent]]:
        """Queue the request: `engine.submit` renders and tokenizes the prompt (a 1 MiB
        message takes ~0.5 s) and compiles its constraint, so it runs on a worker thread
        while the event loop serves everyone else (`submit_off_loop`)."""
        events: EventPipe[TokenEvent] = EventPipe(
            asyncio.get_running_loop(), first_alone=True
        )  # the first token goes out alone, however late the loop wakes
        sink = events.put
        metrics = self._metrics
        if metrics is not None:

            def sink(event: TokenEvent) -> None:  # engine thread: counted even if nobody reads
                if event.finish_reason is not None:
                    metrics.observe("http", event)
                events.put(event)

        handle = await submit_off_loop(lambda: engine.submit(parsed.request, sink))
        return handle, events

    # ------------------------------------------------------------------ endpoints

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        return await self._generate(request, body, convert.chat_request, chat=True)

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        return await self._generate(request, body, convert.completion_request, chat=False)

    async def _on_current(
        self, request: Request, body: Any, parse: Callable[..., convert.Parsed]
    ) -> tuple[Engine, convert.Parsed, RequestHandle, EventPipe[TokenEvent]]:
        """Parse and submit on the engine serving now; once more if a reload or an update
        switched models between the look and the submit (the old engine refuses)."""
        name, keep_alive = convert.model_of(body)
        for again in (False, True):
            engine = await self._backend.engine_for(name, keep_alive)
            parsed = parse(body, engine, self._max_tokens, self._owner(request))
            try:
                return (engine, parsed, *await self._submit(engine, parsed))
            except Unavailable:  # (or its model was unloaded meanwhile)
                if again or self._backend.current(name) is engine:
                    raise
        raise AssertionError("unreachable")

    async def _generate(
        self, request: Request, body: Any, parse: Callable[..., convert.Parsed], *, chat: bool
    ) -> Response:
        engine, parsed, handle, events = await self._on_current(request, body, parse)
        names = [m.name for m in self._backend.model_states()]
        named = bool(self._backend.config.models.entries)
        model = convert.answer_model(body, names, engine.info.name if not named else None)
        created = int(time.time())
        if parsed.stream:
            stream = self._stream(
                handle, events, model, created, chat, parsed.include_usage, parsed.tool_parse
            )
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            pieces: list[str] = []
            while True:
                taken = await _wait_or_gone(request, events)
                if taken is None:  # the client went away
                    log.info("http %s: client disconnected; cancelled", handle.id)
                    return Response(status_code=499)
                event, count = taken
                handle.consumed(count)
                pieces.append(event.text)
                if event.finish_reason is not None:
                    break
        finally:
            if not handle.done.is_set():
                handle.cancel()
        if handle.refused is not None:  # the agent stopped before it started: 503
            raise handle.refused
        failed = event.finish_reason == "error"
        if failed and (event.error or "").startswith(ConstraintFailed.PREFIX):  # its grammar's
            raise HttpError(f"generation failed: {event.error}")
        if event.finish_reason == "error":  # the engine failed it (non-finite logits, LiteRT)
            raise HttpError(
                f"generation failed: {event.error or 'no reason given'}",
                status=500,
                kind="server_error",
            )
        end = _finish_reason(event)
        if end not in replies.FINISH:
            raise Unavailable(f"generation {event.finish_reason}: {event.error or 'no reason'}")
        text = "".join(pieces)
        if chat:
            out = replies.chat_response(handle.id, created, model, text, end, event.stats)
            if parsed.tool_parse:  # the calls it holds (agent.chat.toolcalls)
                message, reason = replies.assistant_message(text, parsed.tool_parse, end)
                out["choices"][0].update(message=message, finish_reason=reason)
        else:
            out = replies.completion_response(handle.id, created, model, text, end, event.stats)
        return JSONResponse({**out, **_cut_note(event)})

    async def _stream(
        self,
        handle: RequestHandle,
        events: EventPipe[TokenEvent],
        model: str,
        created: int,
        chat: bool,
        include_usage: bool,
        tool_parse: str = "",
    ) -> AsyncIterator[bytes]:
        rid = handle.id
        held: list[str] = []  # a chat with tools: its answer, parsed whole for its calls
        try:
            if chat:
                yield _sse(
                    replies.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})
                )
            while True:
                event, count = await _take(events)
                handle.consumed(count)
                if handle.refused is not None:  # the agent stopped before it started
                    yield _sse(error_body(str(handle.refused), "server_error", None, "unavailable"))
                    return
                end = _finish_reason(event)
                note = _cut_note(event)
                if end is not None and end not in replies.FINISH:
                    why = event.error or "no reason given"
                    yield _sse(error_body(f"generation {end}: {why}", failure_kind(why)))
                    return
                if chat and tool_parse:
                    held.append(event.text)
                    if end is not None:
                        text = "".join(held)
                        message, reason = replies.assistant_message(text, tool_parse, end)
                        delta = replies.tool_delta(message)
                        yield _sse(replies.chat_chunk(rid, created, model, delta))
                        yield _sse({**replies.chat_chunk(rid, created, model, {}, reason), **note})
                elif chat:
                    delta = {"content": event.text} if event.text else {}
                    if delta or end is not None:
                        chunk = replies.chat_chunk(rid, created, model, delta, end)
                        yield _sse({**chunk, **note})
                elif event.text or end is not None:
                    chunk = replies.completion_response(rid, created, model, event.text, end, None)
                    yield _sse({**chunk, **note})
                if end is not None:
                    if include_usage:
                        if chat:
                            usage = replies.chat_chunk(rid, created, model, None, None, event.stats)
                        else:
                            usage = replies.completion_response(
                                rid, created, model, "", None, event.stats
                            )
                            usage["choices"] = []
                        yield _sse(usage)
                    yield _sse("[DONE]")
                    return
        finally:
            # client gone (Starlette cancels this generator) or server stopping
            if not handle.done.is_set():
                handle.cancel()
                log.info("http %s: stream closed early; cancelled", rid)

    async def models(self, request: Request) -> Response:
        states = self._backend.model_states()
        if not states:
            self._backend.engine()  # Unavailable: 503, as before
        return JSONResponse(replies.model_list(states, self._created))

    async def health(self, request: Request) -> Response:
        states = self._backend.model_states()
        try:
            name = states[0].name if states and not states[0].loaded else None
            name = name or self._backend.engine().info.name
        except Unavailable as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok", "model": name})

    async def metrics(self, request: Request) -> Response:
        if self._metrics is None:
            raise HttpError("metrics are not collected by this daemon", status=404)
        data, content_type = self._metrics.render()
        return Response(data, media_type=content_type)


async def submit_off_loop(submit: Callable[[], RequestHandle]) -> RequestHandle:
    """`submit()` on a worker thread. If the caller is cancelled meanwhile (its client went
    away), the request it queued is cancelled as soon as the thread returns it."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, _gated, submit)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:

        def cancel_queued(f: asyncio.Future[RequestHandle]) -> None:
            if not f.cancelled() and f.exception() is None:
                f.result().cancel()

        future.add_done_callback(cancel_queued)
        raise


def _gated(submit: Callable[[], RequestHandle]) -> RequestHandle:
    faults.submit_gate()
    return submit()


def _finish_reason(event: TokenEvent) -> str | None:
    """OpenAI's finish reason for an event: a request the stopping agent cut ("cancelled")
    ends with "length", the value every OpenAI SDK parses and reads as "the answer was cut
    short"; `_cut_note` says why (docs/API.md "Stopping")."""
    return "length" if event.finish_reason == "cancelled" else event.finish_reason


def _cut_note(event: TokenEvent) -> dict[str, Any]:
    """The extension field on the last chunk / the answer of a request the agent cut."""
    if event.finish_reason != "cancelled":
        return {}
    return {"edge_agent": {"finish_reason": "cancelled", "message": event.error or "cancelled"}}


async def _take(events: EventPipe[TokenEvent]) -> tuple[TokenEvent, int]:
    """What has arrived, as one event, and how many events it was (at least one; the
    request's end closes it)."""
    batch = await events.take()
    return merge_events(batch), len(batch)


async def _wait_or_gone(
    request: Request, events: EventPipe[TokenEvent]
) -> tuple[TokenEvent, int] | None:
    """The next event, or None once the client has disconnected (its body is read, so the
    next ASGI message is the disconnect)."""
    take = asyncio.ensure_future(_take(events))
    gone = asyncio.ensure_future(request.receive())
    try:
        done, _ = await asyncio.wait({take, gone}, return_when=asyncio.FIRST_COMPLETED)
        if take in done:
            return take.result()
        if gone.result().get("type") == "http.disconnect":
            return None
        return await take
    finally:
        for t in (take, gone):
            if not t.done():
                t.cancel()
