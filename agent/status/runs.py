"""How each model runs on this device since it was activated: the serving model's figures and
the previous model's as it last ran (`ModelRun`), kept across restarts in the state directory.

`RunBook` owns ``<state>/model-runs.json`` (the current and the previous model only, so it
stays a few hundred bytes). The daemon opens it once a model is loaded (counting a restart, and
a crash when the last start never reached a clean stop: ``running`` is set at start and cleared
at a clean stop), feeds it the serving engine's counters on every status (`observe`), saves it
now and then (`save_if_due`) and at a switch, and closes it at a clean stop.

Counters carry over: what earlier processes and earlier engines of the same model counted is
the base, the serving engine's own counters are added to it. The percentiles are the serving
engine's window; before it has any, the last saved ones. A model switch (an update, a
rollback) moves the current run to `previous` and starts a new one.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.base.fsutil import atomic_write_bytes
from agent.engine.stats import ERROR_KINDS, NO_FIGURES, EngineStats, ModelInfo, Percentiles

log = logging.getLogger(__name__)

FILE_NAME = "model-runs.json"
FORMAT = 1
SAVE_EVERY_S = 60.0  # counters a kill -9 may lose at most (a clean stop saves them all)
MAX_RETIRED = 4  # replaced engines whose last requests may still be counted


@dataclass(frozen=True, slots=True)
class ModelRun:
    """A model's figures on this device since `activated_unix` (see docs/FLEET.md, "Model
    figures"). `errors` holds every kind in ERROR_KINDS; `cancelled` leaves out timeouts."""

    sha256: str
    version: str = ""
    name: str = ""
    quantization: str = ""
    digest: str = ""
    activated_unix: float = 0.0
    requests: int = 0
    errors: tuple[tuple[str, int], ...] = tuple((k, 0) for k in ERROR_KINDS)
    cancelled: int = 0
    ttft_ms: Percentiles = NO_FIGURES
    decode_tok_s: Percentiles = NO_FIGURES
    prefill_tok_s: Percentiles = NO_FIGURES
    samples: int = 0
    restarts: int = 0
    crashes: int = 0
    peak_rss_bytes: int = 0

    def error_count(self, kind: str) -> int:
        return dict(self.errors).get(kind, 0)


@dataclass(slots=True)
class _Live:
    """The serving engine's counters as last seen (the part not yet in the base)."""

    engine: int = 0  # which engine they came from (a new engine counts from zero)
    requests: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def peak_rss_bytes() -> int:
    """This process's peak resident set size: VmHWM of /proc/self/status (the peak of this
    program's memory since exec; getrusage's ru_maxrss may include the peak of the process that
    started it, whose memory it shared until exec), else ru_maxrss; 0 where neither is known."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return 0
    return int(peak) * (1 if sys.platform == "darwin" else 1024)  # Linux: KiB


def reset_peak_rss() -> None:
    """Make the peak RSS start again from the current RSS (Linux: clear_refs 5), so a model
    switched to in this process does not inherit the peak of the one before it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:  # not Linux, or not allowed: the peak then spans both models
        log.debug("peak RSS not reset: %s", exc)


class RunBook:
    """The per-model run record; thread-safe (a metrics scrape and the event loop both read)."""

    def __init__(self, path: Path, current: ModelRun, previous: ModelRun | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._base = current
        self._previous = previous
        self._live = _Live()
        # engines replaced while they still drain: their counts as last seen, and their model
        self._retired: dict[int, tuple[str, _Live]] = {}
        self._live_figures: tuple[Percentiles, Percentiles, Percentiles, int] | None = None
        self._saved_at = time.monotonic()
        self._dirty = False

    # ------------------------------------------------------------------ start and stop

    @classmethod
    def open(cls, state_dir: Path, info: ModelInfo, now: float | None = None) -> RunBook:
        """Start on `info`'s model: a restart of the recorded run (a crash too when it never
        stopped cleanly), or a new run (the recorded one becomes `previous`). Saved at once,
        marked running."""
        path = state_dir / FILE_NAME
        stored = _read(path)
        now = time.time() if now is None else now
        cur, prev = stored if stored is not None else (None, None)
        if cur is not None and cur[0].sha256 == info.sha256:
            run, was_running = cur
            run = replace(run, restarts=run.restarts + 1, crashes=run.crashes + was_running)
            log.info(
                "model runs: %s %s restarted (%d restarts, %d crashes since %s)%s",
                info.name,
                info.version,
                run.restarts,
                run.crashes,
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(run.activated_unix)),
                "; the last run did not stop cleanly" if was_running else "",
            )
        else:
            run, prev = _fresh(info, now), (cur[0] if cur is not None else prev)
            log.info("model runs: %s %s activated", info.name, info.version)
        book = cls(path, run, prev)
        book.save(running=True)
        return book

    def close(self) -> None:
        """A clean stop: every counter saved, the record marked stopped."""
        self.save(running=False)

    # ------------------------------------------------------------------ figures

    def observe(self, info: ModelInfo, engine: int, stats: EngineStats) -> None:
        """The serving engine (`engine`: its identity) and its counters now. Another model
        than the recorded one is a switch: the current run becomes `previous`, saved at once."""
        with self._lock:
            switched = info.sha256 != self._base.sha256
            new_engine = engine != self._live.engine
            if new_engine and self._live.engine:
                self._retire(self._base.sha256, self._live)
            if switched:
                self._previous = self._folded()
                self._base, self._live = _fresh(info, time.time()), _Live(engine)
                log.info(
                    "model runs: switched to %s %s; %s %s is now the previous run",
                    info.name,
                    info.version,
                    self._previous.name,
                    self._previous.version,
                )
            elif new_engine:  # a reload of the same model: a new engine counts from zero
                self._base, self._live = self._folded(), _Live(engine)
            if switched or new_engine:
                self._live_figures = None
            live = _live_of(engine, stats)
            if (live.requests, live.cancelled, live.errors) != (
                self._live.requests,
                self._live.cancelled,
                self._live.errors,
            ):
                self._dirty = True
            self._live = live
            if stats.samples:
                figures = (stats.ttft_ms, stats.decode_tok_s, stats.prefill_tok_s, stats.samples)
                self._live_figures = figures
        if switched:
            reset_peak_rss()
            self.save(running=True)

    def drained(self, engine: int, stats: EngineStats) -> None:
        """A replaced engine has finished its last requests: what it counted after it was last
        seen goes to the run of its model (the current one after a reload, `previous` after a
        switch; nowhere when that run is gone)."""
        with self._lock:
            final = _live_of(engine, stats)
            if engine == self._live.engine:  # not seen replaced yet: its last counts stand
                self._live, self._dirty = final, True
                return
            sha, seen = self._retired.pop(engine, ("", _Live()))
            counts = (final.requests, final.cancelled, final.errors)
            if not sha or counts == (seen.requests, seen.cancelled, seen.errors):
                return
            delta = _Live(
                engine,
                final.requests - seen.requests,
                final.cancelled - seen.cancelled,
                {k: n - seen.errors.get(k, 0) for k, n in final.errors.items()},
            )
            if sha == self._base.sha256:
                self._base = _add(self._base, delta)
            elif self._previous is not None and sha == self._previous.sha256:
                self._previous = _add(self._previous, delta)
            self._dirty = True

    def _retire(self, sha: str, live: _Live) -> None:
        """Under the lock: keep a replaced engine's last-seen counts until `drained`."""
        self._retired[live.engine] = (sha, live)
        while len(self._retired) > MAX_RETIRED:  # engines that never report drained
            del self._retired[min(self._retired)]

    def runs(self) -> tuple[ModelRun, ModelRun | None]:
        """The current run (base plus the serving engine's counters) and the previous one."""
        with self._lock:
            return self._folded(), self._previous

    def save_if_due(self, every_s: float = SAVE_EVERY_S) -> None:
        """Save when a counter moved and `every_s` has passed since the last save."""
        if self._dirty and time.monotonic() - self._saved_at >= every_s:
            self.save(running=True)

    def save(self, *, running: bool) -> None:
        """Write the record (atomically); a failure is one warning, never the daemon's end."""
        current, previous = self.runs()
        doc = {
            "format": FORMAT,
            "running": running,
            "current": _to_json(current),
            "previous": None if previous is None else _to_json(previous),
        }
        try:
            atomic_write_bytes(self.path, json.dumps(doc, indent=1).encode(), mode=0o644)
        except OSError as exc:
            log.warning("model runs: %s not saved: %s", self.path, exc)
            return
        self._saved_at, self._dirty = time.monotonic(), False

    def _folded(self) -> ModelRun:
        """Under the lock: the base with the live counters and figures added."""
        b = self._base
        run = replace(_add(b, self._live), peak_rss_bytes=max(b.peak_rss_bytes, peak_rss_bytes()))
        if self._live_figures is not None:
            ttft, decode, prefill, samples = self._live_figures
            run = replace(
                run, ttft_ms=ttft, decode_tok_s=decode, prefill_tok_s=prefill, samples=samples
            )
        return run


def _live_of(engine: int, stats: EngineStats) -> _Live:
    errors = dict(stats.errors)
    cancelled = stats.requests_cancelled - errors.get("timeout", 0)  # a timeout is an error
    return _Live(engine, stats.requests_total, cancelled, errors)


def _add(run: ModelRun, live: _Live) -> ModelRun:
    errors = dict(run.errors)
    for kind, n in live.errors.items():
        errors[kind] = errors.get(kind, 0) + n
    return replace(
        run,
        requests=run.requests + live.requests,
        cancelled=run.cancelled + live.cancelled,
        errors=tuple(errors.items()),
    )


def _fresh(info: ModelInfo, now: float) -> ModelRun:
    return ModelRun(
        sha256=info.sha256,
        version=info.version,
        name=info.name,
        quantization=info.quantization,
        digest=info.digest,
        activated_unix=now,
    )


# ---------------------------------------------------------------------------------- the file


def _to_json(run: ModelRun) -> dict[str, Any]:
    doc = asdict(run)
    doc["errors"] = dict(run.errors)
    return doc


def _from_json(doc: Any) -> ModelRun:
    if not isinstance(doc, dict) or not isinstance(doc.get("sha256"), str):
        raise ValueError("a run without a model sha256")
    errors = dict.fromkeys(ERROR_KINDS, 0)
    for kind, n in dict(doc.get("errors") or {}).items():
        errors[str(kind)] = int(n)
    ttft, decode, prefill = (_pct(doc.get(k)) for k in _PCT)
    plain = {k: v for k, v in doc.items() if k not in (*_PCT, "errors")}
    for k, v in plain.items():
        if k not in _FIELDS:
            raise ValueError(f"unknown field {k!r}")
        want = type(getattr(_EMPTY, k))
        if isinstance(v, bool) or not isinstance(v, (int, float) if want is float else want):
            raise ValueError(f"{k} = {v!r} is not a {want.__name__}")
    run = ModelRun(**plain)
    return replace(
        run,
        errors=tuple(errors.items()),
        ttft_ms=ttft,
        decode_tok_s=decode,
        prefill_tok_s=prefill,
    )


def _pct(doc: Any) -> Percentiles:
    if doc is None:
        return NO_FIGURES
    if not isinstance(doc, dict):
        raise ValueError(f"percentiles {doc!r} are not an object")
    return Percentiles(float(doc["p50"]), float(doc["p95"]))


_PCT = ("ttft_ms", "decode_tok_s", "prefill_tok_s")
_FIELDS = frozenset(ModelRun.__dataclass_fields__)
_EMPTY = ModelRun("")


def _read(path: Path) -> tuple[tuple[ModelRun, bool] | None, ModelRun | None] | None:
    """(current, whether it was running), previous — or None when there is no usable file (a
    bad one is said in one warning, then replaced: the file is the agent's own)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("model runs: %s unreadable (%s); starting a new record", path, exc)
        return None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not format {FORMAT}")
        cur = doc.get("current")
        prev = doc.get("previous")
        return (
            None if cur is None else (_from_json(cur), bool(doc.get("running"))),
            None if prev is None else _from_json(prev),
        )
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("model runs: %s is not a run record (%s); starting a new one", path, exc)
        return None
