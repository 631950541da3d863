"""A fleet simulator for tests and benchmarks: many device agents in one process (`FleetSim`),
or in several (`FleetShards`, 1,000 a process: what a 10,000-device benchmark needs).

Every simulated device runs the agent's real fleet side and real update machine:

* `FleetAgent` → `FleetLink` (its own MQTT connection, client id ``edge-agent-<device>``, a
  persistent session, birth / Last Will / offline, health from the real `HealthReporter`, events
  through the on-disk `Outbox`, commands answered as the daemon answers them);
* `Updater` with a real `Store` in the device's own state directory, manifests checked against
  real trusted keys (Ed25519), the payload fetched in blocks over MQTT (or over HTTP when the
  manifest has a URL), patched with the real delta code, every file hashed.

Only the engine is a stub (`SimEngine`, the `FleetBackend` and `UpdateHost` the daemon would
provide): activating a model checks its file's sha256 and pretends to load it; the trial's
health check passes unless the device's behaviour says otherwise. The daemon's engine is not
used: a thousand copies would not fit.

    models = SimModels.create(tmp / "models")                # tiny model dirs, a signing key
    devices = [SimDevice(f"sim-{i:04d}", group="canary" if i < 10 else "") for i in range(100)]
    with FleetSim(broker.url, tmp / "fleet", devices, trusted_keys_dir=models.trusted,
                  shipped=models.shipped) as sim:
        bundle = models.bundle(tmp / "u1.tar", version=1)
        ... offer it (edge-agent fleet rollout / publish-update) ...
        assert sim.phase("sim-0001") == "committed" and sim.offers("sim-0001") == 1

Behaviours (failure injection, per device):

* ``ok``: takes the update: received → downloading → verified → staged → activating → trial →
  committed.
* ``reject``: refuses it at the offer: the device trusts another key (code `unknown_key`).
* ``rollback``: its trial's health check fails (the engine "stops answering", as in a crash
  loop): rolled back to the model it served before.
* ``crashloop``: the process crashes in its trial and is restarted (as systemd would), again
  and again: the connection drops without a DISCONNECT (the Will), the device boots from its
  record, and the updater's own crash-loop rule rolls back at the `max_trial_restarts`-th
  start.
* ``stall``: the download never progresses: its block requests go unanswered (MQTT), or the
  transfer hangs (a payload URL), until the updater gives up (`max_download_attempts`, code
  `payload`) or the update is cancelled.
* ``offline``: goes away on its first offer, before acknowledging it: the connection drops
  without a DISCONNECT (inside paho's message callback, so the PUBACK never leaves), the broker
  publishes its Last Will (``LOST``), the command is never answered. Brought back with
  `FleetSim.come_online`, its persistent session gets the unacknowledged offer again, and that
  second delivery is handled as an ``ok`` device would.
* ``fail``: the payload arrives corrupted (a byte flipped in every block over MQTT; with a
  payload URL, a damaged partial file): rejected after the download with `payload_hash`.

The real updater never reports the phase ``FAILED`` (the operator tools use it for a device they
could not reach); ``fail`` is a failure after the offer, ``reject`` one at the offer.

Threads: one per device (the fleet link's network thread, which drives paho's loop), one event
loop thread for every device's updater and commands, a small pool for downloads and patching,
and one observer client that follows the devices' retained state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import platform
import resource
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from agent import __version__
from agent.base.errors import AgentError
from agent.config.file import FleetConfig, UpdatesConfig, parse_broker
from agent.engine.stats import EngineStats, ModelInfo, Percentiles
from agent.fleet.device.agent import FleetAgent
from agent.fleet.device.link import FleetLink
from agent.fleet.mqtt import MqttOptions, new_client
from agent.model.directory import (
    defining_files,
    load_model_dir,
    model_digest,
    write_model_dir_metadata,
)
from agent.ota.artifact import keys
from agent.ota.artifact.bundle import make_bundle
from agent.ota.artifact.manifest import InstallContext
from agent.ota.fetch import BlockSource
from agent.ota.store import ModelRef, Store
from agent.ota.updater import Updater
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from agent.runtime.plan import MemoryPlan
from agent.status.value import AgentStatus

log = logging.getLogger(__name__)

BEHAVIOURS: Final = ("ok", "reject", "rollback", "crashloop", "stall", "offline", "fail")
RESTART_S: Final = 0.2  # a crashed device's restart delay (systemd's RestartSec, shortened)
PREFIX: Final = "fleet/v1"
PROFILE: Final = "sim"
MIB: Final = 1 << 20
Kind = fpb.DeviceState


@dataclass(frozen=True)
class SimDevice:
    """One simulated device. `start_online=False`: it has never connected when the simulator
    starts (no retained state, no broker session) until `FleetSim.come_online`."""

    device_id: str
    group: str = ""
    tags: tuple[str, ...] = ()
    behaviour: str = "ok"  # one of BEHAVIOURS
    start_online: bool = True

    def __post_init__(self) -> None:
        if self.behaviour not in BEHAVIOURS:
            raise ValueError(f"behaviour {self.behaviour!r}: one of {', '.join(BEHAVIOURS)}")


# ----------------------------------------------------------------------------- models and keys


def make_model_dir(
    directory: Path,
    *,
    name: str = "sim-model",
    version: str = "1.0.0",
    size: int = 4096,
    seed: int = 0,
) -> Path:
    """A tiny model directory (metadata.json, tokenizer.model, one int8 "variant" of `size`
    bytes of deterministic noise, real sha256s): what the store and the delta code work on.
    `seed` decides the variant's bytes; versions that share most bytes make a small delta."""
    directory.mkdir(parents=True, exist_ok=True)
    import random

    rng = random.Random(0)
    data = bytearray(rng.randbytes(size))
    if seed:  # a "fine-tune": a few hundred bytes changed, the rest as in version 0
        tweak = random.Random(seed)
        for _ in range(max(1, size // 16)):
            data[tweak.randrange(size)] = tweak.randrange(256)
    (directory / "model_int8.tflite").write_bytes(bytes(data))
    (directory / "tokenizer.model").write_bytes(b"sim tokenizer\n")
    write_model_dir_metadata(
        directory,
        name=name,
        version=version,
        context_length=1024,
        bos_id=1,
        eos_id=2,
        stop_token_ids=[2],
        chat_template="",
        variants=[("model_int8.tflite", "int8")],
    )
    return directory


@functools.lru_cache(maxsize=64)
def _digest_of(model_dir: str) -> str:
    """What a real engine reports (`agent.model.directory.model_digest`), once per directory."""
    return model_digest(defining_files(load_model_dir(Path(model_dir))))


def model_ref(directory: Path, version: int = 0) -> ModelRef:
    """The int8 variant of a model directory as the store names it (`version` 0: as shipped)."""
    meta = load_model_dir(directory)
    variant = meta.variant("int8")
    return ModelRef(str(directory), "int8", variant.sha256, version, meta.version)


@dataclass(frozen=True)
class SimModels:
    """The shipped model every device starts on, the operator's signing key and a trusted keys
    directory holding its public key (what `FleetSim(trusted_keys_dir=...)` takes)."""

    root: Path
    shipped: Path  # version 0, label 1.0.0
    key: Ed25519PrivateKey
    trusted: Path

    @classmethod
    def create(cls, root: Path, *, size: int = 4096) -> SimModels:
        root.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        trusted = root / "trusted"
        trusted.mkdir(exist_ok=True)
        (trusted / "release.pub").write_text(keys.public_line(key.public_key(), "release"))
        shipped = make_model_dir(root / "v0", size=size)
        return cls(root, shipped, key, trusted)

    def model(self, version: int) -> Path:
        """The model directory of update `version` (label ``1.<version>.0``), made once."""
        if version == 0:
            return self.shipped
        d = self.root / f"v{version}"
        if not (d / "metadata.json").exists():
            size = (self.shipped / "model_int8.tflite").stat().st_size
            make_model_dir(d, version=f"1.{version}.0", size=size, seed=version)
        return d

    def bundle(
        self,
        out: Path,
        *,
        version: int,
        base: int = 0,
        payload_url: str = "",
        update_id: str | None = None,
        expires_in_s: float = 7 * 86400.0,
    ) -> Path:
        """A signed delta bundle from model `base` to model `version` (the project's own
        `make_bundle`: real delta, real Ed25519 signature); its path."""
        make_bundle(
            self.model(base),
            self.model(version),
            [self.key],
            out,
            version=version,
            update_id=update_id,
            payload_url=payload_url,
            expires_in_s=expires_in_s,
        )
        return out


def untrusted_keys_dir(directory: Path) -> Path:
    """A trusted keys directory holding only a stranger's key: the `reject` devices' view."""
    directory.mkdir(parents=True, exist_ok=True)
    stranger = Ed25519PrivateKey.generate()
    (directory / "other.pub").write_text(keys.public_line(stranger.public_key(), "other"))
    return directory


def raise_nofile(need: int) -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to at least `need` (up to the hard
    limit); the limit in force. Children (mosquitto) inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft


@contextlib.contextmanager
def scratch_root(fallback: Path) -> Iterator[Path]:
    """A directory for many device state directories: on tmpfs (/dev/shm) when there is one,
    as fsync there costs nothing (a thousand updaters fsync every record on one event loop),
    else `fallback`. Removed afterwards when it was made here."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        import tempfile

        d = Path(tempfile.mkdtemp(prefix="fleetsim-", dir=shm))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)
    else:
        fallback.mkdir(parents=True, exist_ok=True)
        yield fallback


class _PollSelect:
    """`select.select`'s interface over poll(2). paho's `loop()` waits with select(), which
    cannot watch a descriptor above 1023 (FD_SETSIZE): it returns "connection lost" for every
    client past ~330 in one process (each holds 3 descriptors: its socket and a socketpair).
    A device runs one client per process and never gets near; the simulator, with a thousand
    in one process, gives paho this instead (`use_poll_in_paho`): same results, no limit."""

    error = OSError

    @staticmethod
    def select(
        rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any], timeout: float | None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        import select

        poll = select.poll()
        mask: dict[int, int] = {}
        objs: dict[int, Any] = {}
        for flag, items in ((select.POLLIN | select.POLLPRI, rlist), (select.POLLOUT, wlist)):
            for obj in items:
                fd = obj if isinstance(obj, int) else obj.fileno()
                if fd < 0:
                    raise ValueError("file descriptor cannot be a negative integer")
                mask[fd] = mask.get(fd, 0) | flag
                objs[fd] = obj
        for fd, m in mask.items():
            poll.register(fd, m)
        ready = dict(poll.poll(None if timeout is None else timeout * 1000.0))
        gone = select.POLLHUP | select.POLLERR | select.POLLNVAL
        readable = [
            o for o in rlist if ready.get(_fd(o), 0) & (select.POLLIN | select.POLLPRI | gone)
        ]
        writable = [o for o in wlist if ready.get(_fd(o), 0) & (select.POLLOUT | gone)]
        return readable, writable, []


def _fd(obj: Any) -> int:
    return obj if isinstance(obj, int) else int(obj.fileno())


def use_poll_in_paho() -> None:
    """Make paho's network loop wait with poll(2) (`_PollSelect`), in this process."""
    import paho.mqtt.client as paho_client

    paho_client.select = _PollSelect  # type: ignore[attr-defined,assignment]


# ----------------------------------------------------------------------------- the stub engine


class _StallBlocks:
    """Block requests that are never answered (each waits a little, then times out)."""

    def __init__(self, stop: threading.Event, wait_s: float = 1.0) -> None:
        self._stop = stop
        self._wait_s = wait_s

    def fetch_block(self, request: opb.BlockRequest, timeout_s: float) -> opb.Block | None:
        self._stop.wait(min(timeout_s, self._wait_s))
        return None


class _CorruptBlocks:
    """The link's blocks with one byte flipped: the payload's sha256 will not match."""

    def __init__(self, link: FleetLink) -> None:
        self._link = link

    def fetch_block(self, request: opb.BlockRequest, timeout_s: float) -> opb.Block | None:
        block = self._link.fetch_block(request, timeout_s)
        if block is not None and block.data:
            data = bytearray(block.data)
            data[0] ^= 0xFF
            block.data = bytes(data)
        return block


@dataclass
class _Runtime:
    """What the simulator knows of one device (mutated on the event loop thread only)."""

    spec: SimDevice
    state_dir: Path
    offers: int = 0
    last_phase: str = ""
    last_status: fpb.UpdateStatus | None = None
    online: bool = False
    agent: FleetAgent | None = None
    updater: Updater | None = None
    engine: SimEngine | None = None
    hung: list[asyncio.Future[None]] = dataclasses.field(default_factory=list)
    vanished: bool = False  # an ``offline`` device has gone away on its first offer


class SimEngine:
    """The stub daemon of one device: `FleetBackend` (status, model info, reload, offers) and
    `UpdateHost` (install context, activate, trial checks, reports)."""

    def __init__(self, sim: FleetSim, rt: _Runtime, updater: Updater, serving: ModelRef) -> None:
        self._sim = sim
        self._rt = rt
        self._updater = updater
        self.serving = serving
        self._name = load_model_dir(Path(serving.model_dir)).name
        self.fleet: FleetAgent | None = None
        self._started = time.monotonic()
        self.state = "serving"

    # ------------------------------------------------------------------ FleetBackend

    def model_info(self) -> ModelInfo:
        ref = self.serving
        return ModelInfo(
            digest=_digest_of(ref.model_dir),
            name=self._name,
            version=ref.label or str(ref.version),
            quantization=ref.quantization,
            sha256=ref.sha256,
            path=Path(ref.model_dir),
            vocab_size=4096,
            context_length=1024,
            kv_layout="split",
            signatures=("prefill_32", "decode"),
            accelerator="cpu",
            execution_path="sim",
            fallbacks=(),
            memory=MemoryPlan(
                weights=4 * MIB,
                packed_weights=0,
                activations=MIB,
                kv_per_session=MIB,
                sessions=2,
                budget=512 * MIB,
            ),
        )

    def status(self) -> AgentStatus:
        info = self.model_info()
        zero = Percentiles(0.0, 0.0)
        return AgentStatus(
            profile=PROFILE,
            version=__version__,
            state=self.state,
            uptime_s=time.monotonic() - self._started,
            rss_bytes=64 * MIB,
            budget_bytes=info.memory.budget,
            planned_bytes=info.memory.total,
            model=f"{info.name} {info.version} {info.quantization}",
            active_sessions=0,
            engine=EngineStats(
                queue_depth=0,
                queue_capacity=16,
                active=0,
                max_active=4,
                requests_total=0,
                requests_failed=0,
                requests_rejected=0,
                requests_cancelled=0,
                tokens_generated=0,
                ttft_ms=zero,
                decode_tok_s=zero,
                heartbeat_age_s=0.0,
            ),
            info=info,
            fleet_link="connected" if self.fleet and self.fleet.link.connected else "disconnected",
        )

    async def reload(self) -> fpb.ReloadDone:
        info = self.model_info()
        return fpb.ReloadDone(
            ok=True,
            message="model and profile unchanged",
            model=f"{info.name} {info.version} {info.quantization}",
        )

    async def offer_update(self, signed: bytes) -> fpb.UpdateStatus:
        self._rt.offers += 1
        return await self._updater.offer(signed)

    async def cancel_update(self, signed: bytes) -> fpb.UpdateStatus:
        return await self._updater.cancel(signed)

    # ------------------------------------------------------------------ UpdateHost

    def install_context(self, installed: ModelRef) -> InstallContext:
        return InstallContext(
            model_name=self._name,
            installed_version=installed.version,
            installed_sha256=installed.sha256,
            profile=PROFILE,
            arch=platform.machine(),
            agent_version=__version__,
            finished_update_ids=frozenset(self._updater.installed().finished),
            max_payload_bytes=self._updater.config.max_payload_bytes,
        )

    async def activate(self, ref: ModelRef, canary: opb.Canary | None) -> None:
        problem = ref.verify()  # the model's file is there with its sha256
        if problem is not None:
            raise AgentError(problem)
        if self._sim.activate_s:
            await asyncio.sleep(self._sim.activate_s)  # "loading"
        if self._rt.spec.device_id in self._sim.held:  # the test keeps its wave open
            while not self._sim._released.is_set():
                await asyncio.sleep(0.05)
        self.serving = ref
        self._name = load_model_dir(Path(ref.model_dir)).name

    async def check_serving(self, canary: opb.Canary | None) -> str | None:
        if self._rt.spec.behaviour == "crashloop" and self.serving != self._updater.shipped:
            log.info("fleetsim: %s crashes in its trial", self._rt.spec.device_id)
            hang: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._rt.hung.append(hang)
            self._sim._crash_soon(self._rt)
            await hang  # the process is gone: its power cut cancels this
        if self._rt.spec.behaviour == "rollback" and self.serving != self._updater.shipped:
            return "the engine thread has not answered for 12.0 s (simulated crash loop)"
        return None

    def report(self, status: fpb.UpdateStatus, key: str = "") -> None:
        self._rt.last_status = status
        self._rt.last_phase = fpb.UpdateStatus.Phase.Name(status.phase).lower()
        if self.fleet is not None:
            self.fleet.report_update(status, key)

    def remove_unused_caches(self) -> None:
        pass


class _SimUpdater(Updater):
    """The real updater; for the `stall` and `fail` behaviours with a payload URL (the MQTT
    transport is faulted in the block source instead) the download step misbehaves."""

    behaviour = "ok"

    async def _download(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        if m.payload_url and self.behaviour == "stall":
            while True:  # a transfer that hangs; a cancel ends it (rejected, `cancelled`)
                self.interrupt.check()
                await self.interrupt.pause(3600.0)
        if m.payload_url and self.behaviour == "fail":
            part = self.store.payload_path(m.update_id)  # a damaged partial file, whole size
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(bytes(m.payload_size))
        await super()._download(rec, m)


# ----------------------------------------------------------------------------- presence


class _Observer:
    """Follows the retained state of this simulator's devices (one client, QoS 1). Only its
    own: with several simulator processes, each following every device's state made the
    broker send each birth to every one of them, and mosquitto drops what a client has not
    taken past `max_queued_messages` (1,000): at 10,000 devices a shard never saw births it
    waited for."""

    def __init__(self, opts: MqttOptions, prefix: str, device_ids: Sequence[str]) -> None:
        self._prefix = prefix
        self._device_ids = tuple(device_ids)
        self._cv = threading.Condition()
        self.states: dict[str, tuple[int, int]] = {}  # device -> (kind, session)
        self._client = new_client(
            f"fleetsim-observer-{os.getpid()}-{id(self)}", opts, persistent=False
        )
        self._client.on_message = self._on_message
        self._client.on_connect = self._on_connect
        self._subscribed = threading.Event()
        b = opts.broker
        self._client.connect(b.host, b.port, 60)
        self._client.loop_start()
        if not self._subscribed.wait(10):
            raise AgentError(f"fleetsim: cannot subscribe at {b.url()}")

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        client.subscribe([(f"{self._prefix}/{d}/state", 1) for d in self._device_ids])
        client.on_subscribe = lambda *_a: self._subscribed.set()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            state = fpb.DeviceState.FromString(bytes(msg.payload))
        except DecodeError:
            return
        device = msg.topic.split("/")[-2]
        with self._cv:
            self.states[device] = (state.state, state.session)
            self._cv.notify_all()

    def wait(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(pred, timeout_s)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


# ----------------------------------------------------------------------------- the simulator


class FleetSim:
    """`devices` as real fleet agents and updaters in this process (module docstring)."""

    def __init__(
        self,
        broker_url: str,
        root: Path,
        devices: Sequence[SimDevice],
        *,
        trusted_keys_dir: Path,
        shipped: Path | ModelRef,
        health_interval_s: float = 5.0,
        protocol: str = "5",
        prefix: str = PREFIX,
        trial_s: float = 1.0,
        retry_s: float = 5.0,
        max_download_attempts: int = 20,
        activate_s: float = 0.0,
        tick_s: float = 1.0,
        loop_s: float | None = None,
        batch: int = 50,
        workers: int = 16,
    ) -> None:
        ids = [d.device_id for d in devices]
        if len(set(ids)) != len(ids):
            raise ValueError("fleetsim: device ids must be unique")
        self.root = root
        self.prefix = prefix
        self.activate_s = activate_s
        self.held: frozenset[str] = frozenset()  # devices whose activation waits for release()
        self._released = threading.Event()
        self.tick_s = tick_s
        self.loop_s = loop_s  # each link's longest poll (None: the link's own)
        self.batch = batch
        self.shipped = shipped if isinstance(shipped, ModelRef) else model_ref(shipped)
        self.fleet = FleetConfig(
            broker=parse_broker("fleetsim", "broker", broker_url),
            protocol=protocol,
            topic_prefix=prefix,
            keepalive_s=60,
            health_interval_s=health_interval_s,
            health_min_interval_s=min(1.0, health_interval_s),
        )
        self.updates = UpdatesConfig(
            trusted_keys_dir=trusted_keys_dir,
            trial_s=trial_s,
            progress_interval_s=5.0,
            retry_s=retry_s,
            max_download_attempts=max_download_attempts,
            clock="trusted",  # a simulated board's clock is this machine's, taken as right
        )
        self.nofile = raise_nofile(6 * len(devices) + 256)  # socket, paho's and the link's pairs
        use_poll_in_paho()
        root.mkdir(parents=True, exist_ok=True)
        self._untrusted = untrusted_keys_dir(root / "untrusted-keys")
        self._sys_root = root / "sys"  # no thermal zones: nothing to read per tick
        self._sys_root.mkdir(exist_ok=True)
        self._devices = {d.device_id: _Runtime(d, root / "devices" / d.device_id) for d in devices}
        self._stopping = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "fleetsim-io")
        self._loop.set_default_executor(self._pool)
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleetsim-loop")
        self._ticker: concurrent.futures.Future[None] | None = None
        self._observer: _Observer | None = None
        self.started_s = 0.0  # how long start() took

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 600) -> None:
        """Start every device with `start_online`, in batches of `batch`; return when each
        one's birth (ONLINE, its current session) is on the broker. `timeout_s` is a limit for
        a device that never comes up, never a speed: a thousand devices take 10 s on an idle
        machine and several times that beside other work."""
        t0 = time.monotonic()
        self._thread.start()
        self._observer = _Observer(
            MqttOptions.from_config(self.fleet), self.prefix, list(self._devices)
        )
        self._ticker = asyncio.run_coroutine_threadsafe(self._tick_forever(), self._loop)
        deadline = time.monotonic() + timeout_s
        todo = [rt for rt in self._devices.values() if rt.spec.start_online]
        for i in range(0, len(todo), self.batch):
            part = todo[i : i + self.batch]
            for rt in part:
                self._call(self._boot(rt), deadline)
            self._wait_born(part, deadline)
        self.started_s = time.monotonic() - t0
        log.info("fleetsim: %d devices online in %.1f s", len(todo), self.started_s)

    def stop(self) -> None:
        """Stop every online device cleanly (its last health, OFFLINE, a clean disconnect),
        then the event loop and the observer."""
        self._stopping.set()
        online = [rt for rt in self._devices.values() if rt.online]
        list(self._pool.map(self._clean_stop, online))
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        if not self._loop.is_running():
            self._loop.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._observer is not None:
            self._observer.close()
            self._observer = None

    def __enter__(self) -> FleetSim:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ control and queries

    def device_ids(self) -> list[str]:
        return list(self._devices)

    def go_offline(self, device_id: str, timeout_s: float = 30) -> None:
        """The device loses power: its connection drops without a DISCONNECT (the broker
        publishes its Last Will, `LOST`), its updater stops where it is. Returns once the
        Will is on the broker."""
        rt = self._devices[device_id]
        session = self._power_cut(rt)
        self._wait_state(rt, Kind.LOST, session, time.monotonic() + timeout_s)

    def come_online(self, device_id: str, timeout_s: float = 30) -> None:
        """The device starts again (as after a power cut): its updater boots from its record
        and resumes, its link reconnects with the next session number. Returns once its birth
        is on the broker."""
        rt = self._devices[device_id]
        if rt.online:
            return
        deadline = time.monotonic() + timeout_s
        self._call(self._boot(rt), deadline)
        self._wait_born([rt], deadline)

    def hold(self, device_ids: Sequence[str]) -> None:
        """These devices' updates wait before activating until `release()`: a wave that
        offered one of them cannot end, however slow or fast the rest of the fleet is."""
        self.held = frozenset(device_ids)
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def offers(self, device_id: str) -> int:
        """How many `update` commands this device has received (across restarts)."""
        return self._devices[device_id].offers

    def phase(self, device_id: str) -> str:
        """The last update phase the device's updater reported (lowercase: ``received``,
        ``downloading``, …, ``committed``, ``rolled_back``, ``rejected``), or ""."""
        return self._devices[device_id].last_phase

    def last_status(self, device_id: str) -> fpb.UpdateStatus | None:
        """The last update status the device's updater reported (reason code included)."""
        return self._devices[device_id].last_status

    def version(self, device_id: str) -> str:
        """The version label of the model the device serves (from its store's pointer on disk,
        so also while it is offline): ``1.0.0`` as shipped, ``1.N.0`` after update N."""
        rt = self._devices[device_id]
        inst = Store(rt.state_dir).installed()
        ref = inst.current if inst is not None else self.shipped
        return ref.label or str(ref.version)

    def online(self, device_id: str) -> bool:
        return self._devices[device_id].online

    def threads(self) -> int:
        return threading.active_count()

    # ------------------------------------------------------------------ the event loop

    def _call(self, coro: Any, deadline: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(max(0.1, deadline - time.monotonic()))

    async def _boot(self, rt: _Runtime) -> None:
        """What the daemon's start does for the fleet and updates, with the stub engine:
        updater boot → fleet link → attach → resume."""
        spec = rt.spec
        rt.state_dir.mkdir(parents=True, exist_ok=True)
        updates = self.updates
        if spec.behaviour == "reject":
            updates = dataclasses.replace(updates, trusted_keys_dir=self._untrusted)
        updater = _SimUpdater(Store(rt.state_dir), updates, self.shipped)
        updater.behaviour = spec.behaviour
        serving = updater.boot()
        engine = SimEngine(self, rt, updater, serving)
        fleet = dataclasses.replace(
            self.fleet, device_id=spec.device_id, group=spec.group, tags=spec.tags
        )
        agent = FleetAgent(
            fleet, spec.device_id, rt.state_dir, engine, self._loop, sys_root=self._sys_root
        )
        engine.fleet = agent
        if self.loop_s is not None:
            agent.link.loop_s = self.loop_s
        rt.agent, rt.updater, rt.engine = agent, updater, engine
        if spec.behaviour == "offline" and not rt.vanished:
            self._vanish_on_offer(rt, agent.link)
        agent.start()
        rt.online = True
        updater.blocks = self._blocks(spec.behaviour, agent.link)
        updater.attach(engine)
        await updater.resume()

    def _blocks(self, behaviour: str, link: FleetLink) -> BlockSource:
        if behaviour == "stall":
            return _StallBlocks(self._stopping)
        if behaviour == "fail":
            return _CorruptBlocks(link)
        return link

    async def _tick_forever(self) -> None:
        """The daemon's tick, for every online device: health when due."""
        while True:
            await asyncio.sleep(self.tick_s)
            for rt in list(self._devices.values()):
                if rt.online and rt.agent is not None:
                    rt.agent.tick()

    async def _cancel_all(self) -> None:
        for rt in self._devices.values():
            for h in rt.hung:
                h.cancel()
            if rt.updater is not None:
                rt.updater.stop()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ presence

    def _born(self, rt: _Runtime) -> bool:
        assert self._observer is not None
        session = rt.agent.link.session if rt.agent is not None else 0
        return session > 0 and self._observer.states.get(rt.spec.device_id) == (
            Kind.ONLINE,
            session,
        )

    def _wait_born(self, rts: Sequence[_Runtime], deadline: float) -> None:
        assert self._observer is not None
        left = max(0.1, deadline - time.monotonic())
        if not self._observer.wait(lambda: all(self._born(rt) for rt in rts), left):
            missing = [rt.spec.device_id for rt in rts if not self._born(rt)]
            raise TimeoutError(f"fleetsim: no birth on the broker from {missing[:10]} ...")

    def _wait_state(self, rt: _Runtime, kind: int, session: int, deadline: float) -> None:
        assert self._observer is not None
        want = (kind, session)
        left = max(0.1, deadline - time.monotonic())
        if not self._observer.wait(lambda: self._observer_state(rt) == want, left):
            raise TimeoutError(
                f"fleetsim: {rt.spec.device_id}: no {Kind.Kind.Name(kind)} state for session "
                f"{session} (have {self._observer_state(rt)})"
            )

    def _observer_state(self, rt: _Runtime) -> tuple[int, int] | None:
        assert self._observer is not None
        return self._observer.states.get(rt.spec.device_id)

    # ------------------------------------------------------------------ going away

    def _crash_soon(self, rt: _Runtime) -> None:
        """From the event loop: the process dies and is started again, from a worker thread."""
        self._loop.run_in_executor(None, self._crash_and_restart, rt)

    def _crash_and_restart(self, rt: _Runtime) -> None:
        self._power_cut(rt)
        rt.hung.clear()
        if self._stopping.wait(RESTART_S):
            return
        self._call(self._boot(rt), time.monotonic() + 30)

    def _vanish_on_offer(self, rt: _Runtime, link: FleetLink) -> None:
        """An ``offline`` device loses power on its first offer, inside paho's message
        callback: the socket is shut before the callback returns, so the PUBACK paho queues
        after it can never reach the broker (the offer stays unacknowledged in the session,
        whatever the machine's load), and the link's thread is ended from a worker."""
        client = link._client
        deliver = client.on_message
        assert deliver is not None  # the link's own callback
        offer = link.topics.command("update")

        def on_message(c: Any, userdata: Any, msg: Any) -> None:
            if msg.topic != offer or rt.vanished:
                deliver(c, userdata, msg)
                return
            rt.vanished = True
            rt.offers += 1
            log.info("fleetsim: %s goes away on the offer", rt.spec.device_id)
            link._stop.set()
            sock = client.socket()
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._power_cut_soon(rt)

        client.on_message = on_message

    def _power_cut_soon(self, rt: _Runtime) -> None:
        """From the event loop: cut the device's power from a worker thread."""
        self._loop.run_in_executor(None, self._power_cut, rt)

    def _power_cut(self, rt: _Runtime) -> int:
        """Drop the connection the way a power cut does (no DISCONNECT: the broker sends the
        Will), end the link's thread without a reconnect, stop the updater. Its session."""
        agent, updater = rt.agent, rt.updater
        if not rt.online or agent is None:
            return 0
        rt.online = False
        link = agent.link
        session = link.session
        # the link's own stop() says goodbye cleanly (OFFLINE); a power cut does not: stop
        # its thread from reconnecting and cut the socket under it
        link._stop.set()
        sock = link._client.socket()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        link._wake_up()
        link._thread.join(10)
        with contextlib.suppress(Exception):
            link._client._sock_close()
        if updater is not None:
            self._loop.call_soon_threadsafe(updater.stop)
        for h in rt.hung:
            self._loop.call_soon_threadsafe(h.cancel)
        log.info("fleetsim: %s lost power (session %d)", rt.spec.device_id, session)
        return session

    def _clean_stop(self, rt: _Runtime) -> None:
        agent = rt.agent
        if agent is None or not rt.online:
            return
        rt.online = False
        if rt.updater is not None:
            self._loop.call_soon_threadsafe(rt.updater.stop)
        try:
            agent.stop()
        except Exception:  # a device that cannot say goodbye must not stop the others
            log.exception("fleetsim: %s did not stop cleanly", rt.spec.device_id)


# ----------------------------------------------------------------------------- many processes


PER_PROCESS: Final = 1000  # devices per simulator process in `FleetShards` (one thread each)


class FleetShards:
    """`devices` split over `processes` child processes (spawned), each a `FleetSim` of its
    share: one process holds a thread and three descriptors per device, and one interpreter's
    GIL runs them all, so 10,000 devices are ten processes of 1,000 (bench_fleet.py). Same
    arguments as FleetSim; the queries are per fleet (`phases`, `offer_counts`), one round
    trip per process. `pids` are the children's, for their CPU and RSS."""

    def __init__(
        self,
        broker_url: str,
        root: Path,
        devices: Sequence[SimDevice],
        *,
        processes: int = 0,  # 0: one per PER_PROCESS devices
        start_timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        n = processes or max(1, -(-len(devices) // PER_PROCESS))
        self.shares = [list(devices[i::n]) for i in range(n)]
        self.broker_url, self.root, self.kwargs = broker_url, root, kwargs
        self.start_timeout_s = start_timeout_s
        self.pids: list[int] = []
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self.started_s = 0.0

    def start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        t0 = time.monotonic()
        for k, share in enumerate(self.shares):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_shard_main, name=f"fleetsim-{k}",
                args=(theirs, self.broker_url, self.root / f"shard-{k}", share, self.kwargs),
            )  # fmt: skip
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)
            self.pids.append(int(proc.pid or 0))
        for conn in self._conns:
            if not conn.poll(self.start_timeout_s):
                raise TimeoutError("fleetsim: a shard did not start in time")
            try:
                what, value = conn.recv()
            except EOFError:
                what, value = "error", "a shard process exited while starting"
            if what != "ready":
                raise RuntimeError(f"fleetsim shard: {value}")
        self.started_s = time.monotonic() - t0

    def _ask(self, what: str) -> list[Any]:
        for conn in self._conns:
            conn.send(what)
        return [conn.recv() for conn in self._conns]

    def phases(self) -> dict[str, str]:
        return {k: v for part in self._ask("phases") for k, v in part.items()}

    def offer_counts(self) -> dict[str, int]:
        return {k: v for part in self._ask("offers") for k, v in part.items()}

    def threads(self) -> int:
        return sum(self._ask("threads"))

    def stop(self) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            with contextlib.suppress(OSError, EOFError):
                conn.send("stop")
                conn.poll(120) and conn.recv()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns, self._procs = [], []

    def __enter__(self) -> FleetShards:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _shard_main(
    conn: Any, broker_url: str, root: Path, devices: list[SimDevice], kwargs: dict[str, Any]
) -> None:
    """A `FleetShards` child: its FleetSim, then answers to the parent until "stop"."""
    logging.basicConfig(level=logging.WARNING)
    try:
        sim = FleetSim(broker_url, root, devices, **kwargs)
        sim.start(timeout_s=600)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("ready", sim.started_s))
    answers: dict[str, Callable[[], Any]] = {
        "phases": lambda: {d: sim.phase(d) for d in sim.device_ids()},
        "offers": lambda: {d: sim.offers(d) for d in sim.device_ids()},
        "threads": sim.threads,
    }
    try:
        while (what := conn.recv()) != "stop":
            conn.send(answers[what]())
    finally:
        sim.stop()
        conn.send("stopped")
