"""The operator's MQTT link: one connected, short-lived, non-persistent paho client driven from
the calling thread (`client.loop`), so there is no network thread and nothing to lock: callbacks
run inside `_Link.pump`. Foreign errors (socket, TLS, broker refusals) become `FleetError` here.
With several brokers (a cluster's nodes) `connect` takes the first that answers, so every
reconnect of the tools that hold a link (watch, send, a rollout) fails over to a live node.
`agent.operator.client` (watch, send) and `agent.operator.publish` talk to the broker through it.
"""

from __future__ import annotations

import logging
import secrets
import ssl
import time
from collections.abc import Callable
from typing import Any, Final

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.reasoncodes import ReasonCode

from agent.base.errors import AgentError
from agent.config.fleet import Broker
from agent.fleet.codec import PayloadError
from agent.fleet.mqtt import MqttOptions, decode_message, new_client
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

log = logging.getLogger(__name__)

_PUMP_S: Final = 0.1


class FleetError(AgentError):
    """The broker could not be reached or refused us, or a device did not answer in time."""


class _Timeout(FleetError):
    pass


def read_answer(
    opts: MqttOptions, msg: mqtt.MQTTMessage, correlation: bytes, command: str
) -> pb.CommandResponse | None:
    """The `CommandResponse` in `msg` if it answers our `command` (MQTT 5: with our
    `correlation` data), else None with a log line saying why it was ignored."""
    if opts.v5:
        corr = getattr(msg.properties, "CorrelationData", None)
        if corr is None or bytes(corr) != correlation:
            log.info("ignoring a response on %s with other correlation data", msg.topic)
            return None
    try:
        resp = decode_message(pb.CommandResponse, msg)
    except PayloadError as exc:
        log.warning("ignoring a malformed response on %s: %s", msg.topic, exc)
        return None
    if resp.command and resp.command != command:
        log.info("ignoring a response to %r on %s", resp.command, msg.topic)
        return None
    return resp


def _tls_reason(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the broker's certificate was not accepted ({exc.verify_message}); check --ca-file"
    return f"{exc.reason or exc}; check --ca-file, --cert-file and --key-file"


class _Link:
    """One connected client, pumped by the caller. `on_message` runs inside `pump`."""

    def __init__(
        self, opts: MqttOptions, client_id: str, on_message: Callable[[mqtt.MQTTMessage], None]
    ) -> None:
        self.opts = opts
        self.url = opts.broker.url()
        self._client_id, self._on_message = client_id, on_message
        self.client = self._new_client()
        self._tried = False  # a connect was attempted with `client` (paho: no second timeout)
        self._connack: ReasonCode | None = None
        self._gone: str | None = None
        self._error: str | None = None  # paho's first error log line: the socket/TLS reason
        self.connected_once = False  # a CONNACK came: later errors are a lost connection
        self._subacks: dict[int, list[ReasonCode]] = {}
        self._pubacks: dict[int, ReasonCode] = {}

    def _new_client(self) -> mqtt.Client:
        client = new_client(self._client_id, self.opts, persistent=False)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        on_message = self._on_message
        client.on_message = lambda _c, _u, msg: on_message(msg)
        client.on_log = self._on_log
        return client

    # paho callbacks (CallbackAPIVersion.VERSION2)
    def _on_connect(self, _c: Any, _u: Any, _flags: Any, rc: ReasonCode, _p: Any) -> None:
        self._connack = rc
        self._error = None

    def _on_disconnect(self, _c: Any, _u: Any, _flags: Any, rc: ReasonCode, _p: Any) -> None:
        self._gone = str(rc)

    def _on_log(self, _c: Any, _u: Any, level: int, text: str) -> None:
        if level == mqtt.MQTT_LOG_ERR and self._error is None:  # the first is the cause
            self._error = text

    def _why(self, rc: MQTTErrorCode) -> str:
        return self._error or self._gone or mqtt.error_string(rc)

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, rcs: list[ReasonCode], _p: Any) -> None:
        self._subacks[mid] = rcs

    def _on_publish(self, _c: Any, _u: Any, mid: int, rc: ReasonCode, _p: Any) -> None:
        self._pubacks[mid] = rc

    def connect(self, deadline: float) -> None:
        """Connect to the first of `opts.brokers` that answers, each given an equal share of
        the time left (a dead node refuses at once; a silent one costs its share)."""
        brokers = self.opts.brokers
        errors: list[FleetError] = []
        for i, broker in enumerate(brokers):
            left = len(brokers) - i
            until = time.monotonic() + (deadline - time.monotonic()) / left
            try:
                self._connect(broker, deadline if left == 1 else until)
                return
            except FleetError as exc:
                errors.append(exc)
                if left > 1:
                    log.warning("%s; trying %s", exc, brokers[i + 1].url())
        if len(errors) == 1:
            raise errors[0]
        raise FleetError("no broker answered: " + "; ".join(str(e) for e in errors))

    def _connect(self, b: Broker, deadline: float) -> None:
        """Open the connection to `b` and wait for its CONNACK."""
        self.url = b.url()
        if self._tried:  # the next node: a fresh client (paho refuses a new connect_timeout)
            self.close()
            self.client = self._new_client()
        self._tried = True
        self._connack, self._gone, self._error = None, None, None
        self.client.connect_timeout = max(0.1, deadline - time.monotonic())
        try:
            self.client.connect(b.host, b.port, keepalive=self.opts.keepalive_s)
        except ssl.SSLError as exc:
            raise FleetError(f"cannot connect to {self.url}: TLS: {_tls_reason(exc)}") from exc
        except OSError as exc:
            raise FleetError(f"cannot connect to {self.url}: {exc.strerror or exc}") from exc
        try:
            self.pump_until(lambda: self._connack is not None, deadline)
        except _Timeout as exc:
            raise FleetError(f"cannot connect to {self.url}: no answer to CONNECT") from exc
        except FleetError as exc:
            hint = ""
            if self.opts.broker.tls:
                hint = (
                    "; the broker may not accept our client certificate (--cert-file, --key-file)"
                )
            raise FleetError(
                f"cannot connect to {self.url}: the broker closed the connection "
                f"({self._why(mqtt.MQTT_ERR_CONN_LOST)}){hint}"
            ) from exc
        assert self._connack is not None
        if self._connack.is_failure:
            raise FleetError(f"{self.url} refused the connection: {self._connack}")
        self.connected_once = True
        log.info("connected to %s", self.url)

    def subscribe(self, filters: list[tuple[str, int]], deadline: float) -> None:
        """Subscribe and wait for the SUBACK; refused filters are an error."""
        rc, mid = self.client.subscribe(filters)
        self._check(rc, "subscribe")
        assert mid is not None
        try:
            self.pump_until(lambda: mid in self._subacks, deadline)
        except _Timeout as exc:
            raise FleetError(f"{self.url} did not acknowledge our subscription") from exc
        refused = [
            f"{f} ({code})"
            for (f, _), code in zip(filters, self._subacks.pop(mid), strict=False)
            if code.is_failure
        ]
        if refused:
            raise FleetError(f"{self.url} refused the subscription to {', '.join(refused)}")

    def publish(self, topic: str, payload: bytes, props: Any, deadline: float) -> None:
        """Publish with QoS 1 and wait for the broker's PUBACK."""
        info = self.client.publish(topic, payload, qos=1, properties=props)
        self._check(info.rc, "publish")
        try:
            self.pump_until(lambda: info.mid in self._pubacks, deadline)
        except _Timeout as exc:
            raise FleetError(f"{self.url} did not acknowledge our publish to {topic}") from exc
        code = self._pubacks.pop(info.mid)
        if code.is_failure:
            raise FleetError(f"{self.url} refused our publish to {topic}: {code}")

    @property
    def lost(self) -> bool:
        """Whether the connection went away (not: the broker refused one request)."""
        return self._gone is not None or not self.client.is_connected()

    def _check(self, rc: MQTTErrorCode, what: str) -> None:
        if rc != mqtt.MQTT_ERR_SUCCESS:
            raise FleetError(f"cannot {what} on {self.url}: {self._why(rc)}")

    def pump(self, seconds: float) -> None:
        """Handle network traffic for up to `seconds`; raise if the connection is gone."""
        rc = self.client.loop(timeout=max(0.0, seconds))
        if rc != mqtt.MQTT_ERR_SUCCESS or self._gone is not None:
            raise FleetError(f"lost the connection to {self.url}: {self._why(rc)}")

    def pump_until(self, done: Callable[[], bool], deadline: float) -> None:
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout("timed out")
            self.pump(min(left, _PUMP_S))

    def close(self) -> None:
        """Disconnect cleanly if connected, close the socket, break the callback cycle."""
        try:
            if self._connack is not None and not self._connack.is_failure and self._gone is None:
                self.client.disconnect()
                self.client.loop(0.05)  # writes the DISCONNECT
        finally:
            sock = self.client.socket()
            if sock is not None:
                sock.close()
            self.client.on_connect = self.client.on_disconnect = None
            self.client.on_subscribe = self.client.on_publish = self.client.on_message = None
            self.client.on_log = None


def _client_id(role: str) -> str:
    return f"edge-agent-{role}-{secrets.token_hex(6)}"
