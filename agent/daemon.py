"""The daemon: composition root and lifecycle (startup → main loop with a tick → shutdown).

Signal handlers only set flags and wake the main loop. The tick sends the systemd watchdog
ping — only while the engine thread answers its heartbeat, so a wedged engine gets the
service restarted — and a STATUS line when it changed. SIGHUP re-reads the configuration and
the profile and, when the model changed, loads the new engine beside the old one, switches
new requests to it and drains the old one: the socket stays bound and no request is dropped.
SIGTERM stops accepting, drains in-flight requests within the configured timeout, and exits.

Start-up refuses, before it loads anything, what would harm the host or another daemon: the
state directory is locked for the daemon's life (`agent.statelock`), and a socket path that is
not a socket, is live, or has no parent is refused (`agent.rpc.unixsocket`); each is one line
and exit 2, with nothing on the host changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent import __version__
from agent.config import AgentConfig, load_config, parse_broker
from agent.engine.engine import Engine, EngineLimits, ModelInfo, estimate_memory
from agent.errors import AgentError, ConfigError, Unavailable
from agent.fleet.agent import FleetAgent, resolve_device_id
from agent.fleet.topics import check_device_id
from agent.modeldir import ModelMeta, demo_model_dir, open_model, unpack_cache_dir
from agent.ota import canary
from agent.ota.manifest import InstallContext
from agent.ota.store import ModelRef, Store
from agent.ota.updater import Updater
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from agent.profile import DeviceProfile, choose_quantization, resolve_profile
from agent.rpc import unixsocket
from agent.rpc.server import Server
from agent.runtime.litert import prune_weight_cache
from agent.statelock import StateLock
from agent.status import AgentStatus, rss_bytes
from agent.systemd import Notifier

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path("/var/lib/edge-agent")  # systemd's StateDirectory=edge-agent
FAULT_ENV = "EDGE_AGENT_FAULT_INJECTION"  # "1": SIGUSR2 stalls the engine thread (tests only)


@dataclass(frozen=True, slots=True)
class Overrides:
    """Command-line values that win over the config file and the profile."""

    config_path: Path | None = None
    profile: str | None = None
    model: Path | None = None
    quantization: str | None = None
    socket: Path | None = None
    tcp: str | None = None
    state_dir: Path | None = None
    broker: str | None = None  # mqtt://HOST:PORT | mqtts://HOST:PORT
    device_id: str | None = None


def _apply(config: AgentConfig, o: Overrides) -> AgentConfig:
    server = config.server
    if o.socket is not None:
        server = dataclasses.replace(server, socket=o.socket)
    if o.tcp is not None:
        from agent.config import check_tcp

        check_tcp("--tcp", "tcp", o.tcp, server.allow_remote_tcp)
        server = dataclasses.replace(server, tcp=o.tcp)
    model = config.model
    if o.model is not None:
        model = dataclasses.replace(model, path=o.model)
    if o.quantization is not None:
        model = dataclasses.replace(model, quantization=o.quantization)
    fleet = config.fleet
    if o.broker is not None:
        fleet = dataclasses.replace(fleet, broker=parse_broker("--broker", "broker", o.broker))
    if o.device_id is not None:
        try:
            check_device_id(o.device_id)
        except ValueError as exc:
            raise ConfigError("--device-id", "device_id", o.device_id, str(exc)) from exc
        fleet = dataclasses.replace(fleet, device_id=o.device_id)
    return dataclasses.replace(config, server=server, model=model, fleet=fleet)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything that decides which engine to run; a reload rebuilds when this changes."""

    profile: DeviceProfile
    model_dir: Path
    quantization: str | None
    limits: EngineLimits
    state_dir: Path


def _state_dir(overrides: Overrides) -> Path:
    return overrides.state_dir or DEFAULT_STATE_DIR


def _plan(config: AgentConfig, overrides: Overrides) -> _Plan:
    """The plan for the configured model, its variant chosen here once (the engine is then
    told which: the profile's choice is made, and logged, one time per start or reload)."""
    profile, reasons = resolve_profile(overrides.profile)
    for r in reasons:
        log.info("profile %s: %s", profile.name, r)
    model_dir = config.model.path or profile.model.path or demo_model_dir()
    lim = config.limits
    state_dir = _state_dir(overrides)
    plan = _Plan(
        _with_weight_cache(profile, state_dir),
        model_dir,
        config.model.quantization,
        EngineLimits(lim.max_active, lim.queue_capacity, lim.max_pending_events, lim.max_sessions),
        state_dir,
    )
    if plan.quantization is None:
        meta = _open(plan, model_dir)
        quant = choose_quantization(plan.profile, [v.quantization for v in meta.variants])
        plan = dataclasses.replace(plan, quantization=quant)
    return plan


def _with_weight_cache(profile: DeviceProfile, state_dir: Path) -> DeviceProfile:
    """A profile that names no `xnnpack_weight_cache_dir` (the generic development profile)
    still gets one in the daemon: `xnnpack` in systemd's CacheDirectory (``$CACHE_DIRECTORY``)
    or else in the state directory. Without it every start packs the weights again and the
    model runs without its composites inlined or KV windows added (docs/PROFILES.md)."""
    if profile.runtime.xnnpack_weight_cache_dir is not None:
        return profile
    cache = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    directory = (Path(cache) if cache else state_dir / "cache") / "xnnpack"
    log.info("profile %s names no xnnpack_weight_cache_dir: using %s", profile.name, directory)
    runtime = dataclasses.replace(profile.runtime, xnnpack_weight_cache_dir=directory)
    return dataclasses.replace(profile, runtime=runtime)


def _build(plan: _Plan) -> Engine:
    return Engine(
        plan.profile,
        plan.model_dir,
        quantization=plan.quantization,
        limits=plan.limits,
        state_dir=plan.state_dir,
    )


def _open(plan: _Plan, model: Path) -> ModelMeta:
    """A model directory or a `.litertlm` bundle, extracted where its engine will look."""
    return open_model(
        model, unpack_cache_dir(plan.profile.runtime.xnnpack_weight_cache_dir, plan.state_dir)
    )


def shipped_ref(plan: _Plan) -> ModelRef:
    """The model that serves when no update was ever installed (version 0)."""
    meta = _open(plan, plan.model_dir)
    quant = plan.quantization or choose_quantization(
        plan.profile, [v.quantization for v in meta.variants]
    )
    variant = meta.variant(quant)
    return ModelRef(str(plan.model_dir), quant, variant.sha256, 0, meta.version)


class Daemon:
    def __init__(self, overrides: Overrides, notifier: Notifier | None = None) -> None:
        self.overrides = overrides
        self.config = _apply(load_config(overrides.config_path), overrides)
        self.notifier = notifier or Notifier.from_env()
        self._engine: Engine | None = None
        self._plan: _Plan | None = None
        self._state = "starting"
        self._started = time.monotonic()
        self._stop = False
        self._reload = False
        self._wake: asyncio.Event | None = None
        self._last_status = ""
        self._draining: list[threading.Thread] = []
        self._fleet: FleetAgent | None = None
        self._updater: Updater | None = None
        self._server: Server | None = None
        self._reload_waiters: list[asyncio.Future[fpb.ReloadDone]] = []

    # ------------------------------------------------------------------ Backend protocol

    def engine(self) -> Engine:
        if self._engine is None or self._state in ("starting", "stopping"):
            raise Unavailable(f"the agent is {self._state}")
        return self._engine

    def model_info(self) -> ModelInfo:
        if self._engine is None:
            raise Unavailable(f"the agent is {self._state}")
        return self._engine.info

    def reload(self) -> asyncio.Future[fpb.ReloadDone]:
        """Ask for a reload (as SIGHUP does); the future resolves when it has finished."""
        future: asyncio.Future[fpb.ReloadDone] = asyncio.get_running_loop().create_future()
        self._reload_waiters.append(future)
        self._request_reload()
        return future

    # ------------------------------------------------------------------ updates (UpdateHost)

    def install_context(self, installed: ModelRef) -> InstallContext:
        assert self._plan is not None and self._updater is not None
        inst = self._updater.installed()
        return InstallContext(
            model_name=_open(self._plan, Path(installed.model_dir)).name,
            installed_version=installed.version,
            installed_sha256=installed.sha256,
            profile=self._plan.profile.name,
            arch=platform.machine(),
            agent_version=__version__,
            finished_update_ids=frozenset(inst.finished),
            max_payload_bytes=self.config.updates.max_payload_bytes,
        )

    async def activate(self, ref: ModelRef, canary_spec: opb.Canary | None) -> None:
        assert self._plan is not None
        plan = dataclasses.replace(
            self._plan, model_dir=Path(ref.model_dir), quantization=ref.quantization
        )
        self._state = "reloading"
        try:
            await self._switch_to(plan, lambda e: canary.check(e, canary_spec))
        finally:
            self._state = "serving"
        log.info("update: now serving %s (%s)", ref.model_dir, ref.label or ref.version)

    async def check_serving(self, canary_spec: opb.Canary | None) -> str | None:
        e = self._engine
        if e is None:
            return "no engine is serving"
        age = e.heartbeat_age()
        if age >= self.config.watchdog.engine_stall_s:
            return f"the engine thread has not answered for {age:.1f} s"
        if canary_spec is None or not canary_spec.expected_tokens:
            return None
        want = list(canary_spec.expected_tokens)
        got = await asyncio.get_running_loop().run_in_executor(
            None, canary.expected_tokens, e, canary_spec.prompt, len(want)
        )
        return None if got == want else f"greedy tokens {got} != expected {want}"

    def report(self, status: fpb.UpdateStatus, key: str = "") -> None:
        if self._fleet is not None:
            self._fleet.report_update(status, key)

    def remove_unused_caches(self) -> None:
        directory = self._plan.profile.runtime.xnnpack_weight_cache_dir if self._plan else None
        if directory is None or self._state == "reloading":  # a load's files are not held yet;
            return  # that load prunes the directory itself
        try:
            prune_weight_cache(directory)
        except OSError as exc:  # the next load prunes them
            log.warning("weight cache not pruned (%s)", exc)

    async def offer_update(self, signed: bytes) -> fpb.UpdateStatus:
        assert self._updater is not None
        return await self._updater.offer(signed)

    async def cancel_update(self, signed: bytes) -> fpb.UpdateStatus:
        assert self._updater is not None
        return await self._updater.cancel(signed)

    def _with_update(self, plan: _Plan) -> _Plan:
        """The model an installed update made current wins over config and profile."""
        if self._updater is None or self._updater.store.installed() is None:
            return plan
        ref = self._updater.serving_ref()
        return dataclasses.replace(
            plan, model_dir=Path(ref.model_dir), quantization=ref.quantization
        )

    def status(self) -> AgentStatus:
        e = self._engine
        if e is None or self._plan is None:
            raise Unavailable(f"the agent is {self._state}")
        return AgentStatus(
            profile=self._plan.profile.name,
            version=__version__,
            state=self._state,
            uptime_s=time.monotonic() - self._started,
            rss_bytes=rss_bytes(),
            budget_bytes=e.memory.budget,
            planned_bytes=e.memory.total,
            model=f"{e.info.name} {e.info.version} {e.info.quantization}",
            active_sessions=e.session_count(),
            engine=e.stats(),
            kv=e.tier_stats(),
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        self._wake = asyncio.Event()
        self._install_signals(asyncio.get_running_loop())
        t0 = time.monotonic()
        unixsocket.check(self.config.server.socket)  # refused before anything changes
        lock = StateLock.acquire(_state_dir(self.overrides))  # before anything writes there
        try:
            return await self._serve(t0)
        finally:
            lock.release()

    async def _serve(self, t0: float) -> int:
        base = _plan(self.config, self.overrides)
        self._updater = Updater(Store(base.state_dir), self.config.updates, shipped_ref(base))
        self._updater.boot()
        self._plan = self._with_update(base)
        self.notifier.status(f"loading {self._plan.model_dir.name} on {self._plan.profile.name}")
        self._engine = await self._load(self._plan)
        try:
            server = self._server = Server(self, self.config.server, self.config.limits.max_tokens)
            await server.start()  # checks the socket path again, as it binds
        except BaseException:
            self._engine.stop(0)
            self._engine.close()
            raise
        self._state = "serving"
        await server.set_serving(True)
        info = self._engine.info
        log.info(
            "ready in %.2f s: %s %s (%s) on %s via %s, profile %s; listening on %s",
            time.monotonic() - t0,
            info.name,
            info.version,
            info.quantization,
            info.accelerator,
            info.execution_path,
            self._plan.profile.name,
            ", ".join(server.addresses),
        )
        self._start_fleet()
        self._updater.blocks = self._fleet.link if self._fleet is not None else None
        self._updater.attach(self)
        await self._updater.resume()
        self.notifier.ready(self._status_line())
        try:
            await self._main_loop(server)
        finally:
            await self._shutdown(server)
        return 0

    def _start_fleet(self) -> None:
        """The MQTT fleet link, when a broker is configured; it never blocks the daemon."""
        fleet = self.config.fleet
        if fleet.broker is None:
            log.info("fleet: no broker configured; the fleet link is off")
            return
        assert self._plan is not None
        device = resolve_device_id(fleet)
        loop = asyncio.get_running_loop()
        self._fleet = FleetAgent(fleet, device, self._plan.state_dir, self, loop)
        self._fleet.start()

    async def _load(self, plan: _Plan) -> Engine:
        """Build an engine off the event loop. Meanwhile, every tick asks systemd for more time
        (EXTEND_TIMEOUT_USEC: a large model on a slow board must not hit TimeoutStartSec) and,
        during a reload, keeps the watchdog fed for the engine that is still serving."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, _build, plan)
        tick = self.config.watchdog.tick_s
        while True:
            self.notifier.extend_timeout(int(3 * tick * 1e6))
            done, _ = await asyncio.wait({future}, timeout=tick)
            if done:
                return future.result()
            self._tick()

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGTERM, self._request_stop)
        loop.add_signal_handler(signal.SIGINT, self._request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        if os.environ.get(FAULT_ENV) == "1":
            loop.add_signal_handler(signal.SIGUSR2, self._inject_stall)

    def _request_stop(self) -> None:
        self._stop = True
        if self._wake is not None:
            self._wake.set()

    def _request_reload(self) -> None:
        self._reload = True
        if self._wake is not None:
            self._wake.set()

    def _inject_stall(self) -> None:
        if self._engine is not None:
            log.warning("fault injection: stalling the engine thread")
            self._engine.inject_stall(3600.0)

    async def _main_loop(self, server: Server) -> None:
        assert self._wake is not None
        tick = self.config.watchdog.tick_s
        while not self._stop:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=tick)
            self._wake.clear()
            if self._reload and not self._stop:
                self._reload = False
                waiters, self._reload_waiters = self._reload_waiters, []
                done = await self._do_reload(server)
                for w in waiters:
                    if not w.done():
                        w.set_result(done)
                if self._fleet is not None:
                    self._fleet.reload_done(done)  # on disk before READY says it is over
                self.notifier.ready(self._status_line())
            self._tick()

    def _tick(self) -> None:
        e = self._engine
        if e is None:
            return
        age = e.heartbeat_age()
        if age < self.config.watchdog.engine_stall_s:
            self.notifier.watchdog()
        else:
            # no WATCHDOG=1: systemd restarts us after WatchdogSec
            log.error("engine thread has not answered for %.1f s; withholding the watchdog", age)
        line = self._status_line()
        if line != self._last_status:
            self._last_status = line
            self.notifier.status(line)
        if self._fleet is not None:
            self._fleet.tick()

    def _status_line(self) -> str:
        e = self._engine
        if e is None:
            return self._state
        s = e.stats()
        # a TCP port may be ephemeral (--tcp 127.0.0.1:0): the one bound is said here
        tcp = [a for a in (self._server.addresses if self._server else []) if a[:5] != "unix:"]
        return (
            f"{self._state}: {e.info.name} {e.info.quantization} on {e.info.accelerator}; "
            f"{s.active} active, {s.queue_depth} queued, {s.requests_total} done"
            + (f"; tcp {', '.join(tcp)}" if tcp else "")
        )

    async def _do_reload(self, server: Server) -> fpb.ReloadDone:
        self.notifier.reloading("reloading configuration and profile")
        log.info("reload requested (SIGHUP)")
        done = fpb.ReloadDone(ok=True)
        try:
            config = _apply(load_config(self.overrides.config_path), self.overrides)
            plan = self._with_update(_plan(config, self.overrides))
            if config.fleet != self.config.fleet:
                log.warning("reload: [fleet] changes take effect at the next restart")
            self.config = config
            if plan != self._plan:
                self._state = "reloading"
                new = await self._switch_to(plan)
                log.info("reloaded: now serving %s %s", new.info.name, new.info.quantization)
                done.message = "reloaded"
            else:
                log.info("reload: model and profile unchanged")
                done.message = "model and profile unchanged"
        except Exception as exc:  # a bad new config keeps the old one serving
            log.error("reload failed, keeping the previous model: %s", exc)
            done.ok, done.message = False, f"reload failed, the previous model serves: {exc}"
        self._state = "serving"
        if self._engine is not None:
            i = self._engine.info
            done.model = f"{i.name} {i.version} {i.quantization}"
        return done

    async def _switch_to(
        self, plan: _Plan, check: Callable[[Engine], str | None] | None = None
    ) -> Engine:
        """Load `plan`'s engine (beside the serving one when the budget holds both, else after
        draining it), run `check` on it before it serves, and switch new requests to it; the
        old engine finishes its in-flight requests in the background. On any failure the
        previous engine serves (again) and the error propagates."""
        assert self._server is not None
        server = self._server
        drained = not self._fits_beside(plan)
        if drained:
            await self._drain_current(server)
        elif self._engine is not None:
            self._engine.hand_over_sessions()
        try:
            new = await self._load(plan)
            problem = None
            if check is not None:
                problem = await asyncio.get_running_loop().run_in_executor(None, check, new)
            if problem is not None:
                new.stop(0)
                new.close()
                raise AgentError(f"the new model failed its canary: {problem}")
        except Exception:
            if drained and self._plan is not None:  # the old one was unloaded for the new one
                self._engine = await self._load(self._plan)
                await server.set_serving(True)
            raise
        await server.set_serving(False)
        old, self._engine, self._plan = self._engine, new, plan
        await server.set_serving(True)
        if old is not None:
            self._drain_in_background(old)
        return new

    def _fits_beside(self, plan: _Plan) -> bool:
        """Whether the new model can load while the current one still serves."""
        if self._engine is None:
            return True
        need = estimate_memory(plan.profile, plan.model_dir, plan.quantization)
        total = self._engine.memory.total + need
        if total <= plan.profile.runtime.max_num_bytes:
            return True
        log.info(
            "reload: old and new model need %d MiB together, budget %d MiB: draining first",
            total >> 20,
            plan.profile.runtime.max_num_bytes >> 20,
        )
        return False

    async def _drain_current(self, server: Server) -> None:
        """Stop serving (UNAVAILABLE), finish in-flight requests, unload the current model."""
        loop = asyncio.get_running_loop()
        await server.set_serving(False)
        old, self._engine = self._engine, None
        if old is not None:
            await loop.run_in_executor(None, old.stop, self.config.limits.drain_timeout_s)
            old.close()

    def _drain_in_background(self, old: Engine) -> None:
        timeout = self.config.limits.drain_timeout_s

        def drain() -> None:
            drained = old.stop(timeout)
            old.close()
            log.info("previous engine %s", "drained" if drained else "stopped after timeout")

        t = threading.Thread(target=drain, name="edge-agent-drain", daemon=True)
        t.start()
        self._draining.append(t)

    async def _shutdown(self, server: Server) -> None:
        loop = asyncio.get_running_loop()
        self._state = "stopping"
        if self._updater is not None:
            self._updater.stop()
        timeout = self.config.limits.drain_timeout_s
        self.notifier.stopping(f"stopping: draining in-flight requests (up to {timeout:.0f} s)")
        await server.set_serving(False)
        if self._engine is not None:
            engine = self._engine
            drained = await loop.run_in_executor(None, engine.stop, timeout)
            log.info(
                "shutdown: %s", "drained" if drained else "drain timed out, cancelled the rest"
            )
        await server.stop(grace=1.0)
        for t in self._draining:
            t.join(timeout)
        if self._fleet is not None:
            self._fleet.stop()  # after the drain: "offline" means no request is running
        if self._engine is not None:
            self._engine.close()
        log.info("stopped")


def run_daemon(overrides: Overrides) -> int:
    """Entry point of `edge-agent run`."""
    return asyncio.run(Daemon(overrides).run())
