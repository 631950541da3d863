"""What the signal handlers and the RPCs ask of the main loop: a handler only sets a flag and
wakes the loop, which acts on it at once (SIGTERM/SIGINT: stop; SIGHUP or a fleet command:
reload).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable

from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb

# "1": SIGUSR2 stalls the engine thread, a second one ends the stall (tests only)
FAULT_ENV = "EDGE_AGENT_FAULT_INJECTION"


class Requests:
    """The stop and reload flags, the event that wakes the main loop, and who awaits a reload."""

    def __init__(self) -> None:
        self.stop = False
        self._reload = False
        self._wake: asyncio.Event | None = None
        self._reload_waiters: list[asyncio.Future[fpb.ReloadDone]] = []

    def install(self, loop: asyncio.AbstractEventLoop, stall: Callable[[], None]) -> None:
        """Handle the signals on `loop`; SIGUSR2 calls `stall` when fault injection is on."""
        self._wake = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        if os.environ.get(FAULT_ENV) == "1":
            loop.add_signal_handler(signal.SIGUSR2, stall)

    def request_stop(self) -> None:
        self.stop = True
        if self._wake is not None:
            self._wake.set()

    def request_reload(self) -> None:
        self._reload = True
        if self._wake is not None:
            self._wake.set()

    def reload(self) -> asyncio.Future[fpb.ReloadDone]:
        """Ask for a reload (as SIGHUP does); the future resolves when it has finished."""
        future: asyncio.Future[fpb.ReloadDone] = asyncio.get_running_loop().create_future()
        self._reload_waiters.append(future)
        self.request_reload()
        return future

    async def wait(self, timeout: float) -> None:
        """Until a request wakes the loop, or `timeout` (one tick) has passed."""
        assert self._wake is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=timeout)
        self._wake.clear()

    def take_reload(self) -> list[asyncio.Future[fpb.ReloadDone]] | None:
        """The futures awaiting the reload asked for (None if none was, or a stop was)."""
        if not self._reload or self.stop:
            return None
        self._reload = False
        waiters, self._reload_waiters = self._reload_waiters, []
        return waiters
