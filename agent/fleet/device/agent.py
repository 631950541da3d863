"""The daemon's side of the fleet: health on the tick, events to the outbox, commands to the
daemon. A thin adapter between `Daemon` (through the `FleetBackend` protocol) and `FleetLink`;
the commands: `FleetAgent`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from agent import __version__
from agent.base.errors import ConfigError, InvalidRequest, Unavailable
from agent.config.file import FleetConfig
from agent.engine.stats import ModelInfo
from agent.fleet.device.health import (
    HealthReporter,
    Labels,
    Probes,
    build_health,
    no_probes,
    read_disk,
    read_thermal,
)
from agent.fleet.device.link import FleetLink, Reply, SessionCounter
from agent.fleet.device.outbox import Outbox
from agent.fleet.mqtt import MqttOptions
from agent.fleet.topics import Topics, check_device_id
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.status.value import AgentStatus

log = logging.getLogger(__name__)

MACHINE_ID = Path("/etc/machine-id")
MAX_COMMANDS = 4
Code = fpb.CommandResponse


class FleetBackend(Protocol):
    """What the fleet needs from the daemon."""

    def status(self) -> AgentStatus: ...

    def model_info(self) -> ModelInfo: ...

    def reload(self) -> Awaitable[fpb.ReloadDone]: ...

    def offer_update(self, signed: bytes) -> Awaitable[fpb.UpdateStatus]:
        """The daemon's also takes the command's arguments, `offer_update(signed, args)`
        (`activate`, `allow_metered`: docs/UPDATES.md "When to switch"); a backend without
        them (the fleet simulator's) is offered updates whose command has none."""

    def cancel_update(self, signed: bytes) -> Awaitable[fpb.UpdateStatus]:
        """The update's status once the cancel has ended it; InvalidRequest if refused."""


def resolve_device_id(fleet: FleetConfig, machine_id: Path = MACHINE_ID) -> str:
    """The configured device id, else this machine's /etc/machine-id."""
    if fleet.device_id is not None:
        return fleet.device_id
    try:
        return check_device_id(machine_id.read_text().strip())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "[fleet]",
            "fleet.device_id",
            None,
            f"an id for this board: {machine_id} is not usable ({exc}); set fleet.device_id "
            "or pass --device-id",
        ) from exc


class FleetAgent:
    """Health, events and commands between the daemon and the link. Commands run on the
    daemon's event loop, at most `MAX_COMMANDS` at once::

      ping    → Pong (time, session)
      status  → a fresh Health
      reload  → what SIGHUP does; answered when the reload has finished, recorded as an event
      update  → a signed manifest (docs/UPDATES.md): answered when accepted or rejected
      cancel  → a signed cancel of the update in progress: answered once it has ended
    """

    def __init__(
        self,
        config: FleetConfig,
        device_id: str,
        state_dir: Path,
        backend: FleetBackend,
        loop: asyncio.AbstractEventLoop,
        sys_root: Path = Path("/sys"),
        min_free_bytes: int = 0,
        probes: Probes = no_probes,
    ) -> None:
        self.config = config
        self.min_free_bytes = min_free_bytes  # [updates]: health flags free space below it
        self.device_id = device_id
        self._backend = backend
        self._loop = loop
        self._state_dir = state_dir
        self._sys_root = sys_root
        self._running: set[asyncio.Task[None]] = set()
        self.last_update: fpb.UpdateStatus | None = None
        self.labels = Labels.of_this_machine(config.group, config.tags)
        fleet_dir = state_dir / "fleet"
        self.outbox = Outbox(fleet_dir / "events", config.max_events)
        self.reporter = HealthReporter(
            device_id=device_id,
            session=0,
            interval_s=config.health_interval_s,
            min_interval_s=min(config.health_min_interval_s, config.health_interval_s),
            labels=self.labels,
            probes=probes,
        )
        self.topics = Topics(config.topic_prefix, device_id)
        self.link = FleetLink(
            MqttOptions.from_config(config),
            self.topics,
            outbox=self.outbox,
            session_counter=SessionCounter(fleet_dir / "session"),
            state=self._device_state,
            on_command=self._command,
            session_expiry_s=config.session_expiry_s,
            max_command_bytes=config.max_command_bytes,
        )

    def start(self) -> None:
        brokers = self.link.opts.brokers
        log.info(
            "fleet: device %s, broker %s, MQTT %s, %d events waiting on disk",
            self.device_id,
            " then ".join(b.url() for b in brokers),
            self.config.protocol,
            len(self.outbox),
        )
        self.link.start()

    def stop(self) -> None:
        """The last health (state "stopping") and "offline", then disconnect."""
        self.tick(force=True)
        self.link.stop()

    # ------------------------------------------------------------------ daemon → fleet

    def tick(self, force: bool = False) -> fpb.Health | None:
        """On the daemon's tick: hand the link a Health when one is due (or now: `force`)."""
        try:
            status, info = self._backend.status(), self._backend.model_info()
        except Unavailable:  # starting or between engines: nothing to report yet
            return None
        self.reporter.session = self.link.session
        health = self.reporter.next(
            status,
            info,
            thermal=read_thermal(self._sys_root),
            disk=read_disk(self._state_dir, self.min_free_bytes),
            last_update=self.last_update,
            now=time.time(),
            force=force,
            mono=time.monotonic(),  # the heartbeat's timing: a wall clock step does not move it
        )
        if health is not None:
            self.link.set_health(health)
        return health

    def _snapshot(self, seq: int) -> fpb.Health:
        """Health as of now, outside the reporter's timing (the status command; it carries the
        seq of the last published health, as it is not one of the numbered messages)."""
        return build_health(
            self._backend.status(),
            self._backend.model_info(),
            seq=seq,
            session=self.link.session,
            device_id=self.device_id,
            thermal=read_thermal(self._sys_root),
            disk=read_disk(self._state_dir, self.min_free_bytes),
            last_update=self.last_update,
            now=time.time(),
            labels=self.labels,
            probes=self.reporter.probes,
            activation=self.reporter.activation(),
        )

    def record(self, event: fpb.Event) -> None:
        """Keep an event on disk until the broker has it (once per idempotency key)."""
        event.device_id = self.device_id
        stored = self.outbox.append(event)
        if stored is None:
            return
        log.info("fleet: event %d recorded (%s)", stored.seq, stored.WhichOneof("kind"))
        self.link.events_added()

    def reload_done(self, done: fpb.ReloadDone) -> None:
        self.record(fpb.Event(reload=done))

    def report_update(self, status: fpb.UpdateStatus, key: str = "") -> None:
        """An update's transition: kept on disk until delivered, and shown in health. A
        transition carries a key (update id and state): reported again after a crash, it is
        recorded once."""
        self.last_update = status
        self.record(fpb.Event(update=status, key=key))

    # ------------------------------------------------------------------ fleet → daemon

    def _device_state(self, kind: fpb.DeviceState.Kind, session: int) -> fpb.DeviceState:
        """The birth, the Will and the clean OFFLINE: presence, session and who this is."""
        msg = fpb.DeviceState(
            state=kind,
            session=session,
            device_id=self.device_id,
            agent_version=__version__,
            timestamp_unix=time.time(),
            group=self.labels.group,
            tags=self.labels.tags,
            arch=self.labels.arch,
        )
        try:
            st, info = self._backend.status(), self._backend.model_info()
        except Unavailable:
            return msg
        msg.profile = st.profile
        msg.model = f"{info.name} {info.version} {info.quantization}"
        msg.model_sha256 = info.sha256
        msg.model_digest = info.digest
        return msg

    def _command(self, name: str, command: fpb.Command, reply: Reply) -> None:
        """On the MQTT thread: run the command on the event loop, answer from there."""
        self._loop.call_soon_threadsafe(self._start_command, name, command, reply)

    def _start_command(self, name: str, command: fpb.Command, reply: Reply) -> None:
        handler = self._handlers().get(name)
        if handler is None:
            known = ", ".join(sorted(self._handlers()))
            reply(Code(code=Code.NOT_FOUND, command=name, message=f"unknown command; try {known}"))
            return
        if len(self._running) >= MAX_COMMANDS:
            msg = f"{MAX_COMMANDS} commands are already running; try again later"
            reply(Code(code=Code.RESOURCE_EXHAUSTED, command=name, message=msg))
            return
        task = self._loop.create_task(self._run_command(name, handler, command, reply))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_command(
        self,
        name: str,
        handler: Callable[[fpb.Command], Awaitable[fpb.CommandResponse]],
        command: fpb.Command,
        reply: Reply,
    ) -> None:
        try:
            response = await handler(command)
        except Unavailable as exc:
            response = Code(code=Code.UNAVAILABLE, message=str(exc))
        except Exception as exc:  # a failing command is answered, never crashes the daemon
            log.exception("fleet: command %s failed", name)
            response = Code(code=Code.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        response.command = name
        log.info("fleet: command %s answered %s", name, Code.Code.Name(response.code))
        reply(response)

    def _handlers(self) -> dict[str, Callable[[fpb.Command], Awaitable[fpb.CommandResponse]]]:
        return {
            "ping": self._ping,
            "status": self._status,
            "reload": self._reload,
            "update": self._update,
            "cancel": self._cancel_update,
        }

    async def _ping(self, command: fpb.Command) -> fpb.CommandResponse:
        return Code(pong=fpb.Pong(timestamp_unix=time.time(), session=self.link.session))

    async def _status(self, command: fpb.Command) -> fpb.CommandResponse:
        return Code(status=self._snapshot(self.reporter.seq))

    async def _update(self, command: fpb.Command) -> fpb.CommandResponse:
        """The body is a SignedManifest: answered once it is verified and recorded (or
        rejected); every later transition is reported on <prefix>/<device>/update/status."""
        args = dict(command.args)  # when to switch (agent/ota/switch/policy.py)
        offer = self._backend.offer_update
        status = await (offer(command.body, args) if args else offer(command.body))  # type: ignore[call-arg]
        ok = status.phase == fpb.UpdateStatus.RECEIVED
        code = Code.OK if ok else Code.INVALID_ARGUMENT
        return Code(code=code, message=status.message, update=status)

    async def _cancel_update(self, command: fpb.Command) -> fpb.CommandResponse:
        """The body is a SignedCancel naming the update in progress (docs/UPDATES.md); the
        update's end (rejected, `cancelled`) is also reported on the status topic."""
        try:
            status = await self._backend.cancel_update(command.body)
        except InvalidRequest as exc:  # not signed by a trusted key, expired, nothing to stop
            log.warning("fleet: cancel refused: %s", exc)
            return Code(code=Code.INVALID_ARGUMENT, message=f"cancel refused: {exc}")
        return Code(code=Code.OK, message=status.message, update=status)

    async def _reload(self, command: fpb.Command) -> fpb.CommandResponse:
        done = await self._backend.reload()
        code = Code.OK if done.ok else Code.INTERNAL
        return Code(code=code, message=done.message, reload=done)
