"""The engine: a loaded model, its tokenizer, and one thread that runs every request.

Callers `submit` a request with a sink for its events and get a `RequestHandle` back; the
engine thread admits requests into a bounded number of KV slots, steps them round-robin
(schedule → run one unit → emit), and never blocks on a caller: a request whose consumer has
fallen behind is simply skipped until it catches up. `generate` / `complete` are the
synchronous conveniences on top. The engine is handed a loaded model (`loading.load_model`,
which the daemon calls first) and does no I/O to start; `Engine.load` does both in one step.

Beside it, one noun each: `loading` (the model, its tokenizer and the KV slots the budget
holds), `intake` (a request checked and fitted to the context, or refused), `request` (the
handle and the in-flight request), `scheduler` (whose turn it is), `binding` (a request's KV
cache and the prefix cache), `generation` (one request's prefill and decode), `session` /
`sessions` / `kvpool` (a conversation, the KV tiers, the runtime caches), `sessioncalls` (the
engine's session API) and `stats` / `types` (the values it hands out).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from agent.base.errors import (
    AgentError,
    ConstraintFailed,
    NonFiniteLogits,
    Overloaded,
    SessionLost,
    Unavailable,
)
from agent.engine.batching.packing import Packing
from agent.engine.binding import PREFIX_BLOCK, bind, held_tokens, history, remember_prefix
from agent.engine.generation import Generation
from agent.engine.intake import Intake
from agent.engine.kvpool import KVPool
from agent.engine.loading import EngineModel, kv_slots, load_model
from agent.engine.quotas import ClientQuotas
from agent.engine.request import Prepared, RequestHandle, Sink, unstarted_stats
from agent.engine.sampler import Sampler
from agent.engine.scheduler import Scheduler
from agent.engine.sessions.calls import SessionCalls
from agent.engine.sessions.store import SessionStore
from agent.engine.speculation import Acceptance, speculator_for
from agent.engine.stats import EngineStats, Tally
from agent.engine.stopping import STOPPING_CUT, Stopping
from agent.engine.types import Completion, GenerateRequest, TokenEvent
from agent.engine.types import EngineLimits as EngineLimits  # where callers import it from
from agent.kv.prefix import PrefixCache
from agent.profile import DeviceProfile

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # the idle engine thread still beats this often
_SERIALS = itertools.count(1)  # Engine.serial: which engine counted what (never reused)


class Engine(SessionCalls, Stopping):
    """Run requests on one engine thread over a loaded model (`loading.load_model`; `load`
    does both in one call)."""

    def __init__(
        self, profile: DeviceProfile, model: EngineModel, *, limits: EngineLimits | None = None
    ) -> None:
        """Size the KV slots the budget holds for `limits` and start the engine thread; no
        I/O here: the engine owns `model` from now on."""
        self.profile = profile
        self.limits = limits or EngineLimits()
        max_active, self.memory = kv_slots(
            model.loaded.memory, profile.kv, self.limits.max_active, self.limits.max_sessions
        )
        self.meta, self.tokenizer, self.chat = model.meta, model.tokenizer, model.chat
        self.packing = Packing(model.loaded.runner, self.limits.batch_decode)
        self.loaded = model.loaded
        self.info = dataclasses.replace(model.info, memory=self.memory, **self.packing.info())
        self.max_sessions = self.limits.max_sessions
        self._stop_ids = model.stop_ids
        kvc = profile.kv
        self.quotas = ClientQuotas.of(self.limits, kvc, model.disk is not None, self.info)
        self._sched: Scheduler[Prepared] = Scheduler(
            max_active,
            self.limits.queue_capacity,
            client=Prepared.client,
            per_client=self.quotas.waiting,
        )
        pool = KVPool(
            self.loaded.runner.new_kv,
            self.memory.sessions,
            profile.runtime.arena_extend_strategy == "kNextPowerOfTwo",
        )
        self._prefix = (
            PrefixCache(kvc.prefix_max_bytes, PREFIX_BLOCK) if kvc.prefix_max_bytes else None
        )
        self._store = SessionStore(
            self.loaded.runner,
            pool,
            model.variant.sha256,
            max_sessions=self.limits.max_sessions,
            host_budget=kvc.host_max_bytes,
            disk=model.disk,
            prefix=self._prefix,
            quotas=self.quotas,
        )
        self._pool = pool
        self._cv = threading.Condition()
        self._intake = Intake(
            profile, self.meta, self.info, self.tokenizer, self.chat, self._store, self._cv
        )
        self._ids = itertools.count(1)
        self._stopping = False
        self._closed = False
        self._stall = 0.0
        self._init_stopping()
        self._beat = time.monotonic()
        self._tally = Tally()
        self.serial = next(_SERIALS)
        self._acceptance = Acceptance()  # what speculation saw so far: a new request's prior
        if profile.kv.preallocate:
            pool.grow(self.memory.sessions)
        self._thread = threading.Thread(target=self._loop, name="edge-agent-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(
        cls,
        profile: DeviceProfile,
        model_dir: Path,
        *,
        quantization: str | None = None,
        verify: bool = True,
        prefer_interpreter: bool = False,
        limits: EngineLimits | None = None,
        state_dir: Path | None = None,
        kv_windows: bool = True,
    ) -> Engine:
        """Load `model_dir` under `profile` and build its engine: the one step for callers
        that do not keep the loaded model apart (tests, `agent generate`, benchmarks)."""
        model = load_model(
            profile,
            model_dir,
            quantization=quantization,
            verify=verify,
            prefer_interpreter=prefer_interpreter,
            state_dir=state_dir,
            kv_windows=kv_windows,
        )
        return cls(profile, model, limits=limits)

    def encode_prompt(self, request: GenerateRequest) -> list[int]:
        return self._intake.encode_prompt(request)

    # ------------------------------------------------------------------ public API

    def submit(
        self, request: GenerateRequest, sink: Sink, *, timeout: float | None = None
    ) -> RequestHandle:
        """Validate and queue a request; its events go to `sink` from the engine thread.

        Raises InvalidRequest / ContextOverflow for bad input, Overloaded when the queue is
        full and Unavailable when the engine is stopping.
        """
        lim = self.limits
        handle = RequestHandle(
            f"r{next(self._ids)}",
            sink,
            lim.max_pending_events,
            event_tokens=lim.event_tokens,
            event_interval_s=lim.event_interval_s,
        )
        prepared = self._intake.prepare(request, handle, timeout)
        with self._cv:
            try:
                if self._stopping:
                    raise Unavailable("the engine is stopping")
                self._sched.submit(prepared)
            except AgentError as exc:
                if prepared.session is not None:
                    prepared.session.busy = False
                if isinstance(exc, Overloaded):
                    self._tally.totals["rejected"] += 1
                    log.warning("request refused: %s", exc)
                raise
            self._cv.notify()
        return handle

    def generate(
        self,
        request: GenerateRequest,
        cancel: threading.Event | None = None,
        *,
        timeout: float | None = None,
    ) -> Iterator[TokenEvent]:
        """Stream a request's events on the caller's thread; closing the iterator cancels it."""
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        handle = self.submit(request, events.put, timeout=timeout)
        try:
            while True:
                try:
                    event = events.get(timeout=0.05)
                except queue.Empty:
                    if cancel is not None and cancel.is_set():
                        handle.cancel()
                    continue
                handle.consumed()
                if cancel is not None and cancel.is_set():
                    handle.cancel()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not handle.done.is_set():
                handle.cancel()

    def complete(self, request: GenerateRequest, *, timeout: float | None = None) -> Completion:
        """Run a request to the end and collect it (no consumer thread wakes per token)."""
        collected: list[TokenEvent] = []
        handle = self.submit(request, collected.append, timeout=timeout)
        handle.consumed(1 << 30)  # nobody reads while it runs: never pause it
        handle.done.wait()
        events = tuple(collected)
        last = events[-1]
        if last.finish_reason is None or last.stats is None:
            raise AssertionError("the last event of a request carries its finish and stats")
        return Completion(
            text="".join(e.text for e in events),
            token_ids=tuple(t for e in events for t in e.token_ids),
            finish_reason=last.finish_reason,
            stats=last.stats,
            events=events,
        )

    def stats(self) -> EngineStats:
        with self._cv:
            return self._tally.stats(
                queue_depth=len(self._sched.waiting),
                queue_capacity=self._sched.queue_capacity,
                active=len(self._sched.running),
                max_active=self._sched.max_running,
                heartbeat_age_s=self.heartbeat_age(),
            )

    def heartbeat_age(self) -> float:
        """Seconds since the engine thread last went round its loop (a wedge shows here)."""
        return time.monotonic() - self._beat

    def close(self) -> None:
        if not self._closed:
            self.stop(drain_timeout=0.0)
        self.loaded.runner.close()

    # ------------------------------------------------------------------ engine thread

    def kv_pool_size(self) -> int:
        """KV caches allocated so far (free and in use)."""
        with self._cv:
            return self._pool.made

    def _admit(self) -> None:
        for p in self._sched.drop_waiting(lambda p: not p.handle.cancel_event.is_set()):
            self._tally.totals["cancelled"] += 1
            if p.session is not None:
                p.session.busy = False
                self._store.unstage(p.session)
            p.handle.emit(TokenEvent("", finish_reason="cancelled", stats=unstarted_stats(p)))
        for p in self._sched.admit():
            try:
                start = bind(p, self._store, self._prefix, self.loaded.runner)
            except (SessionLost, Overloaded) as exc:  # logged where they arise
                self._fail_admitted(p, str(exc))
                continue
            except Exception as exc:  # one failed request must not take the engine down
                log.exception("request %s failed to start", p.handle.id)
                self._fail_admitted(p, f"{type(exc).__name__}: {exc}")
                continue
            assert p.kv is not None
            p.generation = Generation(
                self.loaded.runner,
                p.kv,
                self.tokenizer.stream(),
                p.ids[p.cached :],
                start_pos=start,
                max_tokens=p.max_tokens,
                # repetition_penalty looks back over the conversation as the model sees it
                sampler=Sampler(p.sampling, history(p)),
                stop=p.stop,
                stop_ids=self._stop_ids,
                prefill_chunk=self.profile.generation.prefill_chunk,
                vocab=self.tokenizer.vocab_size,
                cached_tokens=p.cached + (p.session.kv_len if p.session is not None else 0),
                prefix_tokens=p.cached,
                truncated_tokens=p.truncated,
                cancel=p.handle.cancel_event,
                deadline=p.deadline,
                queued_at=p.handle.submitted_at,
                # drafts come from the whole conversation: a session's history is in its KV
                speculator=speculator_for(
                    p.speculation, self.loaded.runner, history(p), self._acceptance
                ),
            )

    def _fail_admitted(self, p: Prepared, error: str) -> None:
        """End a request that could not get its KV cache: its slot, cache and session go back."""
        self._sched.finish(p)
        if p.session is not None:
            p.session.busy = False
        elif p.kv is not None:
            self._store.give_kv(p.kv)
        self._tally.totals["failed"] += 1
        self._tally.errors["internal"] += 1
        p.handle.emit(TokenEvent("", finish_reason="error", stats=unstarted_stats(p), error=error))

    def _ready(self, p: Prepared) -> bool:
        """Its consumer keeps up, or it is about to end (cancelled, past its deadline, or its
        consumer stopped reading for `limits.consumer_stall_s`: then it is cancelled, and its
        slot goes to another request)."""
        if p.handle.cancel_event.is_set() or p.handle.can_emit():
            return True
        if p.handle.stalled_for() > self.limits.consumer_stall_s:
            log.warning(
                "request %s: its client read nothing for %.0f s; cancelled",
                p.handle.id,
                self.limits.consumer_stall_s,
            )
            p.handle.cancel()
            return True
        return p.deadline is not None and time.monotonic() > p.deadline

    def _loop(self) -> None:
        while True:
            self._beat = time.monotonic()
            with self._cv:
                if self._closed or (self._stopping and not self._sched.busy):
                    return
                stall, self._stall = self._stall, 0.0
                self._admit()
                p = None if stall else self._sched.next(self._ready)
                if p is None and not stall:
                    # idle, or every running request waits for its consumer
                    self._cv.wait(HEARTBEAT_S if not self._sched.running else 0.002)
                    continue
                rows = self.packing.group(self._sched, p, self._ready) if p is not None else []
            if rows:
                self.packing.step(rows, self._run)
            elif p is not None:
                self._step(p)
            else:
                self._in_stall = True
                self._unstall.wait(stall)  # a real stall: nothing on this thread runs meanwhile
                self._in_stall = False

    def _step(self, p: Prepared) -> None:
        """One unit of `p`'s work; a request running alone goes on decoding until an event
        reaches its consumer (its handle holds the tokens in between), so the loop's lock,
        admission and turn are once per event, not once per token."""
        gen = p.generation
        assert gen is not None
        while True:
            sent, events = self._run(p, gen.step)
            if sent or not events or gen.done or self._others():
                return

    def _run(
        self, p: Prepared, work: Callable[[], list[TokenEvent]]
    ) -> tuple[bool, list[TokenEvent]]:
        """Run one unit of `p`'s work, retire it when done, emit its events; whether an event
        reached the consumer, and the events."""
        gen = p.generation
        assert gen is not None
        kind = "internal"  # of an error (ERROR_KINDS)
        try:
            events = work()
        except NonFiniteLogits as exc:  # the model's fault, not a bug: one line, counted
            log.error("request %s failed: %s", p.handle.id, exc)
            with self._cv:
                self._tally.totals["nonfinite"] += 1
            events, kind = [gen.fail(str(exc))], "nonfinite"
        except ConstraintFailed as exc:  # the request's grammar, not a bug: one line
            log.warning("request %s failed: %s", p.handle.id, exc)
            events, kind = [gen.fail(str(exc))], "constraint"
        except Exception as exc:  # one failed request must not take the engine down
            log.exception("request %s failed", p.handle.id)
            events = [gen.fail(str(exc))]
        if gen.done and self._cut and events[-1].finish_reason == "cancelled":
            events[-1] = dataclasses.replace(events[-1], error=STOPPING_CUT)
        if gen.done:  # before the final event: a client that continues the session at once
            self._retire(p, events[-1], kind)  # must find it idle, not "already running"
        sent = False
        for e in events:
            sent = p.handle.emit(e) or sent
        if sent:
            # A decode call holds the GIL, so the consumer thread this event woke would
            # wait for the interpreter's switch interval or longer; sleep(0) lets it take
            # the GIL now.
            time.sleep(0)
        return sent, events

    def _others(self) -> bool:
        """Whether anything but the one running request wants the loop: another running or
        waiting request, a stop, a stall. Read without the lock (a length and flags, each read
        atomically): at worst the loop sees it one token later."""
        s = self._sched
        return len(s.running) > 1 or bool(s.waiting) or self._stopping or self._stall > 0

    def _retire(self, p: Prepared, last: TokenEvent, error_kind: str) -> None:
        stats = last.stats
        with self._cv:
            self._sched.finish(p)
            session = p.session
            start = session.kv_len if session is not None else 0
            if last.finish_reason in ("stop", "length"):
                try:
                    remember_prefix(p, start, self._prefix, self.loaded.runner, self.info.sha256)
                except Exception:  # only the cache misses it: the request has its answer
                    log.exception("request %s: prompt not added to the prefix cache", p.handle.id)
            if session is not None:
                gen = p.generation
                assert gen is not None and p.new_ids is not None
                session.turns.append(len(session.tokens))
                session.tokens += p.new_ids + gen.generated
                # a turn that failed in the runtime (a step, a KV window move) may have left its
                # cache half written: the next turn prefills the history again from its tokens
                session.kv_len = 0 if last.finish_reason == "error" else gen.kv_rows
                session.busy = False
                session.last_used = time.time()
            elif p.kv is not None:
                gen = p.generation
                assert gen is not None
                held = held_tokens(p, gen.generated, gen.kv_rows, last.finish_reason or "")
                self._store.give_kv(p.kv, held, len(p.ids))
            self._tally.finished(last, error_kind)
        if stats is not None:
            log.info(
                "request %s %s: %d+%d tokens, ttft %.1f ms, decode %.1f tok/s",
                p.handle.id,
                last.finish_reason,
                stats.prompt_tokens,
                stats.generated_tokens,
                stats.ttft_ms,
                stats.decode_tok_s,
                extra={"request_id": p.handle.id, "model": self.info.name},
            )
