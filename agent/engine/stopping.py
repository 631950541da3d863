"""The engine's stop path, its fault-injected stall and `run_idle` (the engine thread held
while something else uses the runner between requests), mixed into `Engine`.

A stop refuses new requests; waiting ones run too (a model switch: nothing is dropped) or,
when the daemon stops, are refused at once (`handle.refused`); running ones may finish within
the drain time and are then cut: each ends with a final "cancelled" event that carries the
tokens it had not sent yet, stepped by the engine thread before it exits, so every consumer
gets its end (docs/API.md "Stopping, restarting, reloading").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from agent.base.errors import Unavailable
from agent.engine.request import Prepared, unstarted_stats
from agent.engine.scheduler import Scheduler
from agent.engine.sessions.store import SessionStore
from agent.engine.stats import Tally
from agent.engine.types import TokenEvent

log = logging.getLogger("agent.engine.engine")  # the engine's lines keep one logger name

STOPPING_REFUSED = "the agent is stopping; the request had not started: send it again later"
STOPPING_CUT = "the agent is stopping; the request was cut at the drain deadline"
IDLE_POLL_S = 0.05  # `run_idle` looks again this often while requests run

T = TypeVar("T")


class Stopping:
    """Mixed into `Engine`, which sets the attributes below and calls `_init_stopping`; its
    thread ends a cut request's final event with `STOPPING_CUT` when `_cut` is set and waits
    on `_unstall` while stalled."""

    _cv: threading.Condition
    _sched: Scheduler[Prepared]
    _store: SessionStore
    _tally: Tally
    _thread: threading.Thread
    _stopping: bool
    _closed: bool
    _stall: float

    def _init_stopping(self) -> None:
        self._drain_until = float("inf")  # monotonic: a stop cuts what still runs then
        self._cut = False  # the stop's drain time is over: a cancelled request was cut
        self._unstall = threading.Event()  # ends an injected stall (a stop, `end_stall`)
        self._in_stall = False
        self._refusing = False  # `hurry` came first: the stop refuses what waits

    def inject_stall(self, seconds: float) -> None:
        """Fault injection for tests: the engine thread sleeps for `seconds` at its next turn,
        or until `end_stall`, or until a stop's drain time is over (the stop then ends what
        the stall held)."""
        with self._cv:
            if self._stopping:
                return
            self._unstall.clear()
            self._stall = seconds
            self._cv.notify()

    def end_stall(self) -> None:
        """Fault injection for tests: end an injected stall; the thread goes on at once."""
        self._unstall.set()

    def run_idle(self, fn: Callable[[], T], wait_s: float = 0.0) -> T | None:
        """`fn()` on the calling thread while no request runs or waits and the engine thread is
        held (it waits for the lock), or None if that did not come within `wait_s` or the
        engine is stopping. For work on the runner beside the requests (the quality probe):
        keep `fn` short, a request arriving meanwhile waits for it."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while self._sched.busy or self._stall > 0:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping or self._closed:
                    return None
                self._cv.wait(min(left, IDLE_POLL_S))
            if self._stopping or self._closed:
                return None
            return fn()

    @property
    def stopping(self) -> bool:
        """A stop has begun: the engine takes no more requests (nor `run_idle` work)."""
        return self._stopping or self._closed

    @property
    def stalled(self) -> bool:
        """An injected stall is asked for or under way."""
        return self._stall > 0 or self._in_stall

    def stop(self, drain_timeout: float = 30.0, *, refuse_waiting: bool = False) -> bool:
        """Refuse new requests, let running ones finish (up to the timeout), then cut what is
        left and stop the thread. Returns True if everything drained.

        A cut request ends with a final "cancelled" event that carries the tokens it had not
        sent yet (its consumer gets it before the thread stops; nothing is dropped). Waiting
        requests run too (a model switch: nothing is refused), or, with `refuse_waiting` (the
        daemon stopping), end at once unstarted, with `handle.refused` saying why.
        """
        with self._cv:
            self._stopping = True
            self._drain_until = min(self._drain_until, time.monotonic() + drain_timeout)
            if refuse_waiting or self._refusing:
                self._refuse_waiting()
            self._cv.notify()
        while True:
            with self._cv:
                if not self._sched.busy or time.monotonic() >= self._drain_until:
                    break
            time.sleep(0.01)
        with self._cv:
            drained = not self._sched.busy
            if not drained:
                log.info(
                    "stop: drain time over; cutting %d running and %d waiting requests",
                    len(self._sched.running),
                    len(self._sched.waiting),
                )
            self._cut = True
            for p in [*self._sched.waiting, *self._sched.running]:
                p.handle.cancel()
            self._unstall.set()
            self._cv.notify()
        # the thread ends each cut request with its final event, then returns by itself
        self._thread.join(timeout=5.0)
        with self._cv:
            self._closed = True  # a thread still inside a step (a wedged runtime) exits after it
            self._cv.notify()
            self._store.persist_all()
        return drained

    def hurry(self, drain_timeout: float) -> None:
        """Bring a `stop` (an old engine draining after a reload) forward, whether it is under
        way or yet to come: waiting requests are refused and running ones cut within
        `drain_timeout`."""
        with self._cv:
            self._drain_until = min(self._drain_until, time.monotonic() + drain_timeout)
            self._refusing = True
            if self._stopping:
                self._refuse_waiting()
            self._cv.notify()

    def _refuse_waiting(self) -> None:
        """End every waiting request unstarted (under the lock; the engine thread never saw
        them): the caller gets `Unavailable`, as a request that came a moment later would."""
        refused = self._sched.drop_waiting(lambda p: False)
        for p in refused:
            self._tally.totals["cancelled"] += 1
            if p.session is not None:
                p.session.busy = False
                self._store.unstage(p.session)
            p.handle.refused = Unavailable(STOPPING_REFUSED)
            p.handle.emit(
                TokenEvent(
                    "", finish_reason="cancelled", stats=unstarted_stats(p), error=STOPPING_REFUSED
                )
            )
        if refused:
            log.info("stop: refused %d waiting requests", len(refused))
