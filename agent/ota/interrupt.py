"""The interrupt of the update in progress: why the operator cancelled it, the event the
download threads read (a cancel or a shutdown stops a fetch at its next read), and the wake-up
that cuts the pause between download attempts."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from agent.ota.artifact.manifest import UpdateRejected


class Interrupt:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self._wake: asyncio.Event | None = None  # cuts the pause between download attempts
        self._cancel = ""  # why the update in progress was cancelled (set by `cancel`)

    def reset(self) -> None:
        """A run starts (on the event loop): not stopped, not cancelled."""
        self.stop.clear()
        self._cancel = ""
        self._wake = asyncio.Event()

    def cancel(self, reason: str) -> None:
        """The operator's cancel: the run ends at its next `check` with code `cancelled`."""
        self._cancel = reason
        self.stop.set()  # a download stops at its next read
        if self._wake is not None:
            self._wake.set()

    def check(self) -> None:
        if self._cancel:
            raise UpdateRejected("cancelled", self._cancel)

    async def pause(self, seconds: float) -> None:
        """Sleep between download attempts; a cancel ends it at once."""
        assert self._wake is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self.check()
