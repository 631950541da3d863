"""Time on a board without a real-time clock (docs/UPDATES.md, "Time").

A Raspberry Pi boots with the time `fake-hwclock` saved at its last shutdown (or 1970) and steps
to the real time when NTP syncs, possibly minutes after the agent started. So:

* durations (timeouts, back-offs, the update trial) use `Clock.monotonic()`, which never steps;
  what must survive a restart is persisted as elapsed seconds, not as a wall-clock deadline;
* the wall clock (`Clock.wall()`) decides nothing until `Clock.state()` says it is
  synchronized: systemd-timesyncd's flag file exists, or the kernel's NTP status (adjtimex(2))
  is not `TIME_ERROR` (STA_UNSYNC clear), or the configuration says the clock is trusted (a
  board with a battery-backed RTC set by other means).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

TIMESYNC_FILE: Final = Path("/run/systemd/timesync/synchronized")
# [updates] clock: where "synchronized" comes from
SOURCES: Final = ("auto", "timesyncd", "kernel", "trusted")
_TIME_ERROR: Final = 5  # adjtimex's return value while the kernel clock is not synchronized
_TIMEX_BYTES: Final = 512  # more than struct timex on any ABI; the kernel reads `modes` only


@dataclass(frozen=True, slots=True)
class ClockState:
    """Whether the wall clock can be trusted now, and who says so: "timesyncd", "kernel",
    "trusted" (the configuration), or "" when nothing does."""

    synchronized: bool
    source: str = ""


def kernel_synchronized() -> bool | None:
    """The kernel's view (what `timedatectl` shows as "System clock synchronized"): True when an
    NTP client disciplines the clock, False when adjtimex(2) says TIME_ERROR, None where it
    cannot be asked (not Linux, no libc). Read-only: `modes` is 0."""
    adjtimex = _adjtimex()
    if adjtimex is None:
        return None
    buf = ctypes.create_string_buffer(_TIMEX_BYTES)  # zeroed: modes = 0, nothing is set
    state = int(adjtimex(buf))
    if state < 0:
        return None
    return state != _TIME_ERROR


@functools.cache
def _adjtimex() -> Callable[[ctypes.Array[ctypes.c_char]], int] | None:
    try:
        fn: Callable[[ctypes.Array[ctypes.c_char]], int] = ctypes.CDLL(None).adjtimex  # libc
    except (OSError, AttributeError):
        return None
    return fn


class Clock:
    """The agent's two clocks and the wall clock's sync state. Tests pass their own `wall`,
    `monotonic` and `kernel` (the seams); the daemon passes nothing but its configuration."""

    def __init__(
        self,
        source: str = "auto",
        timesync_file: Path = TIMESYNC_FILE,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        kernel: Callable[[], bool | None] = kernel_synchronized,
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"clock source {source!r} is not one of {', '.join(SOURCES)}")
        self.source = source
        self.timesync_file = timesync_file
        self.wall = wall
        self.monotonic = monotonic
        self._kernel = kernel
        self._last: ClockState | None = None

    def state(self) -> ClockState:
        """Synchronized or not, now (cheap: one stat and one syscall). A change is logged."""
        state = self._read()
        if state != self._last:
            if state.synchronized:
                log.info("clock: synchronized (%s), wall clock %.0f", state.source, self.wall())
            else:
                log.warning(
                    "clock: not synchronized (%s); update times are judged once it is",
                    self._why_not(),
                )
            self._last = state
        return state

    def _read(self) -> ClockState:
        if self.source == "trusted":
            return ClockState(True, "trusted")
        if self.source in ("auto", "timesyncd") and self.timesync_file.exists():
            return ClockState(True, "timesyncd")
        if self.source in ("auto", "kernel") and self._kernel():
            return ClockState(True, "kernel")
        return ClockState(False)

    def _why_not(self) -> str:
        parts = []
        if self.source in ("auto", "timesyncd"):
            parts.append(f"no {self.timesync_file}")
        if self.source in ("auto", "kernel"):
            parts.append("the kernel says unsynchronized")
        return ", ".join(parts)


@dataclass(slots=True)
class Stopwatch:
    """Elapsed monotonic seconds on top of what earlier runs accumulated (`base`, read from a
    record): time while the process was down does not count."""

    clock: Clock
    base: float = 0.0
    _since: float = 0.0

    def __post_init__(self) -> None:
        self._since = self.clock.monotonic()

    def elapsed(self) -> float:
        return self.base + max(0.0, self.clock.monotonic() - self._since)
