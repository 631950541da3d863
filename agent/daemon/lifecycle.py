"""The daemon: composition root and lifecycle (startup → main loop with a tick → shutdown).

Signal handlers only set flags and wake the main loop (`agent.daemon.signals`). The tick sends
the systemd watchdog ping — only while the engine thread answers its heartbeat, so a wedged
engine gets the service restarted — and a STATUS line when it changed. SIGHUP re-reads the
configuration and the profile and, when the model changed, loads the new engine beside the old
one, switches new requests to it and drains the old one (`agent.daemon.serving`): the socket
stays bound and no request is dropped. SIGTERM stops accepting, drains in-flight requests
within the configured timeout, and exits.

Start-up refuses, before it loads anything, what would harm the host or another daemon: the
state directory is locked for the daemon's life (`agent.base.statelock`), and a socket path that is
not a socket, is live, or has no parent is refused (`agent.api.unixsocket`); each is one line
and exit 2, with nothing on the host changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.api import ports, unixsocket
from agent.api.grpc.server import Server
from agent.base.errors import Unavailable
from agent.base.statelock import StateLock
from agent.config.file import http_socket, load_config
from agent.daemon.models import Models, model_specs, unloaded_status
from agent.daemon.plan import (
    Overrides,
    Plan,
    apply_overrides,
    build_engine,
    load_plan,
    shipped_ref,
    state_dir,
    with_update,
)
from agent.daemon.probe import Prober
from agent.daemon.serving import Serving
from agent.daemon.signals import Requests
from agent.daemon.updates import DaemonUpdateHost, start_admin
from agent.engine.engine import Engine
from agent.engine.stats import ModelInfo
from agent.fleet.device.agent import FleetAgent, resolve_device_id
from agent.fleet.device.health import no_probes
from agent.ota.store import Store
from agent.ota.updater import Updater
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from agent.status.metrics import Metrics
from agent.status.runs import RunBook
from agent.status.value import AgentStatus, ModelState, rss_bytes
from agent.systemd.notify import Notifier

if TYPE_CHECKING:
    from agent.api.grpc.admin import AdminServer
    from agent.api.http.server import HttpServer

log = logging.getLogger("agent.daemon")  # the name its lines have always had ("ready in")

STREAM_END_GRACE_S = 2.0  # at stop: what a gRPC stream has to write its last message


class Daemon:
    def __init__(self, overrides: Overrides, notifier: Notifier | None = None) -> None:
        self.overrides = overrides
        self.config = apply_overrides(load_config(overrides.config_path), overrides)
        self.notifier = notifier or Notifier.from_env()
        self._serving = Serving(
            self._load, lambda: self.config.limits.reload_drain_s, self._engine_drained
        )
        self._requests = Requests()
        self._started = time.monotonic()
        self._last_status = ""
        self._fleet: FleetAgent | None = None
        self._updater: Updater | None = None
        self._http: HttpServer | None = None  # the OpenAI-compatible API, beside gRPC
        self._admin: AdminServer | None = None  # local installs (agent.api.grpc.admin)
        self._prober: Prober | None = None  # the quality probe (agent.daemon.probe)
        self._runs: RunBook | None = None  # how each model runs here (agent.status.runs)
        self._models: Models | None = None  # the named models (agent.daemon.models)
        self.metrics = Metrics(self._scrape)  # one for the daemon's life: rpc and http report

    # ------------------------------------------------------------------ Backend protocol

    def engine(self) -> Engine:
        s = self._serving
        if s.engine is None or s.state in ("starting", "stopping"):
            raise Unavailable(f"the agent is {s.state}")
        return s.engine

    async def engine_for(self, model: str = "", keep_alive_s: float | None = None) -> Engine:
        """The engine of the named model ("" the default), loaded now if it is not."""
        s, models = self._serving, self._models
        if models is None or s.state in ("starting", "stopping"):
            raise Unavailable(f"the agent is {s.state}")
        slot = models.resolve(model)
        if slot.default and s.state == "reloading" and s.engine is None:
            raise Unavailable("the agent is reloading")
        return await models.acquire(model, keep_alive_s)

    def current(self, model: str = "") -> Engine | None:
        """The named model's engine now, without loading it (None: not loaded)."""
        return self._models.current(model) if self._models is not None else None

    def model_states(self) -> tuple[ModelState, ...]:
        return self._models.states() if self._models is not None else ()

    def model_info(self) -> ModelInfo:
        """The default model's info; while it is unloaded, the last it had (fleet health)."""
        e = self._serving.engine
        info = e.info if e is not None else self._models.default.info if self._models else None
        if info is None or (e is None and self._serving.state != "serving"):
            raise Unavailable(f"the agent is {self._serving.state}")
        return info

    def reload(self) -> asyncio.Future[fpb.ReloadDone]:
        """Ask for a reload (as SIGHUP does); the future resolves when it has finished."""
        return self._requests.reload()

    async def offer_update(
        self, signed: bytes, args: Mapping[str, str] | None = None
    ) -> fpb.UpdateStatus:
        assert self._updater is not None
        return await self._updater.offer(signed, args)

    async def cancel_update(self, signed: bytes) -> fpb.UpdateStatus:
        assert self._updater is not None
        return await self._updater.cancel(signed)

    def status(self) -> AgentStatus:
        e, plan = self._serving.engine, self._serving.plan
        if plan is None or self._models is None:
            raise Unavailable(f"the agent is {self._serving.state}")
        if e is None:  # the default model is unloaded (idle past its keep_alive)
            return unloaded_status(self._base_status(plan), self._models)
        stats = e.stats()
        run, previous = None, None
        if self._runs is not None:
            self._runs.observe(e.info, e.serial, stats)
            run, previous = self._runs.runs()
        return AgentStatus(
            **self._base_status(plan),
            planned_bytes=self._models.loaded_bytes(),
            model=f"{e.info.name} {e.info.version} {e.info.quantization}",
            active_sessions=e.session_count(),
            engine=stats,
            kv=e.tier_stats(),
            info=e.info,
            run=run,
            previous=previous,
            probe=self._prober.figures(run.sha256) if run and self._prober else None,
            previous_probe=self._prober.figures(previous.sha256)
            if previous and self._prober
            else None,
            models=self._models.states(),
        )

    def _base_status(self, plan: Plan) -> dict[str, Any]:
        """The status fields that do not depend on a loaded model."""
        fleet = self._fleet
        return dict(
            profile=plan.profile.name,
            version=__version__,
            state=self._serving.state,
            uptime_s=time.monotonic() - self._started,
            rss_bytes=rss_bytes(),
            budget_bytes=plan.profile.runtime.max_num_bytes,
            fleet_link="off"
            if fleet is None
            else "connected"
            if fleet.link.connected
            else "disconnected",
            clock=self._updater.clock.state() if self._updater is not None else None,
        )

    def _scrape(self) -> AgentStatus | None:
        """What a metrics scrape reads: the status and the last update's phase, read from the
        update record on disk (so only here); None before a model is loaded."""
        try:
            status = self.status()
        except Unavailable:
            return None
        rec = self._updater.store.record() if self._updater is not None else None
        phase = "none" if rec is None else opb.UpdateRecord.State.Name(rec.state).lower()
        return dataclasses.replace(status, update_phase=phase)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        self._requests.install(asyncio.get_running_loop(), self._serving.inject_stall)
        t0 = time.monotonic()
        unixsocket.check(self.config.server.socket)  # refused before anything changes
        if self.config.http.enabled:
            unixsocket.check(http_socket(self.config))
        ports.check(  # a busy port is refused now, not after the model has loaded
            [("server.tcp (--tcp)", self.config.server.tcp)]
            + [("http.listen (--http)", self.config.http.tcp)] * self.config.http.enabled
        )
        lock = StateLock.acquire(state_dir(self.overrides))  # before anything writes there
        try:
            return await self._serve(t0)
        finally:
            lock.release()

    async def _serve(self, t0: float) -> int:
        s = self._serving
        base = load_plan(self.config, self.overrides)
        self._updater = Updater(Store(base.state_dir), self.config.updates, shipped_ref(base))
        self._updater.boot()
        self._prober = Prober(lambda: self.config.probe, base.state_dir)
        plan = s.plan = with_update(base, self._updater)
        # every named model's metadata, read before anything loads: a bad one stops the start
        specs = await asyncio.get_running_loop().run_in_executor(
            None, model_specs, self.config, plan
        )
        self.notifier.status(f"loading {plan.model_dir.name} on {plan.profile.name}")
        engine = s.engine = await self._load(plan)
        self._runs = RunBook.open(plan.state_dir, engine.info)  # a restart, maybe a crash
        self._models = Models(
            specs,
            s,
            self._load,
            lambda: self.config.limits.reload_drain_s,
            self._engine_drained,
            self._prober.running,
        )
        self._models.default.loads = 1
        models = self._models
        s.elsewhere = lambda: models.loaded_bytes(but=models.default)
        try:
            server = s.server = Server(self, self.config.server, self.config.limits.max_tokens)
            await server.start()  # checks the socket path again, as it binds
        except BaseException:
            engine.stop(0)
            engine.close()
            raise
        try:
            self._http = await self._start_http()
        except BaseException:
            await server.stop(grace=0)
            engine.stop(0)
            engine.close()
            raise
        s.state = "serving"
        await server.set_serving(True)
        info = engine.info
        log.info(
            "ready in %.2f s: %s %s (%s) on %s via %s, profile %s; listening on %s",
            time.monotonic() - t0,
            info.name,
            info.version,
            info.quantization,
            info.accelerator,
            info.execution_path,
            plan.profile.name,
            ", ".join(server.addresses),
        )
        self._start_fleet()
        self._updater.blocks = self._fleet.link if self._fleet is not None else None
        host = DaemonUpdateHost(
            s, self._updater, lambda: self.config, self._fleet, self._prober, self.engine_for
        )
        self._updater.attach(host)
        # before resume: an update resumed runs from here on, and READY follows at once
        self._admin = await start_admin(self._updater, self.config.server.socket)
        await self._updater.resume()
        self.notifier.ready(self._serving.status_line())
        try:
            await self._main_loop(server)
        finally:
            await self._shutdown(server)
        return 0

    async def _start_http(self) -> HttpServer | None:
        """The OpenAI-compatible HTTP API (`agent.api.http`), unless `[http] listen = "off"`."""
        if not self.config.http.enabled:
            log.info('http: off ([http] listen = "off")')
            return None
        from agent.api.http.server import HttpServer  # imported only when it serves (~5 MiB)

        # counted beside gRPC's in the daemon's one registry; GET /metrics serves it
        http = HttpServer(self, self.config, self.config.limits.max_tokens, self.metrics)
        await http.start()
        return http

    def _start_fleet(self) -> None:
        """The MQTT fleet link, when a broker is configured; it never blocks the daemon."""
        fleet = self.config.fleet
        if fleet.broker is None:
            log.info("fleet: no broker configured; the fleet link is off")
            return
        assert self._serving.plan is not None
        device = resolve_device_id(fleet)
        loop = asyncio.get_running_loop()
        state, min_free = self._serving.plan.state_dir, self.config.updates.min_free_bytes
        probes = self._prober.latest if self._prober is not None else no_probes
        self._fleet = FleetAgent(
            fleet, device, state, self, loop, min_free_bytes=min_free, probes=probes
        )
        self._fleet.start()

    async def _load(self, plan: Plan, budget: int | None = None) -> Engine:
        """Build an engine off the event loop (on `budget`, by default what the other models
        leave). Meanwhile, every tick asks systemd for more time (EXTEND_TIMEOUT_USEC: a large
        model on a slow board must not hit TimeoutStartSec) and, during a reload, keeps the
        watchdog fed for the engine that is still serving."""
        loop = asyncio.get_running_loop()
        if budget is None and self._models is not None:
            budget = self._models.budget() - self._models.loaded_bytes(but=self._models.default)
        future = loop.run_in_executor(None, build_engine, plan, budget)
        tick = self.config.watchdog.tick_s
        while True:
            self.notifier.extend_timeout(int(3 * tick * 1e6))
            done, _ = await asyncio.wait({future}, timeout=tick)
            if done:
                return future.result()
            self._tick()

    async def _main_loop(self, server: Server) -> None:
        tick = self.config.watchdog.tick_s
        while not self._requests.stop:
            await self._requests.wait(tick)
            waiters = self._requests.take_reload()
            if waiters is not None:
                done = await self._do_reload()
                for w in waiters:
                    if not w.done():
                        w.set_result(done)
                if self._fleet is not None:
                    self._fleet.reload_done(done)  # on disk before READY says it is over
                self.notifier.ready(self._serving.status_line())
            if self._models is not None:
                await self._models.tick()  # idle models past their keep_alive unload
            self._tick()

    def _tick(self) -> None:
        e, serving = self._serving.engine, self._serving.state == "serving"
        if e is None and not serving:  # between engines (a reload that drains first)
            return
        age = e.heartbeat_age() if e is not None else 0.0  # unloaded: no thread to wedge
        if age < self.config.watchdog.engine_stall_s:
            self.notifier.watchdog()
        else:
            # no WATCHDOG=1: systemd restarts us after WatchdogSec
            log.error("engine thread has not answered for %.1f s; withholding the watchdog", age)
        line = self._serving.status_line()
        if line != self._last_status:
            self._last_status = line
            self.notifier.status(line)
        if self._fleet is not None:
            self._fleet.tick()
        if self._prober is not None:
            self._prober.tick(e if serving else None)
        self._observe_runs()

    def _engine_drained(self, engine: Engine) -> None:
        """A replaced engine's last counts, once it has drained (on the drain's thread)."""
        if self._runs is not None:
            self._runs.drained(engine.serial, engine.stats())

    def _observe_runs(self) -> None:
        """The serving engine's counters into the run record, saved now and then."""
        e, runs = self._serving.engine, self._runs
        if e is not None and runs is not None:
            runs.observe(e.info, e.serial, e.stats())
            runs.save_if_due()

    async def _do_reload(self) -> fpb.ReloadDone:
        self.notifier.reloading("reloading configuration and profile")
        log.info("reload requested (SIGHUP)")
        s = self._serving
        done = fpb.ReloadDone(ok=True)
        try:
            config = apply_overrides(load_config(self.overrides.config_path), self.overrides)
            plan = with_update(load_plan(config, self.overrides), self._updater)
            specs = model_specs(config, plan)  # every model's metadata read before a change
            if config.fleet != self.config.fleet:
                log.warning("reload: [fleet] changes take effect at the next restart")
            if config.http != self.config.http:
                log.warning("reload: [http] changes take effect at the next restart")
            self.config = config
            if plan != s.plan:
                s.state = "reloading"
                new = await s.switch_to(plan)
                log.info("reloaded: now serving %s %s", new.info.name, new.info.quantization)
                done.message = "reloaded"
            else:
                log.info("reload: model and profile unchanged")
                done.message = "model and profile unchanged"
            if self._models is not None:
                await self._models.update(specs)
        except Exception as exc:  # a bad new config keeps the old one serving
            log.error("reload failed, keeping the previous model: %s", exc)
            done.ok, done.message = False, f"reload failed, the previous model serves: {exc}"
        s.state = "serving"
        if s.engine is not None:
            i = s.engine.info
            done.model = f"{i.name} {i.version} {i.quantization}"
        return done

    async def _shutdown(self, server: Server) -> None:
        """Stop: waiting requests are refused at once (UNAVAILABLE / 503), running ones may
        finish within `limits.drain_timeout_s` and are then cut: each client gets a final
        message with its tokens so far (gRPC: FINISH_REASON_CANCELLED, then status
        CANCELLED; HTTP: a last chunk and [DONE]) before the listeners close."""
        loop = asyncio.get_running_loop()
        s = self._serving
        s.state = "stopping"
        if self._updater is not None:
            self._updater.stop()
        if self._prober is not None:  # a probe under way gives way at its next step
            await loop.run_in_executor(None, self._prober.stop)
        timeout = self.config.limits.drain_timeout_s
        self.notifier.stopping(f"stopping: draining in-flight requests (up to {timeout:g} s)")
        await server.set_serving(False)
        if s.engine is not None:
            engine = s.engine
            stop = functools.partial(engine.stop, timeout, refuse_waiting=True)
            drained = await loop.run_in_executor(None, stop)
            log.info("shutdown: %s", "drained" if drained else "drain time over, cut the rest")
        await loop.run_in_executor(None, s.stop_draining, timeout)
        if self._models is not None:
            await self._models.stop_others(timeout)
        # every request has had its last event: the listeners give the streams the time to
        # write it (a client that does not read is not waited for beyond that)
        if self._http is not None:
            await self._http.stop()
        await server.stop(grace=STREAM_END_GRACE_S)
        if self._admin is not None:
            await self._admin.stop()
        if self._fleet is not None:
            self._fleet.stop()  # after the drain: "offline" means no request is running
        self._observe_runs()
        if self._runs is not None:
            self._runs.close()  # a clean stop: the next start is a restart, not a crash
        if s.engine is not None:
            s.engine.close()
        log.info("stopped")


def run_daemon(overrides: Overrides) -> int:
    """Entry point of `edge-agent run`."""
    return asyncio.run(Daemon(overrides).run())
