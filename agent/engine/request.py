"""A request in flight: the caller's handle on it, and what the engine holds for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.base.errors import AgentError
from agent.engine.generation import Generation
from agent.engine.sampler import SamplingParams
from agent.engine.sessions.session import Session
from agent.engine.types import RequestStats, TokenEvent
from agent.runtime.runner import KVCache

Sink = Callable[[TokenEvent], None]


class RequestHandle:
    """A submitted request: its id, cancellation and flow control for its consumer, and the
    batching of its tokens into events.

    The engine hands `emit` one event per unit of work. The first event with tokens and the
    last event go to the sink at once; tokens in between are held and go out together, in
    order, as one event once `event_tokens` of them wait or `event_interval_s` has passed since
    the last event went out (so every token of a model slower than the interval goes out on
    its own). Each event costs its consumer a thread wake-up or a message; on a model that
    decodes a token in a fraction of a millisecond that cost is a large share of the step.
    `event_tokens` = 1 sends every event as it comes.
    """

    def __init__(
        self,
        request_id: str,
        sink: Sink,
        max_pending: int,
        *,
        event_tokens: int = 1,
        event_interval_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.id = request_id
        self._sink = sink
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()
        self.done = threading.Event()
        # why the engine ended it before it started (the agent stopping): the caller answers
        # with this error rather than with an empty answer
        self.refused: AgentError | None = None
        self.submitted_at = time.perf_counter()
        self._batch = max(1, event_tokens)
        self._interval = event_interval_s
        self._clock = clock
        self._held_text: list[str] = []  # engine thread only, like `emit`
        self._held_ids: list[int] = []
        self._sent_at: float | None = None  # when tokens last went out; None: not yet
        self._blocked_at: float | None = None  # since when its consumer has left it paused

    def cancel(self) -> None:
        """Stop the request at its next step (within one token)."""
        self.cancel_event.set()

    def consumed(self, n: int = 1) -> None:
        """The consumer took `n` events off its queue."""
        with self._lock:
            self._pending -= n
            self._blocked_at = None

    def can_emit(self) -> bool:
        with self._lock:
            if self._pending < self._max_pending:
                return True
            if self._blocked_at is None:
                self._blocked_at = time.monotonic()
            return False

    def stalled_for(self) -> float:
        """Seconds since its consumer last read while it waits paused (0: not paused)."""
        with self._lock:
            at = self._blocked_at
        return 0.0 if at is None else time.monotonic() - at

    def emit(self, event: TokenEvent) -> bool:
        """Pass an event on towards the sink (engine thread); True when the sink got one,
        False when its tokens are held for the next (see the class)."""
        if self._batch > 1:
            held = self._hold(event)
            if held is None:
                return False
            event = held
        with self._lock:
            self._pending += 1
        self._sink(event)
        if event.finish_reason is not None:
            self.done.set()
        return True

    def _hold(self, event: TokenEvent) -> TokenEvent | None:
        """The event to send now (held tokens first), or None when it joins the held ones."""
        text, ids = self._held_text, self._held_ids
        if event.finish_reason is None:
            text.append(event.text)
            ids.extend(event.token_ids)
            now = self._clock()
            sent = self._sent_at
            if sent is not None and len(ids) < self._batch and now - sent < self._interval:
                return None
            self._sent_at = now
            event = TokenEvent("".join(text), tuple(ids))
        elif ids or text:
            event = TokenEvent(
                "".join(text) + event.text,
                (*ids, *event.token_ids),
                finish_reason=event.finish_reason,
                stats=event.stats,
                error=event.error,
            )
        else:
            return event
        text.clear()
        ids.clear()
        return event


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
    owner: str = ""  # its client (GenerateRequest.owner): the queue is fair per client

    def client(self) -> str:
        """Whose request it is, for the scheduler's fairness between clients."""
        return self.owner


def unstarted_stats(p: Prepared) -> RequestStats:
    """The stats of a request that ended before it ran (refused, cancelled in the queue)."""
    return RequestStats(len(p.ids), 0, 0.0, 0.0, 0.0, 0.0, 0.0, "")
