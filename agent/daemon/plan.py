"""The run plan: which engine the daemon runs, from the config file, the profile and the
command line (`Overrides`, which win over both).

`apply_overrides` is pure; `load_plan` does the I/O a plan needs (it resolves the profile and,
when no quantization is configured, opens the model to choose one); `build_engine` loads the
plan's model (`load_plan_model`) and hands it to its engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from agent.base.errors import ConfigError
from agent.config.file import AgentConfig, parse_broker
from agent.config.models import ModelEntry
from agent.engine.engine import Engine, EngineLimits
from agent.engine.loading import EngineModel, load_model
from agent.fleet.topics import check_device_id
from agent.model.directory import ModelMeta, demo_model_dir
from agent.model.open import open_model, unpack_cache_dir
from agent.ota.store import ModelRef
from agent.ota.updater import Updater
from agent.profile import DeviceProfile, choose_quantization, resolve_profile

log = logging.getLogger("agent.daemon")  # the daemon's lines keep one logger name

DEFAULT_STATE_DIR = Path("/var/lib/edge-agent")  # systemd's StateDirectory=edge-agent


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
    http: str | None = None  # "off" | PATH | HOST:PORT (`agent.config.file.parse_http_listen`)
    # `--model NAME=PATH` or `--model` given more than once: they replace `[models]`
    models: tuple[ModelEntry, ...] = ()


def apply_overrides(config: AgentConfig, o: Overrides) -> AgentConfig:
    server = config.server
    if o.socket is not None:
        server = dataclasses.replace(server, socket=o.socket)
    if o.tcp is not None:
        from agent.config.file import check_tcp

        check_tcp("--tcp", "tcp", o.tcp, server.allow_remote_tcp)
        server = dataclasses.replace(server, tcp=o.tcp)
    model, models = config.model, config.models
    if o.model is not None:
        model = dataclasses.replace(model, path=o.model)
        models = dataclasses.replace(models, entries=())
    if o.models:
        model = dataclasses.replace(model, path=None)
        models = dataclasses.replace(models, entries=o.models)
    if o.quantization is not None:
        model = dataclasses.replace(model, quantization=o.quantization)
    fleet = config.fleet
    if o.broker is not None:
        # the command line's broker replaces the config's whole list, failover nodes included
        broker = parse_broker("--broker", "broker", o.broker)
        fleet = dataclasses.replace(fleet, broker=broker, other_brokers=())
    if o.device_id is not None:
        try:
            check_device_id(o.device_id)
        except ValueError as exc:
            raise ConfigError("--device-id", "device_id", o.device_id, str(exc)) from exc
        fleet = dataclasses.replace(fleet, device_id=o.device_id)
    http = config.http
    if o.http is not None:
        from agent.config.file import parse_http_listen

        http = parse_http_listen("--http", "http", o.http, server.allow_remote_tcp, http)
    return dataclasses.replace(
        config, server=server, model=model, fleet=fleet, http=http, models=models
    )


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything that decides which engine to run; a reload rebuilds when this changes."""

    profile: DeviceProfile
    model_dir: Path
    quantization: str | None
    limits: EngineLimits
    state_dir: Path


def state_dir(overrides: Overrides) -> Path:
    return overrides.state_dir or DEFAULT_STATE_DIR


def load_plan(config: AgentConfig, overrides: Overrides) -> Plan:
    """The plan for the configured (default) model, its variant chosen here once (the engine
    is then told which: the profile's choice is made, and logged, one time per start or
    reload). With `[models]`, the default model is the first listed."""
    profile, reasons = resolve_profile(overrides.profile)
    for r in reasons:
        log.info("profile %s: %s", profile.name, r)
    first = config.models.entries[0] if config.models.entries else None
    model_dir = first.path if first else config.model.path or profile.model.path or demo_model_dir()
    directory = state_dir(overrides)
    plan = Plan(
        with_weight_cache(profile, directory),
        model_dir,
        first.quantization if first else config.model.quantization,
        engine_limits(config),
        directory,
    )
    return with_variant(plan)


def with_variant(plan: Plan) -> Plan:
    """`plan` with its quantization chosen (the profile's choice) when it names none."""
    model_dir = plan.model_dir
    if plan.quantization is None:
        meta = open_plan_model(plan, model_dir)
        quant = choose_quantization(plan.profile, [v.quantization for v in meta.variants])
        plan = dataclasses.replace(plan, quantization=quant)
    return plan


def engine_limits(config: AgentConfig) -> EngineLimits:
    """The engine's limits and per-client quotas from the config; with shared sessions every
    client is the one owner "", so unset quotas are the whole bounds (no split)."""
    lim, q = config.limits, config.quotas
    whole = config.sessions.share
    return EngineLimits(
        lim.max_active,
        lim.queue_capacity,
        lim.max_pending_events,
        lim.max_sessions,
        sessions_per_client=q.sessions_per_client or (lim.max_sessions if whole else None),
        session_bytes_per_client=q.session_bytes_per_client
        if q.session_bytes_per_client is not None or not whole
        else 1 << 62,
        waiting_per_client=q.waiting_per_client or (lim.queue_capacity if whole else None),
        consumer_stall_s=lim.consumer_stall_s,
    )


def with_weight_cache(profile: DeviceProfile, state_dir: Path) -> DeviceProfile:
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


def with_update(plan: Plan, updater: Updater | None) -> Plan:
    """The model an installed update made current wins over config and profile."""
    if updater is None or updater.store.installed() is None:
        return plan
    ref = updater.serving_ref()
    return dataclasses.replace(plan, model_dir=Path(ref.model_dir), quantization=ref.quantization)


def load_plan_model(plan: Plan) -> EngineModel:
    """The plan's model loaded (its variant chosen in `load_plan`), its disk tier opened."""
    return load_model(
        plan.profile, plan.model_dir, quantization=plan.quantization, state_dir=plan.state_dir
    )


def build_engine(plan: Plan, budget: int | None = None) -> Engine:
    """Load the plan's model once, then hand it to the engine that serves it; `budget`: the
    bytes of the profile's budget the other loaded models leave it (agent.daemon.models)."""
    runtime = plan.profile.runtime
    if budget is not None and budget < runtime.max_num_bytes:
        runtime = dataclasses.replace(runtime, max_num_bytes=budget)
        plan = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, runtime=runtime))
    return Engine(plan.profile, load_plan_model(plan), limits=plan.limits)


def open_plan_model(plan: Plan, model: Path) -> ModelMeta:
    """A model directory or a `.litertlm` bundle, extracted where its engine will look."""
    return open_model(
        model, unpack_cache_dir(plan.profile.runtime.xnnpack_weight_cache_dir, plan.state_dir)
    )


def shipped_ref(plan: Plan) -> ModelRef:
    """The model that serves when no update was ever installed (version 0)."""
    meta = open_plan_model(plan, plan.model_dir)
    quant = plan.quantization or choose_quantization(
        plan.profile, [v.quantization for v in meta.variants]
    )
    variant = meta.variant(quant)
    return ModelRef(str(plan.model_dir), quant, variant.sha256, 0, meta.version)
