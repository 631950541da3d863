"""The daemon's side of an update (`agent.ota.host.UpdateHost`): what the updater checks a
bundle against, activating an installed model (its canary run before it serves), checking the
model that serves (and waiting for its quality probe in the trial), reporting to the fleet and
pruning the weight cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import platform
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent import __version__
from agent.api.grpc.admin import AdminServer, admin_socket
from agent.base.errors import AgentError, NotFound
from agent.config.file import AgentConfig
from agent.daemon.canary import engine_model
from agent.daemon.plan import open_plan_model
from agent.daemon.probe import Prober
from agent.daemon.serving import Serving
from agent.engine.engine import Engine
from agent.fleet.device.agent import FleetAgent
from agent.ota import canary
from agent.ota.artifact.manifest import InstallContext
from agent.ota.store import ModelRef
from agent.ota.updater import Updater
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from agent.runtime.prepare.cachefiles import prune_weight_cache

log = logging.getLogger("agent.daemon")  # the daemon's lines keep one logger name


class DaemonUpdateHost:
    """An `UpdateHost` over what serves; `config` is the configuration in force (a reload may
    replace it), `fleet` the fleet link that hears the reports (None without a broker)."""

    def __init__(
        self,
        serving: Serving,
        updater: Updater,
        config: Callable[[], AgentConfig],
        fleet: FleetAgent | None,
        prober: Prober | None = None,
        load: Callable[[], Awaitable[Engine]] | None = None,
    ) -> None:
        self._serving = serving
        self._load = load  # the default model's engine, loaded if it was unloaded when idle
        self._prober = prober
        self._updater = updater
        self._config = config
        self._fleet = fleet
        updater.switch.activity = self.activity  # what "idle" watches
        if fleet is not None:
            fleet.reporter.activation = updater.switch.activation  # shown in health

    def install_context(self, installed: ModelRef) -> InstallContext:
        plan = self._serving.plan
        assert plan is not None
        inst = self._updater.installed()
        return InstallContext(
            model_name=open_plan_model(plan, Path(installed.model_dir)).name,
            installed_version=installed.version,
            installed_sha256=installed.sha256,
            profile=plan.profile.name,
            arch=platform.machine(),
            agent_version=__version__,
            finished_update_ids=frozenset(inst.finished),
            max_payload_bytes=self._config().updates.max_payload_bytes,
            cache_dir=plan.profile.runtime.xnnpack_weight_cache_dir,
        )

    async def activate(self, ref: ModelRef, canary_spec: opb.Canary | None) -> None:
        s = self._serving
        assert s.plan is not None
        plan = dataclasses.replace(
            s.plan, model_dir=Path(ref.model_dir), quantization=ref.quantization
        )
        s.state = "reloading"
        try:
            await s.switch_to(plan, lambda e: canary.check(engine_model(e), canary_spec))
        finally:
            s.state = "serving"
        log.info("update: now serving %s (%s)", ref.model_dir, ref.label or ref.version)

    async def check_serving(self, canary_spec: opb.Canary | None) -> str | None:
        e = self._serving.engine
        if e is None and self._load is not None and self._serving.state == "serving":
            try:  # unloaded after its keep_alive: idle is not unhealthy, a failed load is
                e = await self._load()
            except AgentError as exc:
                return f"the model did not load again: {exc}"
        if e is None:
            return "no engine is serving"
        age = e.heartbeat_age()
        if age >= self._config().watchdog.engine_stall_s:
            return f"the engine thread has not answered for {age:.1f} s"
        loop = asyncio.get_running_loop()
        if self._prober is not None:  # the new model's probe runs in its trial
            await loop.run_in_executor(None, self._prober.settle, e)
        if canary_spec is None or not canary_spec.expected_tokens:
            return None
        want = list(canary_spec.expected_tokens)
        got = await loop.run_in_executor(
            None, canary.expected_tokens, engine_model(e), canary_spec.prompt, len(want)
        )
        return None if got == want else f"greedy tokens {got} != expected {want}"

    def activity(self) -> tuple[int, object]:
        """Requests running or queued, and a token that changes whenever a request ran or a
        session was used (agent/ota/switch/gate.py: a request that came and went between two
        looks counts too); no engine (a reload) counts as running."""
        e = self._serving.engine
        if self._serving.state != "serving":
            return 1, None
        if e is None:  # the default model is unloaded: idle (agent.daemon.models)
            return 0, "unloaded"
        stats = e.stats()
        used = tuple((s.id, s.last_used, s.tokens) for s in e.list_sessions(None))
        return stats.active + stats.queue_depth, (stats.requests_total, used)

    def report(self, status: fpb.UpdateStatus, key: str = "") -> None:
        if self._fleet is not None:
            self._fleet.report_update(status, key)

    def remove_unused_caches(self) -> None:
        plan = self._serving.plan
        directory = plan.profile.runtime.xnnpack_weight_cache_dir if plan else None
        if directory is None or self._serving.state == "reloading":  # a load's files are not
            return  # held yet; that load prunes the directory itself
        try:
            prune_weight_cache(directory)
        except OSError as exc:  # the next load prunes them
            log.warning("weight cache not pruned (%s)", exc)


class AdminUpdates:
    """The admin socket's `Backend` (agent.api.grpc.admin) over the updater: installs from this
    machine, their status, and an installer's commit or rollback."""

    def __init__(self, updater: Updater) -> None:
        self._updater = updater

    def incoming(self) -> Path:
        self._updater.store.payloads.mkdir(parents=True, exist_ok=True)
        return self._updater.store.payloads

    async def install(self, signed: bytes, args: dict[str, str], payload: Path) -> fpb.UpdateStatus:
        return await self._updater.offer(signed, args, local=payload)

    def update_status(self, update_id: str) -> fpb.UpdateStatus:
        status = self._updater.last_status()
        if status is None or (update_id and status.update_id != update_id):
            latest = f"the latest is {status.update_id}" if status else "none was installed"
            raise NotFound(f"update {update_id!r} is not this device's latest update; {latest}")
        return status

    async def decide(self, update_id: str, decision: str) -> fpb.UpdateStatus:
        return await self._updater.decide(update_id, decision)


async def start_admin(updater: Updater, api_socket: Path) -> AdminServer:
    """The admin socket beside the apps' (agent.api.grpc.admin), serving."""
    admin = AdminServer(AdminUpdates(updater), admin_socket(api_socket))
    await admin.start()
    return admin
