"""Ollama's API beside the OpenAI one, on the same listeners (docs/API.md "Ollama API").

`POST /api/chat` and `/api/generate` (NDJSON streamed, Ollama's default, or whole),
`GET /api/tags`, `/api/ps`, `/api/version`, `POST /api/show`; `/api/pull`, `/api/push` and
`/api/embed` answer 501 saying what to use instead. Requests are checked by the OpenAI path's
rules (`agent.api.http.ollama_shapes` turns Ollama's JSON into that body, `convert` checks it)
and go through the same engine, queue, limits, bearer key and metrics (`api="ollama"`).
Errors are Ollama's shape, ``{"error": "..."}``, with the status the OpenAI path would give.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from importlib import metadata
from typing import Any, Final

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent.api.bridge import EventPipe
from agent.api.http import convert, replies
from agent.api.http import ollama_shapes as shapes
from agent.api.http.errors import HttpError, describe
from agent.api.http.openai import Api, _finish_reason, _take, _wait_or_gone, submit_off_loop
from agent.base.errors import AgentError, ConstraintFailed, NotFound, Overloaded, Unavailable
from agent.engine.engine import Engine
from agent.engine.request import RequestHandle
from agent.engine.types import TokenEvent

log = logging.getLogger("agent.api.http.ollama")

LABEL: Final = "ollama"  # the metrics' api label
NDJSON: Final = "application/x-ndjson"
NOT_HERE: Final = {
    "pull": "models are not pulled over this API: install one with `edge-agent model import` "
    "on the device, or roll it out as a fleet update",
    "push": "models are not pushed over this API: models reach devices as fleet updates",
    "embed": "embeddings are not served: this daemon has no embedding model path yet",
    "manage": "models are not created, copied or deleted over this API: use `edge-agent model "
    "import` on the device, or fleet updates",
}


def _error(exc: BaseException) -> JSONResponse:
    status, body, headers = describe(exc)
    return JSONResponse({"error": body["error"]["message"]}, status_code=status, headers=headers)


class Ollama:
    """The endpoints, on the OpenAI `Api`'s backend, key, limits and metrics."""

    def __init__(self, api: Api) -> None:
        self._api = api

    def routes(self) -> list[Route]:
        get, post = ["GET"], ["POST"]
        routes = [
            Route("/api/version", self._guard(self.version), methods=get),
            Route("/api/tags", self._guard(self.tags), methods=get),
            Route("/api/ps", self._guard(self.ps), methods=get),
            Route("/api/show", self._guard(self.show), methods=post),
            Route("/api/chat", self._guard(self.chat), methods=post),
            Route("/api/generate", self._guard(self.generate), methods=post),
        ]
        for path, what in (
            ("/api/pull", "pull"),
            ("/api/push", "push"),
            ("/api/embed", "embed"),
            ("/api/embeddings", "embed"),
        ):
            routes.append(Route(path, self._guard(_refuse(what)), methods=post))
        for path in ("/api/create", "/api/copy", "/api/delete"):
            methods = ["DELETE"] if path == "/api/delete" else post
            routes.append(Route(path, self._guard(_refuse("manage")), methods=methods))
        known = {r.path: sorted(r.methods or ()) for r in routes}

        async def unknown(request: Request) -> Response:  # after the rest: Ollama's shape
            path, method = request.url.path, request.method
            if path in known:
                allow = ", ".join(m for m in known[path] if m != "HEAD")
                error = {"error": f"{method} {path}: method not allowed; allowed: {allow}"}
                return JSONResponse(error, status_code=405, headers={"Allow": allow})
            raise HttpError(f"{method} {path}: no such endpoint", status=404)

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        return [*routes, Route("/api/{rest:path}", self._guard(unknown), methods=methods)]

    def _guard(
        self, endpoint: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        name = endpoint.__name__
        metrics = self._api._metrics

        async def handle(request: Request) -> Response:
            try:
                self._api._authorize(request)
                return await endpoint(request)
            except AgentError as exc:
                log.info("ollama %s refused: %s", name, exc)
                if metrics is not None and name in ("chat", "generate"):
                    metrics.refused(
                        LABEL, "overloaded" if isinstance(exc, Overloaded) else "refused"
                    )
                return _error(exc)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as exc:
                log.exception("ollama %s failed", name)
                return _error(exc)

        return handle

    def _named(self) -> bool:
        """Whether the daemon serves named models (`[models]`, docs/CONFIG.md)."""
        return bool(self._api._backend.config.models.entries)

    async def _engine(self, name: str | None = None, keep_alive_s: float | None = None) -> Engine:
        """Model `name`'s engine (a ":latest" tag allowed; None: the default), loaded when it
        is not (named models); with one model, `name` must be it."""
        backend = self._api._backend
        if name is not None and self._named():
            return await backend.engine_for(name.removesuffix(":latest"), keep_alive_s)
        engine = backend.engine()
        served = engine.info.name
        if name is not None and name not in (served, f"{served}:latest"):
            raise NotFound(f"model {name!r} not found; this server serves {served!r}")
        return engine

    def _loaded_engines(self) -> list[tuple[str, Engine | None, Any]]:
        """(name, engine or None when unloaded, its state) of every model, the default first."""
        backend = self._api._backend
        if not self._named():
            engine = backend.engine()
            return [(engine.info.name, engine, None)]
        return [(st.name, backend.current(st.name), st) for st in backend.model_states()]

    # ------------------------------------------------------------------ model listing

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": metadata.version("edge-agent")})

    def _entry(self, engine: Engine) -> dict[str, Any]:
        info = engine.info
        try:
            mtime = info.path.stat().st_mtime
        except OSError:
            mtime = 0.0
        return {
            "name": info.name,
            "model": info.name,
            "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat(),
            "size": info.memory.weights,
            "digest": info.digest or info.sha256,
            "details": {
                "parent_model": "",
                "format": "tflite",
                "family": info.name,
                "families": [info.name],
                "parameter_size": "",
                "quantization_level": info.quantization,
            },
        }

    def _listed(self, name: str, engine: Engine | None, state: Any) -> dict[str, Any]:
        """A model's /api/tags entry under its name; an unloaded one from its state."""
        if engine is not None:
            return {**self._entry(engine), "name": name, "model": name}
        return {
            "name": name,
            "model": name,
            "modified_at": datetime.fromtimestamp(0, UTC).isoformat(),
            "size": state.estimate_bytes,
            "digest": "",
            "details": {
                "parent_model": "",
                "format": "tflite",
                "family": name,
                "families": [name],
                "parameter_size": "",
                "quantization_level": state.quantization,
            },
        }

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [self._listed(*m) for m in self._loaded_engines()]})

    async def ps(self, request: Request) -> Response:
        loaded = []
        for name, engine, _state in self._loaded_engines():
            if engine is None:
                continue
            entry = self._listed(name, engine, None)
            del entry["modified_at"]
            entry.update(
                expires_at="9999-12-31T23:59:59Z",  # until its keep_alive (not computed here)
                size_vram=0,
                context_length=engine.info.context_length,
            )
            loaded.append(entry)
        return JSONResponse({"models": loaded})

    async def show(self, request: Request) -> Response:
        body = await self._api._body(request)
        name = body.get("model", body.get("name"))
        if not isinstance(name, str) or not name:
            raise HttpError("model is required (a string)")
        engine = await self._engine(name)
        gen = engine.profile.generation
        params = {
            "temperature": gen.temperature,
            "top_k": gen.top_k,
            "top_p": gen.top_p,
            "num_predict": gen.max_tokens,
            "num_ctx": engine.info.context_length,
        }
        entry = self._entry(engine)
        capabilities = ["completion"] + (["tools"] if engine.chat.tool_format else [])
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "\n".join(f"{k:<20}{v}" for k, v in params.items()),
                "template": engine.chat.source,
                "details": entry["details"],
                "model_info": {
                    "general.architecture": entry["details"]["family"],
                    "general.context_length": engine.info.context_length,
                    "general.vocab_size": engine.info.vocab_size,
                },
                "capabilities": capabilities,
                "modified_at": entry["modified_at"],
            }
        )

    # ------------------------------------------------------------------ generation

    async def chat(self, request: Request) -> Response:
        body = await self._api._body(request)
        converted = shapes.chat_body(body)
        if not converted["messages"]:  # Ollama's "load the model" request
            return await self._loaded(body, chat=True)
        return await self._generate(request, converted, convert.chat_request, chat=True)

    async def generate(self, request: Request) -> Response:
        body = await self._api._body(request)
        converted, chat = shapes.generate_body(body)
        if not body.get("prompt"):
            return await self._loaded(body, chat=False)
        parse = convert.chat_request if chat else convert.completion_request
        return await self._generate(request, converted, parse, chat=False)

    async def _loaded(self, body: dict[str, Any], *, chat: bool) -> Response:
        asked = shapes.model_name(body)
        engine = await self._engine(asked)  # an unknown name: 404; a named model: loaded now
        name = asked if self._named() else engine.info.name
        reason = "unload" if shapes.keep_alive(body) else "load"
        out: dict[str, Any] = {"model": name, "created_at": shapes.now()}
        out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return JSONResponse({**out, "done": True, "done_reason": reason})

    async def _submit(
        self, request: Request, body: dict[str, Any], parse: Callable[..., convert.Parsed]
    ) -> tuple[Engine, convert.Parsed, RequestHandle, EventPipe[TokenEvent]]:
        """Check and queue on the engine serving now (once more if a reload switched it)."""
        api = self._api
        keep_alive = convert.model_of({"keep_alive": body.get("keep_alive")})[1]
        for again in (False, True):
            engine = await self._engine(body["model"], keep_alive)
            try:
                parsed = parse(body, engine, api._max_tokens, api._owner(request))
            except HttpError as exc:  # named as the OpenAI field: say Ollama's
                if exc.param not in shapes.RENAMED:
                    raise
                raise HttpError(str(exc).replace(exc.param, shapes.RENAMED[exc.param])) from None
            try:
                handle, events = await self._queue(engine, parsed)
                return engine, parsed, handle, events
            except Unavailable:
                current = api._backend.current(body["model"]) if self._named() else None
                if again or (current or api._backend.engine()) is engine:
                    raise
        raise AssertionError("unreachable")

    async def _queue(
        self, engine: Engine, parsed: convert.Parsed
    ) -> tuple[RequestHandle, EventPipe[TokenEvent]]:
        events: EventPipe[TokenEvent] = EventPipe(asyncio.get_running_loop(), first_alone=True)
        sink = events.put
        metrics = self._api._metrics
        if metrics is not None:

            def sink(event: TokenEvent) -> None:  # engine thread: counted even if nobody reads
                if event.finish_reason is not None:
                    metrics.observe(LABEL, event)
                events.put(event)

        handle = await submit_off_loop(lambda: engine.submit(parsed.request, sink))
        return handle, events

    async def _generate(
        self,
        request: Request,
        body: dict[str, Any],
        parse: Callable[..., convert.Parsed],
        *,
        chat: bool,
    ) -> Response:
        engine, parsed, handle, events = await self._submit(request, body, parse)
        stream = _chunks(handle, events, engine.info.name, chat, parsed.tool_parse)
        if parsed.stream:
            return StreamingResponse(stream, media_type=NDJSON)
        try:
            out: dict[str, Any] = {}
            text: list[str] = []
            while True:
                taken = await _wait_or_gone(request, events)
                if taken is None:
                    log.info("ollama %s: client disconnected; cancelled", handle.id)
                    return Response(status_code=499)
                event, count = taken
                handle.consumed(count)
                if handle.refused is not None:
                    raise handle.refused
                chunk = _chunk(event, engine.info.name, chat, parsed.tool_parse, text)
                if chunk["done"]:
                    out = chunk
                    break
        finally:
            if not handle.done.is_set():
                handle.cancel()
        if chat and not parsed.tool_parse:  # with tools, the last chunk holds the answer
            out["message"] = {"role": "assistant", "content": "".join(text)}
        elif not chat:
            out["response"] = "".join(text)
        return JSONResponse(out)


def _refuse(what: str) -> Callable[[Request], Awaitable[Response]]:
    async def refused(request: Request) -> Response:
        raise HttpError(NOT_HERE[what], status=501)

    refused.__name__ = what
    return refused


def _chunk(
    event: TokenEvent, model: str, chat: bool, tool_parse: str, held: list[str]
) -> dict[str, Any]:
    """One event as Ollama's chunk. With tools, text is held (`held`) and the whole answer
    goes out with the last chunk, its calls parsed; else each piece goes out as it comes
    (and is appended to `held`, for a whole answer). Raises for a failed generation."""
    end = _finish_reason(event)
    if end is not None and end not in replies.FINISH:
        why = event.error or "no reason given"
        if why.startswith(ConstraintFailed.PREFIX):
            raise HttpError(f"generation failed: {why}")
        raise HttpError(f"generation {end}: {why}", status=500)
    held.append(event.text)
    text = event.text
    calls: list[dict[str, Any]] = []
    if tool_parse:
        text = ""
        if end is not None:
            message, _ = replies.assistant_message("".join(held), tool_parse, end)
            text = message.get("content") or ""
            calls = shapes.ollama_calls(message)
    out: dict[str, Any] = {"model": model, "created_at": shapes.now()}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        if calls:
            out["message"]["tool_calls"] = calls
    else:
        out["response"] = text
    if end is None:
        return {**out, "done": False}
    return {**out, **shapes.final_fields(end, event.stats)}


async def _chunks(
    handle: RequestHandle,
    events: EventPipe[TokenEvent],
    model: str,
    chat: bool,
    tool_parse: str,
) -> AsyncIterator[bytes]:
    """The NDJSON stream: a chunk per piece, the last with `done: true` and the counts; a
    failure mid-stream is an ``{"error": ...}`` line (Ollama's way)."""
    held: list[str] = []
    try:
        while True:
            event, count = await _take(events)
            handle.consumed(count)
            if handle.refused is not None:
                yield _line({"error": str(handle.refused)})
                return
            try:
                chunk = _chunk(event, model, chat, tool_parse, held)
            except HttpError as exc:
                yield _line({"error": str(exc)})
                return
            message = chunk.get("message") or {}
            if (
                chunk["done"]
                and tool_parse
                and (message.get("content") or message.get("tool_calls"))
            ):
                # the answer (and its calls) first, then an empty last chunk with the counts
                yield _line(
                    {
                        "model": model,
                        "created_at": chunk["created_at"],
                        "message": message,
                        "done": False,
                    }
                )
                chunk["message"] = {"role": "assistant", "content": ""}
            elif not chunk["done"] and not (message or chunk).get(
                "content" if chat else "response"
            ):
                continue
            yield _line(chunk)
            if chunk["done"]:
                return
    finally:
        if not handle.done.is_set():
            handle.cancel()
            log.info("ollama %s: stream closed early; cancelled", handle.id)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
