"""The quality probe in the daemon (agent.ota.probe measures; docs/FLEET.md, Quality probe):
when it runs on the serving engine, its binding to the engine's runner, and its results as
health's `ModelRun.probe`.

Every runner call of the probe is made through `Engine.run_idle`: only while no request runs or
waits, with the engine thread held, on the probe's own fresh KV. A request arriving waits for
one decode step at most and gets exactly the tokens it gets without the probe. A model not
probed yet (the first start, an update's trial) is probed at once, between requests; after that
every `[probe] interval_s` once the engine has run nothing for `min_idle_s`, and a request
arriving abandons that probe (the next idle spell runs it again).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from agent.base.errors import AgentError
from agent.config.probe import ProbeConfig
from agent.daemon.canary import engine_model
from agent.engine.engine import Engine
from agent.ota import probe as qp
from agent.ota.canary import Model, Step
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.runtime.runner import KVCache
from agent.status.value import ProbeFigures

log = logging.getLogger("agent.daemon")  # the daemon's lines keep one logger name

T = TypeVar("T")
STOP_POLL_S = 0.5  # a probe waiting for the engine looks at the daemon's stop this often


class Yielded(Exception):
    """The probe gave way: requests ran past its patience, the engine stopped, or the daemon."""


@dataclass(frozen=True, slots=True)
class Patience:
    """How a probe waits for the engine: until `deadline` (monotonic) for each step; 0 (the
    periodic probe): not at all, a request arriving ends it."""

    deadline: float
    stop: threading.Event


def idle_model(engine: Engine, patience: Patience) -> Model:
    """The canary's `Model` of `engine` with every runner call made through `run_idle`."""
    base = engine_model(engine)  # its greedy, which the probe does not use
    runner, meta = engine.loaded.runner, engine.meta

    def encode(text: str) -> list[int]:
        """A plain prompt's ids (BOS as the engine adds it), with no context check: a text
        longer than the context is scored in windows."""
        ids = engine.tokenizer.encode(text)
        return [meta.bos_id, *ids] if meta.add_bos and meta.bos_id is not None else ids

    def held(fn: Callable[[], T]) -> T:
        while not patience.stop.is_set():
            wait = min(STOP_POLL_S, max(0.0, patience.deadline - time.monotonic()))
            out = engine.run_idle(lambda: (fn(),), wait)
            if out is not None:
                return out[0]
            if engine.stopping or time.monotonic() >= patience.deadline:
                break
        raise Yielded("the engine was busy or stopping")

    def first_logits(ids: Sequence[int]) -> npt.NDArray[np.float32]:
        step = steps(len(ids))
        for pos in range(len(ids) - 1):
            step(ids[pos], pos)
        return step(ids[-1], len(ids) - 1)

    def steps(n: int) -> Step:
        def fresh() -> KVCache:
            kv = runner.new_kv()
            runner.reserve(kv, n, 0)
            return kv

        kv = held(fresh)
        # copied under the lock: the logits may be a view of the runtime's output buffer, which
        # the next request's step overwrites
        return lambda token, pos: held(lambda: np.array(runner.decode(kv, token, pos)))

    return Model(base.vocab_size, encode, base.greedy, first_logits, steps)


def to_message(result: qp.Result) -> fpb.Probe:
    return fpb.Probe(
        probe_id=result.probe_id,
        nll_per_token=result.nll_per_token,
        nll_tokens=result.nll_tokens,
        canary_agreement=result.canary_agreement,
        canary_tokens=result.canary_tokens,
        measured_unix=result.measured_unix,
        runs=result.runs,
        cpu_s=result.cpu_s,
    )


class Prober:
    """Runs the probe on the serving engine (`tick` from the daemon's main loop, `settle` in an
    update's trial) in a thread of its own; `latest` is health's `probes` hook."""

    def __init__(self, config: Callable[[], ProbeConfig], state_dir: Path) -> None:
        self._config = config
        self._store = qp.ProbeStore(state_dir / "probe")
        self._set: qp.ProbeSet | None = None
        self._results: dict[str, qp.Result] | None = None  # read once, then kept in step
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._activity: tuple[int, ...] = ()
        self._idle_since = time.monotonic()
        self._failed: dict[str, float] = {}  # model sha256 -> when its probe last failed
        self._settle_until: dict[str, float] = {}  # model sha256 -> the trial's wait ends
        self._broken = ""  # the probe's files cannot be used: why (said once)

    def latest(self, sha256: str) -> fpb.Probe | None:
        """The latest probe of model `sha256` on this device, None if none."""
        with self._lock:
            result = (self._results or {}).get(sha256)
        return to_message(result) if result is not None else None

    def figures(self, sha256: str) -> ProbeFigures | None:
        """`latest` for GetStatus and /metrics (agent.status.value.ProbeFigures)."""
        with self._lock:
            r = (self._results or {}).get(sha256)
        if r is None:
            return None
        return ProbeFigures(
            probe_id=r.probe_id,
            nll_per_token=r.nll_per_token,
            nll_tokens=r.nll_tokens,
            canary_agreement=r.canary_agreement,
            canary_tokens=r.canary_tokens,
            measured_unix=r.measured_unix,
            runs=r.runs,
            cpu_s=r.cpu_s,
        )

    def tick(self, engine: Engine | None) -> None:
        """Start a probe when one is due: the serving model has none yet (patient: it waits
        for gaps between requests), or its last is `interval_s` old and the engine has run
        nothing for `min_idle_s` (a request arriving abandons it)."""
        cfg = self._config()
        if engine is None or not cfg.enabled or self._stop.is_set():
            return
        s = engine.stats()
        now = time.monotonic()
        activity = (s.requests_total, s.requests_rejected, s.active, s.queue_depth)
        if activity != self._activity or s.active or s.queue_depth:
            self._activity, self._idle_since = activity, now
        with self._lock:
            if self._running() or not self._ready():
                return
            sha = engine.info.sha256
            last = self._results_locked().get(sha)
            failed = self._failed.get(sha)
            if failed is not None and now - failed < cfg.interval_s:
                return
            if last is None and failed is None:
                self._start(engine, now + cfg.trial_wait_s)
            elif now - self._idle_since >= cfg.min_idle_s and (
                last is None or time.time() - last.measured_unix >= cfg.interval_s
            ):
                self._start(engine, 0.0)

    def settle(self, engine: Engine) -> None:
        """An update's trial (blocking: call off the event loop): the serving model's probe,
        run now if it has none, waited for up to `trial_wait_s` from the first call."""
        cfg = self._config()
        if not cfg.enabled:
            return
        sha, now = engine.info.sha256, time.monotonic()
        with self._lock:
            if not self._ready() or sha in self._results_locked():
                return
            until = self._settle_until.setdefault(sha, now + cfg.trial_wait_s)
            thread = self._thread if self._running() else None
            if thread is None and sha not in self._failed and now < until:
                thread = self._start(engine, until)
        if thread is not None:
            thread.join(max(0.0, until - now))

    def stop(self) -> None:
        """The daemon is stopping: a probe under way gives way at its next step."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------ under the lock

    def running(self) -> bool:
        """Whether a probe holds the engine now (its model must not be unloaded)."""
        return self._running()

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _ready(self) -> bool:
        """The probe set and the files are usable (else said once, and no probe runs)."""
        if self._broken:
            return False
        try:
            self._set = self._set or qp.load_set()
            self._results_locked()
        except qp.ProbeError as exc:
            self._broken = str(exc)
            log.error("probe: off (%s)", exc)
            return False
        return True

    def _results_locked(self) -> dict[str, qp.Result]:
        if self._results is None:
            self._results = self._store.results()
        return self._results

    def _start(self, engine: Engine, deadline: float) -> threading.Thread:
        patience = Patience(deadline, self._stop)
        t = threading.Thread(
            target=self._run, args=(engine, patience), name="edge-agent-probe", daemon=True
        )
        self._thread = t
        t.start()
        return t

    # ------------------------------------------------------------------ the probe's thread

    def _run(self, engine: Engine, patience: Patience) -> None:
        sha, pset = engine.info.sha256, self._set
        assert pset is not None
        cpu0 = time.process_time()
        try:
            model = idle_model(engine, patience)
            answers = self._store.answers(pset)
            context = engine.info.context_length
            tokenizer = tokenizer_id(engine)
            if answers is None:
                answers = base_answers(model, engine, pset, tokenizer)
                self._store.save_answers(pset, answers)
                log.info("probe: the canary answers are %s's (%s)", engine.info.name, sha[:12])
            figures = qp.measure(model, pset, answers, context, tokenizer)
            cpu = time.process_time() - cpu0
            result = self._store.record(sha, figures, qp.probe_id(pset, answers), time.time(), cpu)
        except Yielded:
            log.debug("probe: gave way to requests (%s)", sha[:12])
            return
        except Exception as exc:  # a figure is missing, nothing more: said, tried again later
            if isinstance(exc, AgentError | OSError):
                log.error("probe of %s failed: %s", sha[:12], exc)
            else:
                log.exception("probe of %s failed", sha[:12])
            with self._lock:
                self._failed[sha] = time.monotonic()
            return
        with self._lock:
            results = self._results_locked()
            results.clear()
            results.update(self._store.results())
        log.info(
            "probe: %s %s nll %.3f/token, canary agreement %.3f (%d tokens), %.2f CPU s",
            engine.info.name,
            sha[:12],
            result.nll_per_token,
            result.canary_agreement,
            result.canary_tokens,
            result.cpu_s,
        )


def tokenizer_id(engine: Engine) -> str:
    """The sha256 of `engine`'s tokenizer file: answers made on the same one are forced as
    their very ids."""
    return hashlib.sha256(engine.meta.tokenizer_path.read_bytes()).hexdigest()


def base_answers(model: Model, engine: Engine, pset: qp.ProbeSet, tokenizer: str) -> qp.Answers:
    """`engine`'s greedy answers to the probe's prompts (`model`: its `idle_model`)."""
    made = [
        qp.greedy_answer(
            model,
            engine.tokenizer.decode,
            engine.meta.stop_ids,
            prompt,
            pset.answer_tokens,
            engine.info.context_length,
        )
        for prompt in pset.prompts
    ]
    texts, ids = tuple(t for t, _ in made), tuple(i for _, i in made)
    return qp.Answers(engine.info.sha256, texts, tokenizer, ids)
