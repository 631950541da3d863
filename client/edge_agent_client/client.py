"""The synchronous client: `grpc.insecure_channel` on the daemon's unix socket."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from edge_agent_client import _wire, types
from edge_agent_client._wire import MessageLike
from edge_agent_client.errors import from_rpc_error
from edge_agent_client.pb.edge_agent.v1 import agent_pb2 as pb
from edge_agent_client.types import Chunk, Completion, ModelInfo, SessionInfo, Status


class Generation(Iterator[Chunk]):
    """A running generation: iterate it for `Chunk`s; `cancel()` stops it (the daemon stops
    within one token and frees the slot); `completion()` collects the rest."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._collected = _wire.Collector()
        self._cancelled = False
        self._done = False

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            message = next(self._call)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as exc:
            self._done = True
            if self._cancelled:
                raise StopIteration from None
            raise from_rpc_error(exc) from exc
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
        """The daemon's id of this request (sent with the last chunk; "" until then, and for
        a cancelled request)."""
        return self._collected.request_id

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Cancel the RPC; iteration then ends. Safe to call more than once or after the end."""
        if not self._done:
            self._cancelled = True
            self._call.cancel()

    def completion(self) -> Completion:
        """Everything so far and the rest, as one `Completion`."""
        for _ in self:
            pass
        return self._collected.completion(self._cancelled)

    def __enter__(self) -> Generation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()


class Client:
    """The daemon's gRPC API, typed. `socket` is the unix socket path (default
    /run/edge-agent/agent.sock) or a gRPC target; `key` the client key its sessions belong to
    (default: $EDGE_AGENT_CLIENT_KEY, else the key file `edge-agent client` uses; "" = none);
    `timeout` (seconds) bounds every unary call and, when given, each generation."""

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
        self._channel = grpc.insecure_channel(self.target)
        self._generate = self._channel.unary_stream(
            _wire.SERVICE + "Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _unary(self, method: str, request: Any) -> Any:
        serialize, parse = _wire.UNARY[method]
        call = self._channel.unary_unary(
            _wire.SERVICE + method, request_serializer=serialize, response_deserializer=parse
        )
        try:
            return call(request, timeout=self.timeout, metadata=self._metadata)
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
        speculation: str | None = None,
    ) -> Generation:
        """Start generating from a prompt (a string) or chat messages (`Message`s, dicts or
        (role, content) pairs). Unset sampling fields take the profile's defaults; at most one
        of json_schema / json_object / regex / grammar constrains the output. `speculation`:
        "off" or "ngram" (the output is the same either way); None: the profile's.
        `logit_bias` (token id → bias in [-100, 100]), `presence_penalty`, `frequency_penalty`,
        `repetition_penalty`, `repeat_last_n`: the daemon's docs/API.md "Logit bias and
        penalties"; unset, they are off."""
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
            speculation=speculation,
        )
        call = self._generate(request, timeout=self.generate_timeout, metadata=self._metadata)
        return Generation(call)

    def complete(
        self,
        prompt: str | Sequence[MessageLike],
        **options: Any,
    ) -> Completion:
        """`generate(...)` run to its end, as one `Completion` (the same keyword options)."""
        return self.generate(prompt, **options).completion()

    def tokenize(self, text: str, *, add_bos: bool = False) -> tuple[int, ...]:
        r = self._unary("Tokenize", pb.TokenizeRequest(text=text, add_bos=add_bos))
        return tuple(r.token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self._unary("Detokenize", pb.DetokenizeRequest(token_ids=list(token_ids))).text)

    def model_info(self) -> ModelInfo:
        return types.model_info(self._unary("GetModelInfo", pb.GetModelInfoRequest()))

    def status(self) -> Status:
        return types.status(self._unary("GetStatus", pb.GetStatusRequest()))

    def create_session(self, *, policy: str = "error") -> str:
        """A new session's id; `policy` "error" or "truncate" (what a turn that would
        overflow the context does)."""
        return str(self._unary("CreateSession", pb.CreateSessionRequest(policy=policy)).id)

    def fork_session(self, session_id: str) -> str:
        return str(self._unary("ForkSession", pb.ForkSessionRequest(id=session_id)).id)

    def list_sessions(self) -> tuple[SessionInfo, ...]:
        r = self._unary("ListSessions", pb.ListSessionsRequest())
        return tuple(types.session_info(s) for s in r.sessions)

    def delete_session(self, session_id: str) -> None:
        self._unary("DeleteSession", pb.DeleteSessionRequest(id=session_id))

    def health(self, service: str = "") -> str:
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", ... ("" = the whole server)."""
        call = self._channel.unary_unary(
            _wire.HEALTH_CHECK, request_serializer=None, response_deserializer=None
        )
        try:
            data = call(_wire.health_request(service), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return _wire.health_status(data)
