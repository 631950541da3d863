"""What each signature call costs, measured: a running mean of seconds per signature
(`CallCosts`), kept by `agent.runtime.runner.RunnerBase` around every call, which the
speculation policy compares. Warm-up calls are skipped and outliers capped so that the mean
follows the kernels' steady cost. Nothing here imports numpy or LiteRT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

# After this many calls the mean weighs new calls as an exponential moving average of this
# span: it follows a change (a longer context, a busier machine) instead of freezing.
SPAN: Final = 16
SKIP: Final = 2  # first calls of a signature not counted
OUTLIER: Final = 1.5  # a counted call costs at most this many times the mean so far


class RunningMean:
    """Count and mean of a series of seconds; `add` is a few float operations."""

    __slots__ = ("count", "mean")

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0

    def add(self, x: float) -> None:
        if self.count >= 2 and x > OUTLIER * self.mean:
            x = OUTLIER * self.mean
        self.count += 1
        self.mean += (x - self.mean) / (self.count if self.count < SPAN else SPAN)


class CallCosts:
    """Per-signature running means of call seconds (the first `SKIP` calls of each not
    counted).

    `decode_s` / `verify_s` name the signature a cache would use now: its window's decode, the
    shortest verify signature of its window holding `n` tokens (`signature_of` answers which).
    """

    def __init__(self, signature_of: Callable[[Any, int], str | None]) -> None:
        self._means: dict[str, RunningMean] = {}
        self._seen: dict[str, int] = {}
        self._signature_of = signature_of  # (kv, n tokens) -> key, n == 1 is decode

    def add(self, key: str, seconds: float) -> None:
        mean = self._means.get(key)
        if mean is None:
            seen = self._seen.get(key, 0)
            if seen < SKIP:  # lazy initialisation, first page faults
                self._seen[key] = seen + 1
                return
            mean = self._means[key] = RunningMean()
        mean.add(seconds)

    def clear(self) -> None:
        """Forget every measurement (the load's checks ran each signature first: those calls
        pay lazy initialisation and page faults, not what a request's call costs)."""
        self._means.clear()
        self._seen.clear()

    def mean(self, key: str) -> float | None:
        """The mean seconds of a call of signature `key`, or None before any counted call."""
        m = self._means.get(key)
        return m.mean if m is not None else None

    def count(self, key: str) -> int:
        """Counted calls of signature `key`."""
        m = self._means.get(key)
        return m.count if m is not None else 0

    def calls(self, key: str) -> int:
        """Timed calls of signature `key` since the last `clear`, counted or not."""
        return self._seen.get(key, 0) + self.count(key)

    def decode_s(self, kv: Any) -> float | None:
        """The mean seconds of the decode call `kv` would make now."""
        key = self._signature_of(kv, 1)
        return None if key is None else self.mean(key)

    def verify_s(self, kv: Any, n: int) -> float | None:
        """The mean seconds of the verify call of `n` tokens `kv` would make now (None: none
        measured, or no verify signature of its window holds `n`)."""
        key = self._signature_of(kv, n) if n > 1 else None
        return None if key is None else self.mean(key)
