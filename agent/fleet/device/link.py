"""The agent's MQTT connection, on its own thread, so that nothing in the daemon ever waits for
the broker: reconnects with backoff, moving on to the next node of a broker cluster when its
node goes away, a persistent session, coalesced health and events that leave the outbox only
on PUBACK (`FleetLink`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import select
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from google.protobuf.message import Message as ProtoMessage

from agent.base.fsutil import atomic_write_bytes
from agent.fleet.codec import JSON, PayloadError, decode, sniff
from agent.fleet.device.outbox import Outbox
from agent.fleet.mqtt import (
    MqttOptions,
    connect_properties,
    decode_message,
    new_client,
    outgoing,
    payload_content,
    response_route,
)
from agent.fleet.topics import COMMAND_RE, Topics
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 120.0
LOOP_S = 5.0  # the longest an idle network thread sleeps (work wakes it at once)
_READ = select.POLLIN | select.POLLPRI
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL
# A JSON command is read if it is at most this many times `max_command_bytes` (base64 bodies,
# field names), and then its protobuf size counts against the limit.
JSON_READ_FACTOR = 2


class Backoff:
    """Exponential backoff with jitter: each delay is drawn from [d/2, d], d doubling from
    `lo` to `hi`; `reset` after a successful connection."""

    def __init__(self, lo: float = BACKOFF_MIN_S, hi: float = BACKOFF_MAX_S) -> None:
        self.lo, self.hi = lo, hi
        self._next = lo
        self._rng = random.Random()

    def delay(self) -> float:
        d = self._next
        self._next = min(self.hi, self._next * 2)
        return self._rng.uniform(d / 2, d)

    def reset(self) -> None:
        self._next = self.lo


class SessionCounter:
    """The connection number, persisted in the state directory (one small file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.value = int(path.read_text().strip() or 0)
        except (OSError, ValueError):
            self.value = 0

    def next(self) -> int:
        self.value += 1
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = f"{self.value}\n".encode()
            atomic_write_bytes(self.path, data)
        except OSError as exc:  # a read-only state dir must not stop the link
            log.warning("cannot persist the fleet session number in %s: %s", self.path, exc)
        return self.value


@dataclass(frozen=True, slots=True)
class Route:
    """Where a command's response goes."""

    topic: str
    correlation: bytes | None


Reply = Callable[[fpb.CommandResponse], None]
CommandHandler = Callable[[str, fpb.Command, Reply], None]


class FleetLink:
    """The MQTT client on its own thread:

    * Connect, and reconnect after any failure, with jittered exponential backoff (1 s doubling
      up to 2 min). With several brokers (the nodes of one cluster: `opts.brokers`) the first
      that answers is used; a failed connect or a lost connection moves on to the next one, in
      a ring, so a dead node costs one backoff delay. The jitter spreads a fleet that lost the
      same node over the others' first seconds. The paho client, its persistent session, the
      message in flight and the outbox are the same whichever node we reach.
    * Every connect is a new *session number* (persisted, so it grows across restarts): the
      Last Will ("lost") is set with it before connecting and the birth ("online") carries it.
    * MQTT 5 persistent session (clean start off, bounded expiry): commands sent while we were
      away are delivered when we are back, for as long as the broker keeps the session.
    * Health is coalesced: callers hand over the latest snapshot; only the newest one is
      published, when connected. Nothing accumulates while the broker is unreachable.
    * Events come from the on-disk `Outbox`, one in flight at a time, acknowledged (deleted) only
      on PUBACK: in order and none lost across a disconnect or a restart.
    * Commands arrive on this thread and are handed to `on_command` with a `reply` callable that
      any thread may call.
    * Everything goes out in `opts.encoding` (protobuf or its JSON mapping) with MQTT 5's
      Content-Type and Payload Format Indicator; commands and blocks are read in either encoding
      (`agent.fleet.codec`).
    """

    def __init__(
        self,
        opts: MqttOptions,
        topics: Topics,
        *,
        outbox: Outbox,
        session_counter: SessionCounter,
        state: Callable[[fpb.DeviceState.Kind, int], fpb.DeviceState],
        on_command: CommandHandler,
        session_expiry_s: int,
        max_command_bytes: int,
    ) -> None:
        self.opts = opts
        self.topics = topics
        self._outbox = outbox
        self._sessions = session_counter
        self._state = state
        self._on_command = on_command
        self._expiry = session_expiry_s
        self._max_command = max_command_bytes
        self._client = new_client(f"edge-agent-{topics.device}", opts, persistent=True)
        self._client.max_queued_messages_set(64)  # responses while disconnected, bounded
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_publish = self._on_publish
        self._lock = threading.Lock()
        self._health: fpb.Health | None = None  # the latest snapshot, not yet published
        self._event_mid: int | None = None  # the outbox event in flight (its MQTT message id)
        self._event_seq = 0
        self._blocks: dict[tuple[str, int], list[opb.Block]] = {}  # waiting block requests
        self._block_cv = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._connected = threading.Event()
        # wakes the network thread's poll; paho's write interest goes through it too
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._client.on_socket_register_write = self._wake_up
        self.session = 0
        self.connects = 0
        self._at = 0  # which of opts.brokers we connect to next (or are connected to)
        self.loop_s = LOOP_S  # the idle network thread's longest sleep (keepalive/4 if less)
        self._thread = threading.Thread(target=self._run, name="edge-agent-fleet", daemon=True)

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def broker_url(self) -> str:
        """The broker we are connected to, or will try next."""
        return self.opts.brokers[self._at].url()

    def set_health(self, health: fpb.Health) -> None:
        """Publish `health` when connected; a newer one replaces it if it is still waiting."""
        with self._lock:
            self._health = health
        self._wake_up()

    def events_added(self) -> None:
        self._wake_up()

    def reply(self, route: Route, response: fpb.CommandResponse) -> None:
        payload, props = outgoing(self.opts, response, correlation=route.correlation)
        self._client.publish(route.topic, payload, qos=1, properties=props)

    def fetch_block(self, request: opb.BlockRequest, timeout_s: float) -> opb.Block | None:
        """Ask the block server for one payload block; None if none came within `timeout_s`."""
        key = (request.update_id, request.offset)
        with self._block_cv:
            self._blocks[key] = []
        try:
            payload, props = outgoing(self.opts, request)
            self._client.publish(self.topics.block_request, payload, qos=1, properties=props)
            with self._block_cv:
                self._block_cv.wait_for(lambda: bool(self._blocks[key]), timeout_s)
                got = self._blocks[key]
                return got[0] if got else None
        finally:
            with self._block_cv:
                self._blocks.pop(key, None)

    def stop(self, timeout: float = 3.0) -> None:
        """Publish "offline" (when connected, waiting for its PUBACK up to `timeout`), then
        disconnect cleanly (no Will) and end the network thread."""
        if self.connected:
            msg = self._state(fpb.DeviceState.OFFLINE, self.session)
            info = self._publish(self.topics.state, msg, retain=True)
            try:
                info.wait_for_publish(timeout)
            except (ValueError, RuntimeError) as exc:
                log.warning("fleet: the offline state was not published: %s", exc)
            if not info.is_published():
                log.warning("fleet: no PUBACK for the offline state within %.1f s", timeout)
        self._stop.set()
        self._wake_up()
        self._thread.join(timeout + 2)
        self._client.on_socket_register_write = None  # no network thread: paho writes itself
        self._client.disconnect()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ network thread

    def _run(self) -> None:
        backoff = Backoff()
        failing = False
        while not self._stop.is_set():
            try:
                self._connect()
            except (OSError, ssl.SSLError, ValueError) as exc:
                if not failing or len(self.opts.brokers) > 1:
                    log.warning("fleet: cannot connect to %s: %s", self.broker_url, exc)
                failing = True
                self._next_broker()
                self._stop.wait(backoff.delay())
                continue
            for _ in self._serve():
                if failing:
                    failing = False
                backoff.reset()
            # an event in flight stays in flight: paho sends it again after the reconnect,
            # to whichever node answers
            self._connected.clear()
            if not self._stop.is_set():
                self._next_broker()
                self._stop.wait(backoff.delay())

    def _serve(self) -> Iterator[None]:
        """Run the connection until it fails or `stop()`: poll(2) on paho's socket and our wake
        pipe (paho's external-loop API), so that an idle link sleeps until the broker sends
        something, a caller has work for it, or `loop_s` passes (keepalive). Yields after
        each round in which it is connected and has pumped."""
        sock = self._client.socket()
        if sock is None:
            return
        fd = sock.fileno()
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        idle_ms = 1000.0 * min(self.loop_s, self.opts.keepalive_s / 4)
        pending = getattr(sock, "pending", None)  # TLS: bytes already decrypted, unread
        while not self._stop.is_set():
            poller.register(fd, _READ | (select.POLLOUT if self._client.want_write() else 0))
            buffered = pending is not None and pending() > 0
            ready = dict(poller.poll(0 if buffered else idle_ms))
            if self._wake_r.fileno() in ready:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
            rc = mqtt.MQTT_ERR_SUCCESS
            if buffered or ready.get(fd, 0) & (_READ | _GONE):
                rc = self._client.loop_read()
            if rc == mqtt.MQTT_ERR_SUCCESS and self._client.want_write():
                rc = self._client.loop_write()
            if rc == mqtt.MQTT_ERR_SUCCESS:
                rc = self._client.loop_misc()
            if rc != mqtt.MQTT_ERR_SUCCESS or self._client.socket() is not sock:
                return
            if self._connected.is_set():
                self._pump()
                yield

    def _wake_up(self, *_args: Any) -> None:
        """Any thread: the network thread has work (health, an event, a packet to write, stop).
        Also paho's `on_socket_register_write`, so a publish from another thread is written
        by the network thread at once."""
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _next_broker(self) -> None:
        """Move on to the next broker of the list (a ring); one broker: stay."""
        self._at = (self._at + 1) % len(self.opts.brokers)

    def _connect(self) -> None:
        self.session = self._sessions.next()
        will, props = outgoing(self.opts, self._state(fpb.DeviceState.LOST, self.session))
        self._client.will_set(self.topics.state, will, qos=1, retain=True, properties=props)
        b = self.opts.brokers[self._at]
        if self.opts.v5:
            self._client.connect(
                b.host,
                b.port,
                self.opts.keepalive_s,
                clean_start=False,
                properties=connect_properties(self.opts, self._expiry),
            )
        else:
            self._client.connect(b.host, b.port, self.opts.keepalive_s)

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, rc: Any, _p: Any) -> None:
        if rc.is_failure:
            log.error("fleet: broker %s refused the connection: %s", self.broker_url, rc)
            client.disconnect()
            return
        self.connects += 1
        log.info(
            "fleet: connected to %s as %s (session %d)",
            self.broker_url,
            self.topics.device,
            self.session,
        )
        client.subscribe([(self.topics.commands, 1), (self.topics.block_data, 1)])
        birth = self._state(fpb.DeviceState.ONLINE, self.session)
        self._publish(self.topics.state, birth, retain=True)
        self._connected.set()
        self._wake_up()

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        if self._connected.is_set():
            log.warning("fleet: disconnected from %s: %s", self.broker_url, rc)
        self._connected.clear()

    def _pump(self) -> None:
        """Publish the waiting health and the next event (one in flight)."""
        with self._lock:
            health, self._health = self._health, None
        if health is not None:
            self._publish(self.topics.health, health, retain=True)
        if self._event_mid is None:
            event = self._outbox.peek()
            if event is not None:
                topic = self.topics.update_status if event.HasField("update") else self.topics.event
                payload, props = outgoing(self.opts, event)
                info = self._client.publish(topic, payload, qos=1, properties=props)
                if info.rc == mqtt.MQTT_ERR_SUCCESS:
                    self._event_mid, self._event_seq = info.mid, event.seq

    def _publish(self, topic: str, msg: ProtoMessage, retain: bool) -> mqtt.MQTTMessageInfo:
        """Publish with QoS 1 (paho queues it while the socket is down)."""
        payload, props = outgoing(self.opts, msg)
        info = self._client.publish(topic, payload, qos=1, retain=retain, properties=props)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            log.warning("fleet: publishing %s failed: %s", topic, mqtt.error_string(info.rc))
        return info

    def _on_publish(self, _c: mqtt.Client, _u: Any, mid: int, _rc: Any, _p: Any) -> None:
        if mid == self._event_mid:
            self._outbox.ack(self._event_seq)
            self._event_mid = None
            self._wake_up()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic == self.topics.block_data:
            self._on_block(msg)
            return
        name = msg.topic.rsplit("/", 1)[-1]
        if msg.retain:
            # a retained command would run again on every reconnect: never act on one
            log.warning("fleet: ignored a retained command on %s", msg.topic)
            return
        topic, correlation = response_route(msg)
        command, problem = self._read_command(msg)
        if topic is None and command.reply_topic:  # MQTT 3.1.1 carries the route inside
            topic, correlation = command.reply_topic, command.correlation or None
        if topic is None:
            log.warning("fleet: command %s without a response topic; not answered", msg.topic)
            return
        if not topic.startswith(self.topics.base + "/resp/"):
            log.warning("fleet: response topic %r is outside %s/resp/", topic, self.topics.base)
            return
        route = Route(topic, correlation)
        if problem is None and not COMMAND_RE.fullmatch(name):
            problem = (fpb.CommandResponse.INVALID_ARGUMENT, f"bad command name {name!r}")
        if problem is not None:
            log.warning("fleet: command %s refused: %s", name, problem[1])
            self.reply(
                route, fpb.CommandResponse(code=problem[0], message=problem[1], command=name)
            )
            return
        log.info("fleet: command %s received", name)
        self._on_command(name, command, lambda response: self.reply(route, response))

    def _read_command(
        self, msg: mqtt.MQTTMessage
    ) -> tuple[fpb.Command, tuple[fpb.CommandResponse.Code, str] | None]:
        """The command in `msg`, or what is wrong with it. `max_command_bytes` counts the
        command as protobuf: a JSON payload up to JSON_READ_FACTOR times that is read first."""
        size, limit = len(msg.payload), self._max_command
        content = payload_content(msg)
        is_json = (content.encoding if content is not None else sniff(msg.payload)) == JSON
        too_big = (
            fpb.CommandResponse.RESOURCE_EXHAUSTED,
            f"command payload of {size} bytes is over the limit of {limit} bytes",
        )
        if size > limit * (JSON_READ_FACTOR if is_json else 1):
            return fpb.Command(), too_big
        try:
            command = decode(fpb.Command, bytes(msg.payload), content)
        except PayloadError as exc:
            invalid = fpb.CommandResponse.INVALID_ARGUMENT
            return fpb.Command(), (invalid, f"malformed Command: {exc}")
        if is_json and command.ByteSize() > limit:
            why = f"command of {command.ByteSize()} bytes (as protobuf) is over the limit of "
            return command, (fpb.CommandResponse.RESOURCE_EXHAUSTED, f"{why}{limit} bytes")
        return command, None

    def _on_block(self, msg: mqtt.MQTTMessage) -> None:
        try:
            block = decode_message(opb.Block, msg)
        except PayloadError as exc:
            log.warning("fleet: malformed update block ignored: %s", exc)
            return
        with self._block_cv:
            waiting = self._blocks.get((block.update_id, block.offset))
            if waiting is not None and not waiting:
                waiting.append(block)
                self._block_cv.notify_all()
