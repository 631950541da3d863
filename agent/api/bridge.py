"""Engine thread → event loop: how both APIs take a request's events.

The engine runs on its own thread and hands each event to the request's sink; `EventPipe.put`
is that sink, and wakes the loop with `loop.call_soon_threadsafe`. The consumer takes what has
arrived as a batch and acknowledges it (`RequestHandle.consumed(len(batch))`), so the engine
pauses a request whose client has fallen behind (`limits.max_pending_events`): nothing queues
without bound. gRPC spaces its messages (`interval_s`, `flush_at`, its first event alone);
HTTP takes whatever has arrived whenever the loop is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import Field
from typing import Any, ClassVar, Generic, Protocol, TypeVar


class Event(Protocol):
    """What the pipe reads of an event (`agent.engine.types.TokenEvent`, a dataclass)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def finish_reason(self) -> str | None: ...


E = TypeVar("E", bound=Event)


def merge_events(events: Sequence[E]) -> E:
    """Consecutive events of one request as one: text and ids joined, the rest (the end, its
    stats and error) the last one's."""
    if len(events) == 1:
        return events[0]
    return dataclasses.replace(
        events[-1],
        text="".join(e.text for e in events),
        token_ids=tuple(t for e in events for t in e.token_ids),
    )


class EventPipe(Generic[E]):
    """Engine thread → event loop for one request, at most one batch per `interval_s`.

    An event wakes the loop at once when the last batch went out `interval_s` ago or more (so
    the first token, and every token of a slow model, go out without delay), when it ends the
    request, or when `flush_at` events are waiting (the engine pauses a request whose consumer
    leaves `limits.max_pending_events` unread: the interval must not throttle a fast model);
    events in between wait for the loop's timer and go out together. Each gRPC message costs
    the loop and a Python client CPU whatever it holds, on a board whose cores the model's
    threads also want (docs/PERFORMANCE.md). An interval of 0 takes what is there
    whenever the loop is free. `first_alone`: the first batch is the first event alone,
    however late the loop wakes.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        interval_s: float = 0.0,
        flush_at: int = 1,
        *,
        first_alone: bool = False,
    ) -> None:
        self._loop = loop
        self._interval = interval_s
        self._flush_at = max(1, flush_at)
        self._first_alone = first_alone
        self._items: deque[E] = deque()
        self._ready = asyncio.Event()
        self._woken = False  # a wake-up is already on its way
        self._due = 0.0  # monotonic time from which the next batch may go out
        self._taken = False  # a batch has gone out

    def put(self, event: E) -> None:  # engine thread
        self._items.append(event)
        if self._woken or not self._send_now(event):
            return  # the loop's timer collects it
        self._woken = True
        # a closed loop: the daemon is exiting and nobody reads
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._ready.set)

    def _send_now(self, last: E) -> bool:
        return (
            time.monotonic() >= self._due
            or last.finish_reason is not None
            or len(self._items) >= self._flush_at
        )

    async def take(self) -> list[E]:  # event loop: at least one, up to the end
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
        # gRPC's first message is the first event alone: a fast model may have finished
        # before the loop woke for it, and its first token must still go out as it came, not
        # merged with the whole answer
        alone = self._first_alone and not self._taken
        while not alone and self._items and batch[-1].finish_reason is None:
            batch.append(self._items.popleft())
        self._taken = True
        self._due = time.monotonic() + self._interval
        return batch
