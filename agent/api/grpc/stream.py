"""Engine thread → event loop for one streamed Generate call.

The engine runs on its own thread; its events reach the stream through
`loop.call_soon_threadsafe` into a per-request queue (`EventPipe`), and the consumer
acknowledges each event so the engine pauses a request whose client has fallen behind.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from agent.engine.types import TokenEvent


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


class EventPipe:
    """Engine thread → event loop, at most one message per `interval_s`.

    An event wakes the loop at once when the last message went out `interval_s` ago or more
    (so the first token, and every token of a slow model, go out without delay; the first
    message holds the first event alone, however late the loop wakes), when it ends
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
        # the first message is the first event alone: a fast model (the demo model speculating
        # decodes 100 tokens in ~7 ms) may have finished before the loop woke for it, and its
        # first token must still go out as it came, not merged with the whole answer
        first = self._due == 0.0
        while not first and self._items and batch[-1].finish_reason is None:
            batch.append(self._items.popleft())
        self._due = time.monotonic() + self._interval
        return batch
