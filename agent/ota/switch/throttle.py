"""The download's bandwidth cap (`[updates] max_download_bytes_s`): after each read the fetch
loop waits until the bytes so far fit the rate since the download began. A stall (a slow
source, a retry) earns no burst beyond one second's worth."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

BURST_S = 1.0  # at most this many seconds of unused rate are caught up at full speed


class Throttle:
    def __init__(self, bytes_s: int, monotonic: Callable[[], float] = time.monotonic) -> None:
        if bytes_s <= 0:
            raise ValueError(f"a bandwidth cap must be above 0 bytes/s, not {bytes_s}")
        self.bytes_s = bytes_s
        self._mono = monotonic
        self._start: float | None = None
        self._sent = 0

    def read_size(self, chunk: int) -> int:
        """What one read may ask for: a chunk, or a second's worth at a lower cap."""
        return max(1, min(chunk, self.bytes_s))

    def delay(self, n: int) -> float:
        """`n` more bytes arrived: the seconds to wait before the next read."""
        now = self._mono()
        if self._start is None:
            self._start = now
        self._sent += n
        due = self._start + self._sent / self.bytes_s
        if due < now - BURST_S:  # behind by more than the burst: count on from a second ago
            self._start, self._sent = now - BURST_S, 0
            return 0.0
        return max(0.0, due - now)

    def wait(self, n: int, stop: threading.Event) -> None:
        """Wait after `n` bytes (in the fetch thread); a cancel or a shutdown cuts it."""
        seconds = self.delay(n)
        if seconds > 0:
            stop.wait(seconds)


def throttle(bytes_s: int) -> Throttle | None:
    """The cap's throttle, None for 0 (no cap)."""
    return Throttle(bytes_s) if bytes_s > 0 else None
