"""The console's live fleet: one MQTT connection in a thread of its own, subscribed to every
device's `state` and `health` (as `fleet watch` is), keeping a `FleetView` and each device's
health history current; reconnecting with backoff (1 s doubling to 30 s, the node that answers
first: a cluster fails over) when the broker goes away. The web pages read snapshots of it under
`lock`; messages are handled one at a time in the feed's thread, so a page never sees half of
one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

import paho.mqtt.client as mqtt

from agent.fleet.codec import PayloadError, decode
from agent.fleet.mqtt import MqttOptions, payload_content, payload_type
from agent.fleet.topics import parse
from agent.operator.client import _reconnect
from agent.operator.console.history import HealthHistory
from agent.operator.link import _PUMP_S, FleetError, _client_id, _Link
from agent.operator.rollout.figures import Figures
from agent.operator.view import FleetView
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S: Final = 10.0


class LiveFleet:
    """The fleet as heard since `start`; `lock` guards `view`, `history` and `status`."""

    def __init__(
        self, opts: MqttOptions, prefix: str, history: HealthHistory, stale_after_s: float
    ) -> None:
        self.opts, self.prefix = opts, prefix
        self.view = FleetView(prefix, stale_after_s)
        self.history = history
        self.lock = threading.Lock()
        self.status = "connecting"  # "connected to URL" | "DISCONNECTED: why; retrying ..."
        self.failed = 0  # messages that raised in `handle` (logged once), ignored
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ messages

    def handle(self, topic: str, payload: bytes, at: float, *, retained: bool,
               message_type: str | None = None, content: object = None) -> None:  # fmt: skip
        """One message (from the feed's thread, or a test): the view, then the history."""
        with self.lock:
            changed = self.view.update(
                topic, payload, at, retained=retained, message_type=message_type,
                content=content,  # type: ignore[arg-type]
            )  # fmt: skip
            if not changed:
                return
            p = parse(self.prefix, topic)
            if p is None or p.kind != "health" or not payload:
                return
            device = self.view.devices.get(p.device)
            if device is None or device.health is None:
                return
            run = None
            try:  # the figures the digest leaves out: the serving model's TTFT p95, probe NLL
                h = decode(pb.Health, payload, content)  # type: ignore[arg-type]
                run = Figures.from_pb(h.run) if h.HasField("run") else None
            except (PayloadError, ValueError, RuntimeError):
                pass  # the view accepted it: keep the digest's figures alone
            self.history.add(p.device, device.health, run, at)

    def _on_message(self, msg: mqtt.MQTTMessage) -> None:
        try:
            self.handle(
                msg.topic, bytes(msg.payload), time.time(), retained=bool(msg.retain),
                message_type=payload_type(msg), content=payload_content(msg),
            )  # fmt: skip
        except Exception:  # a message this code cannot take must not end the feed
            self.failed += 1
            if self.failed == 1:
                log.exception("console: a message on %s could not be handled", msg.topic)

    # ------------------------------------------------------------------ the connection

    def _open(self, deadline: float) -> _Link:
        link = _Link(self.opts, _client_id("console"), self._on_message)
        try:
            link.connect(deadline)
            filters = [(f"{self.prefix}/+/state", 0), (f"{self.prefix}/+/health", 0)]
            link.subscribe(filters, deadline)
        except BaseException:
            link.close()
            raise
        return link

    def connect(self) -> None:
        """The first connection, in the caller's thread: FleetError if no broker answers."""
        link = self._open(time.monotonic() + CONNECT_TIMEOUT_S)
        self._set_status(f"connected to {link.url}")
        self._thread = threading.Thread(
            target=self._run, args=(link,), name="console-feed", daemon=True
        )
        self._thread.start()

    def _set_status(self, text: str) -> None:
        with self.lock:
            self.status = text

    def _run(self, link: _Link) -> None:
        try:
            while not self._stop.is_set():
                try:
                    link.pump(_PUMP_S)
                except FleetError as exc:
                    log.warning("%s", exc)
                    link.close()
                    show: Callable[[str], None] = self._set_status
                    again = _reconnect(self._open, str(exc), show, self._stop)
                    if again is None:
                        return
                    link = again
                    self._set_status(f"connected to {link.url}")
        finally:
            link.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
