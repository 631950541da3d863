"""A request in flight: the caller's handle on it, and what the engine holds for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.engine.generation import Generation
from agent.engine.sampler import SamplingParams
from agent.engine.session import Session
from agent.engine.types import TokenEvent
from agent.runtime.runner import KVCache

Sink = Callable[[TokenEvent], None]


class RequestHandle:
    """A submitted request: its id, cancellation and flow control for its consumer."""

    def __init__(self, request_id: str, sink: Sink, max_pending: int) -> None:
        self.id = request_id
        self._sink = sink
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()
        self.done = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        """Stop the request at its next step (within one token)."""
        self.cancel_event.set()

    def consumed(self, n: int = 1) -> None:
        """The consumer took `n` events off its queue."""
        with self._lock:
            self._pending -= n

    def can_emit(self) -> bool:
        with self._lock:
            return self._pending < self._max_pending

    def emit(self, event: TokenEvent) -> None:
        with self._lock:
            self._pending += 1
        self._sink(event)
        if event.finish_reason is not None:
            self.done.set()


@dataclass(slots=True)
class Prepared:
    handle: RequestHandle
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    deadline: float | None
    session: Session | None = None
    new_ids: list[int] | None = None  # the turn's own tokens (sessions)
    generation: Generation | None = None
    kv: KVCache | None = None
    truncated: int = 0  # history tokens a truncate policy dropped for this turn
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    speculation: str = "off"  # the request's, checked (agent.engine.speculation)
