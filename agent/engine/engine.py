"""The engine: a loaded model, its tokenizer, and one thread that runs every request.

Callers `submit` a request with a sink for its events and get a `RequestHandle` back; the
engine thread admits requests into a bounded number of KV slots, steps them round-robin
(schedule → run one unit → emit), and never blocks on a caller: a request whose consumer has
fallen behind is simply skipped until it catches up. `generate` / `complete` are the
synchronous conveniences on top.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.engine.chat import chat_ids, end_of_turn_ids, template_for
from agent.engine.generation import Generation
from agent.engine.sampler import Sampler, SamplingParams
from agent.engine.scheduler import Scheduler
from agent.engine.sessions import KVPool, Session, SessionStore, open_disk_tier
from agent.engine.types import (
    Completion,
    GenerateRequest,
    RequestStats,
    SessionInfo,
    TierStats,
    TokenEvent,
)
from agent.errors import (
    AgentError,
    ContextOverflow,
    InvalidRequest,
    ModelFormatError,
    NonFiniteLogits,
    Overloaded,
    SessionBusy,
    SessionLost,
    Unavailable,
)
from agent.kv.prefix import PrefixCache
from agent.kv.snapshot import KVSnapshot
from agent.modeldir import ModelMeta, Variant, open_model, sha256_file, unpack_cache_dir
from agent.profile import DeviceProfile, choose_quantization
from agent.runtime import litert
from agent.runtime.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 1 << 20
HEARTBEAT_S = 0.5  # the idle engine thread still beats this often
WINDOW = 512  # requests kept for the p50/p95 figures

Sink = Callable[[TokenEvent], None]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What is loaded and how it runs."""

    name: str
    version: str
    quantization: str
    sha256: str
    path: Path
    vocab_size: int
    context_length: int
    kv_layout: str
    signatures: tuple[str, ...]
    accelerator: str
    execution_path: str
    fallbacks: tuple[str, ...]
    memory: litert.MemoryPlan
    prepared: str = "none"  # the runtime's copy of the file: what it changed, or why refused


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_active: int = 4  # requests holding a KV slot at once (also bounded by the budget)
    queue_capacity: int = 16  # requests waiting for a slot
    max_pending_events: int = 64  # events a slow consumer may leave unread before a pause
    max_sessions: int = 64  # live sessions in all tiers; also caps the bound ones


PREFIX_BLOCK = 32  # tokens per block of the shared-prefix cache


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p95: float


@dataclass(frozen=True, slots=True)
class EngineStats:
    queue_depth: int
    queue_capacity: int
    active: int
    max_active: int
    requests_total: int
    requests_failed: int
    requests_rejected: int
    requests_cancelled: int
    tokens_generated: int
    ttft_ms: Percentiles
    decode_tok_s: Percentiles
    heartbeat_age_s: float
    nonfinite_logits: int = 0  # requests ended because the model gave NaN/inf logits


def _percentiles(values: deque[float]) -> Percentiles:
    if not values:
        return Percentiles(0.0, 0.0)
    s = sorted(values)
    return Percentiles(s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.95))])


class RequestHandle:
    """A submitted request: its id, cancellation and flow control for its consumer."""

    def __init__(self, request_id: str, sink: Sink, max_pending: int) -> None:
        self.id = request_id
        self._sink = sink
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()
        self.done = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        """Stop the request at its next step (within one token)."""
        self.cancel_event.set()

    def consumed(self, n: int = 1) -> None:
        """The consumer took `n` events off its queue."""
        with self._lock:
            self._pending -= n

    def can_emit(self) -> bool:
        with self._lock:
            return self._pending < self._max_pending

    def emit(self, event: TokenEvent) -> None:
        with self._lock:
            self._pending += 1
        self._sink(event)
        if event.finish_reason is not None:
            self.done.set()


@dataclass(slots=True)
class _Prepared:
    handle: RequestHandle
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    deadline: float | None
    session: Session | None = None
    new_ids: list[int] | None = None  # the turn's own tokens (sessions)
    generation: Generation | None = None
    kv: litert.KVCache | None = None
    truncated: int = 0  # history tokens a truncate policy dropped for this turn
    cached: int = 0  # prompt tokens whose KV came from the prefix cache


class Engine:
    """Load a model directory under a profile; run requests on one engine thread."""

    def __init__(
        self,
        profile: DeviceProfile,
        model_dir: Path,
        *,
        quantization: str | None = None,
        verify: bool = True,
        prefer_interpreter: bool = False,
        limits: EngineLimits | None = None,
        state_dir: Path | None = None,
        kv_windows: bool = True,
    ) -> None:
        self.profile = profile
        self.limits = limits or EngineLimits()
        self.meta: ModelMeta = open_model(  # a model directory or a .litertlm bundle
            model_dir, unpack_cache_dir(profile.runtime.xnnpack_weight_cache_dir, state_dir)
        )
        available = [v.quantization for v in self.meta.variants]
        quant = quantization or choose_quantization(profile, available)
        variant: Variant = self.meta.variant(quant)
        path = self.meta.path_of(variant)
        if verify:
            actual = sha256_file(path)
            if actual != variant.sha256:
                raise ModelFormatError(
                    f"{path}: sha256 {actual} does not match metadata {variant.sha256}"
                )
        self.tokenizer: Tokenizer = load_tokenizer(self.meta.tokenizer_path)
        self.chat = template_for(
            self.meta.chat_template, self.tokenizer, self.meta.bos_id, self.meta.eos_id
        )
        self.loaded = litert.load(
            path,
            profile,
            context_length=self.meta.context_length,
            prefer_interpreter=prefer_interpreter,
            cache_key=variant.sha256,
            kv_windows=kv_windows,
        )
        runner = self.loaded.runner
        layout = runner.layout
        if layout.vocab_size < self.tokenizer.vocab_size:
            raise ModelFormatError(
                f"{path}: model vocabulary {layout.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size}"
            )
        plan = self.loaded.memory
        # KV caches for running requests and bound sessions: as many as the limits ask for and
        # the budget holds beside the one the load counted, the host tier and the prefix cache.
        kvc = profile.kv
        spare = plan.budget - plan.total - kvc.host_max_bytes - kvc.prefix_max_bytes
        spare_slots = 1 + max(0, spare) // plan.kv_per_session
        max_active = max(1, min(self.limits.max_active, spare_slots))
        self.max_sessions = self.limits.max_sessions
        bound_slots = max(0, min(self.limits.max_sessions, spare_slots - max_active))
        self.memory = litert.MemoryPlan(
            plan.weights,
            plan.packed_weights,
            plan.activations,
            plan.kv_per_session,
            max_active + bound_slots,
            plan.budget,
            kvc.host_max_bytes + kvc.prefix_max_bytes,
        )
        self.info = ModelInfo(
            name=self.meta.name,
            version=self.meta.version,
            quantization=quant,
            sha256=variant.sha256,
            path=path,
            vocab_size=layout.vocab_size,
            context_length=layout.context_length,
            kv_layout=layout.kv.name,
            signatures=tuple(s.key for w in layout.all_windows() for s in w.signatures),
            accelerator=self.loaded.accelerator,
            execution_path=self.loaded.path_kind,
            fallbacks=self.loaded.fallbacks,
            memory=self.memory,
            prepared=self.loaded.prepared,
        )
        # the template's end-of-turn token ends an answer even if metadata.json omits it
        self._stop_ids = self.meta.stop_ids | end_of_turn_ids(self.chat, self.tokenizer)
        self._sched: Scheduler[_Prepared] = Scheduler(max_active, self.limits.queue_capacity)
        pool = KVPool(
            runner.new_kv,
            self.memory.sessions,
            profile.runtime.arena_extend_strategy == "kNextPowerOfTwo",
        )
        self._prefix = (
            PrefixCache(kvc.prefix_max_bytes, PREFIX_BLOCK) if kvc.prefix_max_bytes else None
        )
        self._store = SessionStore(
            runner,
            pool,
            variant.sha256,
            max_sessions=self.limits.max_sessions,
            host_budget=kvc.host_max_bytes,
            disk=open_disk_tier(state_dir, variant.sha256, kvc.disk_max_bytes),
            prefix=self._prefix,
        )
        self._pool = pool
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._stopping = False
        self._closed = False
        self._stall = 0.0
        self._beat = time.monotonic()
        self._totals = {
            "total": 0,
            "failed": 0,
            "rejected": 0,
            "cancelled": 0,
            "tokens": 0,
            "nonfinite": 0,
        }
        self._ttft: deque[float] = deque(maxlen=WINDOW)
        self._decode: deque[float] = deque(maxlen=WINDOW)
        if profile.kv.preallocate:
            pool.grow(self.memory.sessions)
        self._thread = threading.Thread(target=self._loop, name="edge-agent-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ validation

    def _turn_ids(self, request: GenerateRequest, *, first: bool) -> list[int]:
        """A prompt's ids, or a chat's (rendered by its template; `first`: no earlier turn
        in the KV). BOS/EOS are added to a plain prompt only: a chat template writes its own."""
        prompt = request.prompt
        if request.messages:
            chars = sum(len(m.content) for m in request.messages)
            if chars > MAX_PROMPT_CHARS:
                raise InvalidRequest(f"chat is {chars} characters; at most {MAX_PROMPT_CHARS}")
            rendered = chat_ids(self.chat, self.tokenizer, request.messages, continuing=not first)
            if not isinstance(rendered, str):
                return rendered
            prompt = rendered  # the old {system}/{user} form: a plain prompt
        if not prompt:
            raise InvalidRequest("prompt is empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")
        ids = self.tokenizer.encode(prompt)
        bos, eos = self.meta.bos_id, self.meta.eos_id
        if first and request.add_bos and self.meta.add_bos and bos is not None:
            ids = [bos, *ids]
        if self.tokenizer.config.add_eos_token and eos is not None:
            ids = [*ids, eos]
        return ids

    def encode_prompt(self, request: GenerateRequest) -> list[int]:
        ids = self._turn_ids(request, first=True)
        ctx = self.info.context_length
        if len(ids) >= ctx:  # at least one row must stay free for the first generated token
            raise ContextOverflow(len(ids), ctx)
        return ids

    def _prepare(
        self, request: GenerateRequest, handle: RequestHandle, timeout: float | None
    ) -> _Prepared:
        gen = self.profile.generation
        sampling = request.sampling or SamplingParams(
            temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p
        )
        sampling.validate(self.info.vocab_size)
        max_tokens = gen.max_tokens if request.max_tokens is None else request.max_tokens
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens = {max_tokens} must be at least 1")
        for s in request.stop:
            if not s:
                raise InvalidRequest("stop sequences must not be empty")
        deadline = None if timeout is None else time.monotonic() + timeout
        if request.session_id is None:
            ids = self.encode_prompt(request)
            if request.max_tokens is not None and len(ids) + max_tokens > self.info.context_length:
                raise ContextOverflow(len(ids), self.info.context_length, max_tokens)
            return _Prepared(handle, ids, max_tokens, sampling, request.stop, deadline)
        return self._prepare_turn(request, handle, max_tokens, sampling, deadline)

    def _prepare_turn(
        self,
        request: GenerateRequest,
        handle: RequestHandle,
        max_tokens: int,
        sampling: SamplingParams,
        deadline: float | None,
    ) -> _Prepared:
        """A turn of a session: feed only what the cache does not hold yet."""
        with self._cv:
            session = self._store.get(request.session_id or "", request.owner)
            if session.busy:
                raise SessionBusy(f"session {session.id} already has a request running")
            new = self._turn_ids(request, first=not session.tokens)
            dropped = self._fit_context(session, new, max_tokens, request.max_tokens)
            self._store.prepare(session)
            if session.tokens:
                self._store.note_resume(dropped == 0)
            feed = session.tokens[session.kv_len :] + new
            session.busy = True
        p = _Prepared(handle, feed, max_tokens, sampling, request.stop, deadline, session, new)
        p.truncated = dropped
        return p

    def _fit_context(
        self, s: Session, new: list[int], max_tokens: int, explicit: int | None = None
    ) -> int:
        """Make room for a turn under the session's policy; returns the tokens dropped.

        `error`: a turn that does not fit is refused with both numbers. `truncate`: the first
        turn (the system prompt) and the most recent turns that fit are kept, room is left for
        the answer (up to a quarter of the context), and what follows the first turn is
        prefilled again at its new positions. An `explicit` max_tokens (the request's own) must
        fit beside the turn as it does beside a plain prompt; checked before anything changes."""
        ctx = self.info.context_length
        total = len(s.tokens) + len(new)
        room = 1 if explicit is None else explicit  # rows the answer needs past the prompt
        if total + room <= ctx:
            return 0
        if s.policy != "truncate":
            raise ContextOverflow(total, ctx, explicit)
        reserve = min(max_tokens, ctx // 4) if explicit is None else explicit
        head = s.turns[1] if len(s.turns) > 1 else len(s.tokens)  # the end of the first turn
        fits = [t for t in s.turns[1:] if head + len(s.tokens) - t + len(new) + reserve <= ctx]
        keep_from = fits[0] if fits else len(s.tokens)
        if head + len(s.tokens) - keep_from + len(new) + room > ctx:
            raise ContextOverflow(head + len(new), ctx, explicit)
        dropped = keep_from - head
        if dropped > 0:
            kept = s.tokens[keep_from:]
            s.turns = s.turns[:1] + [head + t - keep_from for t in s.turns if t >= keep_from]
            s.tokens = s.tokens[:head] + kept
            s.kv_len = min(s.kv_len, head)
            log.info(
                "session %s: %d tokens of history dropped to fit the context (truncate)",
                s.id,
                dropped,
                extra={"session_id": s.id},
            )
        return dropped

    # ------------------------------------------------------------------ sessions

    def create_session(self, owner: str = "", policy: str = "error") -> str:
        """A new, empty conversation (policy `error` or `truncate` for a full context). When
        `max_sessions` are live, the least recently used idle one is dropped."""
        with self._cv:
            sid = self._store.create(owner, policy).id
        log.info("session %s created", sid, extra={"session_id": sid})
        return sid

    def fork_session(self, session_id: str, owner: str = "") -> str:
        """A new session with the conversation so far and a copy of its KV; the parent is
        unaffected."""
        with self._cv:
            child = self._store.fork(self._store.get(session_id, owner)).id
        log.info("session %s forked from %s", child, session_id, extra={"session_id": child})
        return child

    def delete_session(self, session_id: str, owner: str = "") -> None:
        with self._cv:
            self._store.delete(self._store.get(session_id, owner))
        log.info("session %s deleted", session_id, extra={"session_id": session_id})

    def list_sessions(self, owner: str | None = None) -> list[SessionInfo]:
        """The sessions of `owner` (None: everyone's), in creation order."""
        with self._cv:
            return self._store.infos(owner)

    def session_tokens(self, session_id: str, owner: str = "") -> list[int]:
        with self._cv:
            return list(self._store.get(session_id, owner).tokens)

    def session_count(self) -> int:
        with self._cv:
            return len(self._store.sessions)

    def hand_over_sessions(self) -> None:
        """Save idle sessions to the state directory and let go of it, so that the engine that
        replaces this one (a reload) adopts them; sessions mid-turn stay here."""
        with self._cv:
            self._store.hand_over()

    def tier_stats(self) -> TierStats:
        with self._cv:
            return self._store.stats()

    # ------------------------------------------------------------------ public API

    def submit(
        self, request: GenerateRequest, sink: Sink, *, timeout: float | None = None
    ) -> RequestHandle:
        """Validate and queue a request; its events go to `sink` from the engine thread.

        Raises InvalidRequest / ContextOverflow for bad input, Overloaded when the queue is
        full and Unavailable when the engine is stopping.
        """
        handle = RequestHandle(f"r{next(self._ids)}", sink, self.limits.max_pending_events)
        prepared = self._prepare(request, handle, timeout)
        with self._cv:
            try:
                if self._stopping:
                    raise Unavailable("the engine is stopping")
                self._sched.submit(prepared)
            except AgentError as exc:
                if prepared.session is not None:
                    prepared.session.busy = False
                if isinstance(exc, Overloaded):
                    self._totals["rejected"] += 1
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
            t = dict(self._totals)
            waiting, running = len(self._sched.waiting), len(self._sched.running)
            ttft, dec = _percentiles(self._ttft), _percentiles(self._decode)
        return EngineStats(
            queue_depth=waiting,
            queue_capacity=self._sched.queue_capacity,
            active=running,
            max_active=self._sched.max_running,
            requests_total=t["total"],
            requests_failed=t["failed"],
            requests_rejected=t["rejected"],
            requests_cancelled=t["cancelled"],
            tokens_generated=t["tokens"],
            ttft_ms=ttft,
            decode_tok_s=dec,
            heartbeat_age_s=self.heartbeat_age(),
            nonfinite_logits=t["nonfinite"],
        )

    def heartbeat_age(self) -> float:
        """Seconds since the engine thread last went round its loop (a wedge shows here)."""
        return time.monotonic() - self._beat

    def inject_stall(self, seconds: float) -> None:
        """Fault injection for tests: the engine thread sleeps for `seconds` at its next turn."""
        with self._cv:
            self._stall = seconds
            self._cv.notify()

    def stop(self, drain_timeout: float = 30.0) -> bool:
        """Refuse new requests, let running and queued ones finish (up to the timeout), then
        cancel what is left and stop the thread. Returns True if everything drained."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline:
            with self._cv:
                if not self._sched.busy:
                    break
            time.sleep(0.01)
        with self._cv:
            drained = not self._sched.busy
            for p in [*self._sched.waiting, *self._sched.running]:
                p.handle.cancel()
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5.0)
        with self._cv:
            self._store.persist_all()
        return drained

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
            self._totals["cancelled"] += 1
            if p.session is not None:
                p.session.busy = False
                self._store.unstage(p.session)
            p.handle.emit(TokenEvent("", finish_reason="cancelled", stats=_empty_stats(p)))
        for p in self._sched.admit():
            try:
                start = self._bind(p)
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
                sampler=Sampler(p.sampling),
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
            )

    def _fail_admitted(self, p: _Prepared, error: str) -> None:
        """End a request that could not get its KV cache: its slot, cache and session go back."""
        self._sched.finish(p)
        if p.session is not None:
            p.session.busy = False
        elif p.kv is not None:
            self._store.give_kv(p.kv)
        self._totals["failed"] += 1
        p.handle.emit(TokenEvent("", finish_reason="error", stats=_empty_stats(p), error=error))

    def _bind(self, p: _Prepared) -> int:
        """Give an admitted request its KV cache; returns the first row it writes. A session
        brings its own (restored if it was spilled); a fresh prompt may start from a cached
        prefix."""
        if p.session is not None:
            p.kv = self._store.bind(p.session)
            if p.session.kv_len:
                return p.session.kv_len
        else:
            p.kv = self._store.take_kv()
        if self._prefix is not None and len(p.ids) > PREFIX_BLOCK:
            hit = self._prefix.lookup(p.ids[:-1])
            if hit is not None:
                self.loaded.runner.write_rows(p.kv, hit.arrays)
                p.cached = len(hit.tokens)
        return p.cached

    def _remember_prefix(self, p: _Prepared, start: int) -> None:
        """Offer the prompt's whole blocks to the prefix cache (rows that hold prompt only)."""
        if self._prefix is None or start != 0 or p.kv is None:
            return
        n = (len(p.ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
        if n <= p.cached:
            return
        rows = self.loaded.runner.read_rows(p.kv, n)
        self._prefix.insert(p.ids[:n], KVSnapshot(self.info.sha256, tuple(p.ids[:n]), rows))

    @staticmethod
    def _ready(p: _Prepared) -> bool:
        """Its consumer keeps up, or it is about to end (cancelled, past its deadline)."""
        if p.handle.cancel_event.is_set() or p.handle.can_emit():
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
            if p is not None:
                self._step(p)
            else:
                time.sleep(stall)  # a real stall: nothing on this thread runs meanwhile

    def _step(self, p: _Prepared) -> None:
        gen = p.generation
        assert gen is not None
        try:
            events = gen.step()
        except NonFiniteLogits as exc:  # the model's fault, not a bug: one line, and counted
            log.error("request %s failed: %s", p.handle.id, exc)
            with self._cv:
                self._totals["nonfinite"] += 1
            events = [gen.fail(str(exc))]
        except Exception as exc:  # one failed request must not take the engine down
            log.exception("request %s failed", p.handle.id)
            events = [gen.fail(str(exc))]
        if gen.done:  # before the final event: a client that continues the session at once
            self._retire(p, events[-1])  # must find it idle, not "already running"
        for e in events:
            p.handle.emit(e)

    def _retire(self, p: _Prepared, last: TokenEvent) -> None:
        stats = last.stats
        with self._cv:
            self._sched.finish(p)
            session = p.session
            start = session.kv_len if session is not None else 0
            if last.finish_reason in ("stop", "length"):
                try:
                    self._remember_prefix(p, start)
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
                self._store.give_kv(p.kv)
            self._totals["total"] += 1
            if last.finish_reason == "error":
                self._totals["failed"] += 1
            if last.finish_reason == "cancelled":
                self._totals["cancelled"] += 1
            if stats is not None:
                self._totals["tokens"] += stats.generated_tokens
                if stats.generated_tokens:
                    self._ttft.append(stats.ttft_ms)
                if stats.decode_tok_s:
                    self._decode.append(stats.decode_tok_s)
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


def estimate_memory(
    profile: DeviceProfile, model_dir: Path, quantization: str | None = None
) -> int:
    """Bytes an engine for this model would plan for one session, without loading it: the KV
    windows its load would add included (`litert.expected_plan`). The reading of the file is
    kept where its load will look for it."""
    from agent.runtime.layout import discover_layout
    from agent.runtime.modelfile import read_model_file

    cache = unpack_cache_dir(profile.runtime.xnnpack_weight_cache_dir, None)
    meta = open_model(model_dir, cache)
    quant = quantization or choose_quantization(profile, [v.quantization for v in meta.variants])
    variant = meta.variant(quant)
    model = read_model_file(meta.path_of(variant), litert.parse_cache(profile, variant.sha256))
    layout = discover_layout(model, meta.context_length)
    return litert.expected_plan(model, layout, profile).total


def _empty_stats(p: _Prepared) -> RequestStats:
    return RequestStats(len(p.ids), 0, 0.0, 0.0, 0.0, 0.0, 0.0, "")
