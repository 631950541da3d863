"""The asyncio client: `grpc.aio` on the daemon's unix socket; the same methods as `Client`,
awaited, and generations iterated with ``async for``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from edge_agent_client import _wire, types
from edge_agent_client._wire import MessageLike
from edge_agent_client.errors import from_rpc_error
from edge_agent_client.pb.edge_agent.v1 import agent_pb2 as pb
from edge_agent_client.types import Chunk, Completion, ModelInfo, SessionInfo, Status


class AsyncGeneration(AsyncIterator[Chunk]):
    """A running generation: ``async for`` its `Chunk`s; `cancel()` stops it (the daemon stops
    within one token); `await completion()` collects the rest."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._stream = call.__aiter__()
        self._collected = _wire.Collector()
        self._cancelled = False
        self._done = False

    def __aiter__(self) -> AsyncGeneration:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._stream.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except (grpc.RpcError, grpc.aio.AioRpcError) as exc:
            self._done = True
            if self._cancelled:
                raise StopAsyncIteration from None
            raise from_rpc_error(exc) from exc
        except asyncio.CancelledError:
            # grpc.aio's read of a call we cancelled raises this; anything else is the task's
            self._done = True
            if self._cancelled and self._call.cancelled():
                raise StopAsyncIteration from None
            raise
        chunk = types.chunk(message)
        self._collected.add(
            chunk.text,
            chunk.token_ids,
            chunk.finish_reason,
            chunk.stats,
            chunk.error,
            chunk.request_id,
        )
        return chunk

    @property
    def request_id(self) -> str:
        return self._collected.request_id

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Cancel the RPC; iteration then ends. Safe to call more than once or after the end."""
        if not self._done:
            self._cancelled = True
            self._call.cancel()

    async def completion(self) -> Completion:
        async for _ in self:
            pass
        return self._collected.completion(self._cancelled)


class AsyncClient:
    """`Client` for asyncio (grpc.aio); create and use it inside the running event loop."""

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        key: str | None = None,
        timeout: float | None = 60.0,
        generate_timeout: float | None = None,
    ) -> None:
        self.target = _wire.target_of(socket)
        self.timeout = timeout
        self.generate_timeout = generate_timeout
        self._metadata = _wire.metadata_of(_wire.resolve_key(key))
        self._channel = grpc.aio.insecure_channel(self.target)
        self._generate = self._channel.unary_stream(
            _wire.SERVICE + "Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _unary(self, method: str, request: Any) -> Any:
        serialize, parse = _wire.UNARY[method]
        call = self._channel.unary_unary(
            _wire.SERVICE + method, request_serializer=serialize, response_deserializer=parse
        )
        try:
            return await call(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def generate(
        self,
        prompt: str | Sequence[MessageLike],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        session_id: str | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
        json_object: bool = False,
        regex: str | None = None,
        grammar: str | None = None,
        logit_bias: Mapping[int, float] | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        repeat_last_n: int | None = None,
    ) -> AsyncGeneration:
        """As `Client.generate`; iterate the result with ``async for``."""
        request = _wire.generate_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            session_id=session_id,
            json_schema=json_schema,
            json_object=json_object,
            regex=regex,
            grammar=grammar,
            logit_bias=logit_bias,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            repeat_last_n=repeat_last_n,
        )
        call = self._generate(request, timeout=self.generate_timeout, metadata=self._metadata)
        return AsyncGeneration(call)

    async def complete(self, prompt: str | Sequence[MessageLike], **options: Any) -> Completion:
        return await self.generate(prompt, **options).completion()

    async def tokenize(self, text: str, *, add_bos: bool = False) -> tuple[int, ...]:
        r = await self._unary("Tokenize", pb.TokenizeRequest(text=text, add_bos=add_bos))
        return tuple(r.token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        r = await self._unary("Detokenize", pb.DetokenizeRequest(token_ids=list(token_ids)))
        return str(r.text)

    async def model_info(self) -> ModelInfo:
        return types.model_info(await self._unary("GetModelInfo", pb.GetModelInfoRequest()))

    async def status(self) -> Status:
        return types.status(await self._unary("GetStatus", pb.GetStatusRequest()))

    async def create_session(self, *, policy: str = "error") -> str:
        r = await self._unary("CreateSession", pb.CreateSessionRequest(policy=policy))
        return str(r.id)

    async def fork_session(self, session_id: str) -> str:
        return str((await self._unary("ForkSession", pb.ForkSessionRequest(id=session_id))).id)

    async def list_sessions(self) -> tuple[SessionInfo, ...]:
        r = await self._unary("ListSessions", pb.ListSessionsRequest())
        return tuple(types.session_info(s) for s in r.sessions)

    async def delete_session(self, session_id: str) -> None:
        await self._unary("DeleteSession", pb.DeleteSessionRequest(id=session_id))

    async def health(self, service: str = "") -> str:
        call = self._channel.unary_unary(
            _wire.HEALTH_CHECK, request_serializer=None, response_deserializer=None
        )
        try:
            data = await call(_wire.health_request(service), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return _wire.health_status(data)
