"""Several named models in one byte budget: each loaded on its first request, unloaded after an
idle `keep_alive`, and evicted least recently used first when the next load would pass the
profile's `runtime.max_num_bytes`; a pinned model is never evicted.

The default model (the first) keeps the daemon's `Serving`, which reloads and updates switch;
every other model has a `Serving` of its own that only this module fills and empties. A model's
bytes are what its engine planned (`Engine.memory.total`); a model not loaded yet is estimated
the way the loader checks it (`agent.engine.loading.estimate_memory`) plus the host KV tier and
prefix cache every engine keeps. An engine is built on the budget the other loaded models leave
(`build_engine`'s `budget`), so the models together never plan past it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agent.base.errors import BudgetBusy, ModelTooLarge, NotFound
from agent.config.file import AgentConfig
from agent.daemon.plan import Plan, open_plan_model, with_variant
from agent.daemon.serving import Serving
from agent.engine.engine import Engine
from agent.engine.loading import estimate_memory
from agent.engine.stats import EngineStats, ModelInfo, Percentiles
from agent.runtime.memory import give_back_memory
from agent.status.value import AgentStatus, ModelState

log = logging.getLogger("agent.daemon")  # the daemon's lines keep one logger name

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model the daemon may serve, known before it loads (from its metadata)."""

    name: str
    plan: Plan
    keep_alive_s: float  # math.inf: never unloaded for idleness
    pinned: bool
    version: str
    context_length: int


class Slot:
    """A model's place in the registry: its engine (through its `Serving`) and its figures."""

    def __init__(self, spec: ModelSpec, serving: Serving, default: bool) -> None:
        self.spec = spec
        self.serving = serving
        self.default = default
        self.keep_alive_s = spec.keep_alive_s
        self.last_used = time.monotonic()
        self.need: int | None = None  # the estimate, once made
        self.loads = self.unloads = self.evictions = 0
        self.last_load_s = 0.0
        self.last_info: ModelInfo | None = None  # its engine's, kept when it unloads
        self.closing: Engine | None = None  # unloading: no request reaches it, its bytes held

    @property
    def engine(self) -> Engine | None:
        return self.serving.engine

    @property
    def info(self) -> ModelInfo | None:
        """The loaded engine's model info, else the last one it had (None: never loaded)."""
        e = self.serving.engine
        return e.info if e is not None else self.last_info

    def busy(self) -> int:
        e = self.engine
        if e is None:
            return 0
        s = e.stats()
        return s.active + s.queue_depth


Load = Callable[[Plan, int], Awaitable[Engine]]


def held(slot: Slot) -> int:
    """What a slot's engine holds of the budget: loaded, or unloading until it has closed."""
    e = slot.engine or slot.closing
    return e.memory.total if e is not None else 0


class Models:
    """The registry; every method runs on the event loop (loads and unloads in executors)."""

    def __init__(
        self,
        specs: tuple[ModelSpec, ...],
        default: Serving,
        load: Load,
        drain_timeout: Callable[[], float],
        drained: Callable[[Engine], None],
        probing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._load = load
        self._drain_timeout = drain_timeout
        self._drained = drained  # the default model's engine unloaded: its last counts
        self._probing = probing  # the default model's engine is in use outside requests
        self._lock = asyncio.Lock()  # one load or eviction at a time
        self.slots = [Slot(specs[0], default, True), *(self._slot(s) for s in specs[1:])]
        self._by_name = {s.spec.name: s for s in self.slots}

    def _slot(self, spec: ModelSpec) -> Slot:
        """A model other than the default: a `Serving` that only this registry fills."""
        slot = Slot(spec, Serving(self._never, self._drain_timeout), False)
        slot.serving.state = "serving"
        return slot

    @staticmethod
    async def _never(plan: Plan) -> Engine:
        raise AssertionError("only the default model is switched")

    @property
    def default(self) -> Slot:
        return self.slots[0]

    def names(self) -> list[str]:
        return [s.spec.name for s in self.slots]

    def resolve(self, name: str) -> Slot:
        """The slot a request's model name means: "" the default; with one model any name
        (as before there were several); else the name, or NotFound naming what there is."""
        if not name or len(self.slots) == 1:
            return self.default
        slot = self._by_name.get(name)
        if slot is None:
            loaded = [s.spec.name for s in self.slots if s.engine is not None]
            raise NotFound(
                f"model {name!r} is not served here; models: {', '.join(self.names())} "
                f"(loaded: {', '.join(loaded) or 'none'})"
            )
        return slot

    def current(self, name: str) -> Engine | None:
        return self.resolve(name).engine

    def loaded_bytes(self, but: Slot | None = None) -> int:
        """Bytes the loaded engines hold (an unloading one's until it has closed)."""
        return sum(held(s) for s in self.slots if s is not but)

    def budget(self) -> int:
        return self.default.spec.plan.profile.runtime.max_num_bytes

    async def acquire(self, name: str, keep_alive_s: float | None = None) -> Engine:
        """The engine of model `name`, loaded now if it is not; `keep_alive_s` (a request's
        own, as Ollama's) replaces the configured one until the next request says otherwise."""
        slot = self.resolve(name)
        slot.keep_alive_s = slot.spec.keep_alive_s if keep_alive_s is None else keep_alive_s
        slot.last_used = time.monotonic()
        e = slot.engine
        if e is not None:
            return e
        async with self._lock:
            e = slot.engine
            if e is None:
                e = await self._load_slot(slot)
            slot.last_used = time.monotonic()
            return e

    async def _load_slot(self, slot: Slot) -> Engine:
        plan = slot.serving.plan or slot.spec.plan
        loop = asyncio.get_running_loop()
        if slot.need is None:
            profile = plan.profile
            one = await loop.run_in_executor(
                None, estimate_memory, profile, plan.model_dir, plan.quantization
            )
            slot.need = one + profile.kv.host_max_bytes + profile.kv.prefix_max_bytes
        budget = self.budget()
        if slot.need > budget:
            raise ModelTooLarge(
                f"model {slot.spec.name!r} needs {slot.need / MIB:.1f} MiB, more than the "
                f"whole budget (runtime.max_num_bytes = {budget / MIB:.1f} MiB)"
            )
        while self.loaded_bytes(but=slot) + slot.need > budget:
            await self._evict_for(slot, budget)  # or refuse, before anything is evicted
        t0 = time.monotonic()
        engine = await self._load(plan, budget - self.loaded_bytes(but=slot))
        slot.serving.engine, slot.serving.plan = engine, plan
        slot.loads += 1
        slot.last_load_s = time.monotonic() - t0
        log.info(
            "model %s loaded in %.2f s: %.1f MiB of the budget's %.1f MiB (%.1f MiB in use)",
            slot.spec.name,
            slot.last_load_s,
            engine.memory.total / MIB,
            budget / MIB,
            self.loaded_bytes() / MIB,
        )
        return engine

    async def _evict_for(self, slot: Slot, budget: int) -> None:
        """Unload the least recently used idle, unpinned model, or refuse the load clearly:
        for good when the pinned models leave too little, for now when the rest are busy."""
        assert slot.need is not None
        others = [s for s in self.slots if s is not slot and s.engine is not None]
        pinned = sum(held(s) for s in others if s.spec.pinned)
        idle = [s for s in others if not s.spec.pinned and not self._in_use(s)]
        if idle and pinned + slot.need <= budget:
            victim = min(idle, key=lambda s: s.last_used)
            victim.evictions += 1
            await self.unload(victim, f"evicted for {slot.spec.name}")
            return
        what = ", ".join(
            f"{s.spec.name} {(s.engine.memory.total if s.engine else 0) / MIB:.1f} MiB"
            + (" pinned" if s.spec.pinned else " busy")
            for s in others
        )
        text = (
            f"model {slot.spec.name!r} needs {slot.need / MIB:.1f} MiB; the budget "
            f"(runtime.max_num_bytes = {budget / MIB:.1f} MiB) is held by {what}"
        )
        if pinned + slot.need > budget:  # the pinned ones alone leave too little: for good
            raise ModelTooLarge(text)
        raise BudgetBusy(text + "; try again when they are idle")

    def _in_use(self, slot: Slot) -> bool:
        return slot.busy() > 0 or (slot.default and self._probing())

    async def unload(self, slot: Slot, why: str) -> None:
        engine = slot.serving.engine
        if engine is None:
            return
        slot.serving.engine, slot.last_info = None, engine.info
        slot.closing = engine
        freed = engine.memory.total
        timeout = self._drain_timeout()

        def stop() -> None:
            engine.stop(timeout)
            if slot.default:
                self._drained(engine)
            engine.close()
            give_back_memory()

        try:
            await asyncio.get_running_loop().run_in_executor(None, stop)
        finally:
            slot.closing = None
        slot.unloads += 1
        log.info("model %s unloaded (%s): %.1f MiB freed", slot.spec.name, why, freed / MIB)

    async def tick(self) -> None:
        """Unload every model idle for longer than its keep-alive."""
        now = time.monotonic()
        for slot in self.slots:
            if slot.engine is None or (slot.default and slot.serving.state != "serving"):
                continue
            if self._in_use(slot):
                slot.last_used = now
            elif now - slot.last_used >= slot.keep_alive_s and not self._lock.locked():
                async with self._lock:
                    if slot.engine is not None and not self._in_use(slot):
                        why = (
                            f"idle {now - slot.last_used:.1f} s, keep_alive {slot.keep_alive_s:g} s"
                        )
                        await self.unload(slot, why)

    async def update(self, specs: tuple[ModelSpec, ...]) -> None:
        """A reload's models: one whose plan is unchanged keeps its engine (its keep_alive and
        pinning as now configured); one removed or changed unloads (its running requests may
        finish within `limits.reload_drain_s`), and a new or changed one loads on use. The
        default model's engine is switched by its `Serving` (the reload's)."""
        async with self._lock:
            old = {s.spec.name: s for s in self.slots[1:]}
            self.default.spec = specs[0]
            slots = [self.default]
            for spec in specs[1:]:
                slot = old.pop(spec.name, None)
                if slot is not None and slot.spec.plan != spec.plan:
                    await self.unload(slot, "its model changed (reload)")
                    slot = None
                if slot is None:
                    slot = self._slot(spec)
                slot.spec = spec
                slot.keep_alive_s = spec.keep_alive_s
                slots.append(slot)
            for slot in old.values():
                await self.unload(slot, "no longer configured (reload)")
            self.slots = slots
            self._by_name = {s.spec.name: s for s in slots}

    async def stop_others(self, timeout: float) -> None:
        """At shutdown: every model but the default drains within `timeout` and unloads."""
        loop = asyncio.get_running_loop()

        def stop(e: Engine) -> None:
            e.stop(timeout, refuse_waiting=True)
            e.close()

        for slot in self.slots[1:]:
            e, slot.serving.engine = slot.engine, None
            if e is not None:
                await loop.run_in_executor(None, stop, e)

    def states(self) -> tuple[ModelState, ...]:
        out = []
        for s in self.slots:
            e, plan = s.engine or s.closing, s.serving.plan or s.spec.plan
            st = s.engine.stats() if s.engine is not None else None
            out.append(
                ModelState(
                    name=s.spec.name,
                    version=e.info.version if e is not None else s.spec.version,
                    quantization=(e.info.quantization if e is not None else plan.quantization)
                    or "",
                    context_length=e.info.context_length
                    if e is not None
                    else s.spec.context_length,
                    default=s.default,
                    loaded=e is not None,
                    pinned=s.spec.pinned,
                    keep_alive_s=s.keep_alive_s,
                    planned_bytes=e.memory.total if e is not None else 0,
                    estimate_bytes=s.need or 0,
                    loads=s.loads,
                    unloads=s.unloads,
                    evictions=s.evictions,
                    last_load_s=s.last_load_s,
                    active=0 if st is None else st.active + st.queue_depth,
                    requests_total=0 if st is None else st.requests_total,
                )
            )
        return tuple(out)


def model_specs(config: AgentConfig, default: Plan) -> tuple[ModelSpec, ...]:
    """The models to serve, the default first: its plan as given (an installed update may have
    replaced its model), the others' from `[models]`. One model without `[models]` is named
    by its metadata, as before; with `[models]` each by its table's (or `--model`'s) name."""
    entries = config.models.entries
    meta = open_plan_model(default, default.model_dir)
    if not entries:
        return (ModelSpec(meta.name, default, math.inf, False, meta.version, meta.context_length),)
    specs = []
    for i, e in enumerate(entries):
        plan = default
        if i > 0:  # its saved sessions apart: a disk tier drops files of another model
            plan = with_variant(
                dataclasses.replace(
                    default,
                    model_dir=e.path,
                    quantization=e.quantization,
                    state_dir=default.state_dir / "models" / e.name,
                )
            )
            meta = open_plan_model(plan, plan.model_dir)
        keep = e.keep_alive_s
        if keep is None:  # the default model stays loaded unless told otherwise, as before
            keep = math.inf if i == 0 else config.models.keep_alive_s
        specs.append(ModelSpec(e.name, plan, keep, e.pinned, meta.version, meta.context_length))
    return tuple(specs)


def unloaded_status(base: dict[str, Any], models: Models) -> AgentStatus:
    """The status while the default model is unloaded: the agent's own figures and every
    model's state; the engine's counters are zero (no engine runs)."""
    d = models.default
    zero = Percentiles(0.0, 0.0)
    stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, zero, zero, 0.0)
    return AgentStatus(
        **base,
        planned_bytes=models.loaded_bytes(),
        model=f"{d.spec.name} {d.spec.version} (unloaded)",
        active_sessions=0,
        engine=stats,
        models=models.states(),
    )
