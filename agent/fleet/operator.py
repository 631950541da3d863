"""The operator's side of the fleet link: watch the fleet's retained state and health, and send
one command to one device and wait for its answer.

Each call owns one short-lived, non-persistent paho client driven from the calling thread
(`client.loop`), so there is no network thread and nothing to lock: callbacks run inside
`_Link.pump`. Foreign errors (socket, TLS, broker refusals) become `FleetError` here.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, TextIO

import paho.mqtt.client as mqtt
from google.protobuf.message import DecodeError
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.reasoncodes import ReasonCode

from agent.errors import AgentError
from agent.fleet.mqtt import MqttOptions, new_client, payload_type, publish_properties
from agent.fleet.topics import COMMAND_RE, Topics, check_device_id
from agent.fleet.watch import DEFAULT_STALE_AFTER_S, FleetView, Presence, age, render
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_SETTLE_S: Final = 1.0
DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_SEND_TIMEOUT_S: Final = 10.0
REDRAW_S: Final = 0.5  # the live table is drawn at most twice a second
REFRESH_S: Final = 2.0  # ... and at least this often, so that ages and staleness move
HEADER_LINES: Final = 3  # title, summary, column titles
MAX_BACKOFF_S: Final = 30.0
RECONNECT_TIMEOUT_S: Final = 10.0
_PUMP_S: Final = 0.1
COMMAND_TYPE: Final = pb.Command.DESCRIPTOR.full_name
State = pb.DeviceState


class FleetError(AgentError):
    """The broker could not be reached or refused us, or a device did not answer in time."""


class _Timeout(FleetError):
    pass


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
        self.client = new_client(client_id, opts, persistent=False)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_publish = self._on_publish
        self.client.on_message = lambda _c, _u, msg: on_message(msg)
        self.client.on_log = self._on_log
        self._connack: ReasonCode | None = None
        self._gone: str | None = None
        self._error: str | None = None  # paho's first error log line: the socket/TLS reason
        self._subacks: dict[int, list[ReasonCode]] = {}
        self._pubacks: dict[int, ReasonCode] = {}

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
        """Open the connection and wait for the broker's CONNACK."""
        self._connack, self._gone, self._error = None, None, None
        self.client.connect_timeout = max(0.1, deadline - time.monotonic())
        b = self.opts.broker
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


# ----------------------------------------------------------------------------- watch


def watch(
    opts: MqttOptions,
    prefix: str,
    *,
    once: bool,
    settle_s: float = DEFAULT_SETTLE_S,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    filter: str | None = None,
    out: TextIO | None = None,
    size: Callable[[], tuple[int, int]] | None = None,
    stop: threading.Event | None = None,
) -> FleetView:
    """Subscribe to every device's state and health under `prefix` and build the view.

    `once`: return when no new retained message arrived for `settle_s` (at most `timeout_s`
    after connecting). Otherwise redraw the table on `out` (default stdout; at most twice a
    second, sized by `size()` = (columns, lines), default the terminal) until Ctrl-C or `stop`
    is set, reconnecting with backoff if the broker goes away; returns the last view.
    """
    view = FleetView(prefix, stale_after_s)
    changed = [True]
    last_retained = [time.monotonic()]

    def on_message(msg: mqtt.MQTTMessage) -> None:
        received = time.time()
        if view.update(
            msg.topic,
            bytes(msg.payload),
            received,
            retained=bool(msg.retain),
            message_type=payload_type(msg),
        ):
            changed[0] = True
        if msg.retain:
            last_retained[0] = time.monotonic()

    # QoS 0: the retained copies come as one burst, not through a QoS 1 window of unacked
    # messages (mosquitto: max_inflight_messages, 20); after a lost connection we resubscribe
    # and get them all again anyway.
    filters = [(f"{prefix}/+/state", 0), (f"{prefix}/+/health", 0)]

    def open_link(deadline: float) -> _Link:
        link = _Link(opts, _client_id("watch"), on_message)
        try:
            link.connect(deadline)
            link.subscribe(filters, deadline)
        except BaseException:
            link.close()
            raise
        return link

    started = time.monotonic()
    deadline = started + timeout_s
    current = [open_link(deadline)]
    try:
        if not once:
            _live(current, open_link, view, changed, filter, out or sys.stdout, size, stop)
            return view
        last_retained[0] = time.monotonic()
        while True:
            now = time.monotonic()
            quiet_for = now - last_retained[0]
            if quiet_for >= settle_s:
                break
            if now >= deadline:
                log.warning(
                    "retained messages still arriving after %.0f s; the view may be "
                    "incomplete (%d devices so far)",
                    timeout_s,
                    len(view.devices),
                )
                break
            current[0].pump(min(settle_s - quiet_for, deadline - now))
        log.info(
            "%d devices from %d messages in %.2f s",
            len(view.devices),
            view.messages,
            time.monotonic() - started,
        )
        return view
    finally:
        current[0].close()


def _terminal_size() -> tuple[int, int]:
    s = shutil.get_terminal_size((120, 40))
    return s.columns, s.lines


def _live(
    current: list[_Link],
    open_link: Callable[[float], _Link],
    view: FleetView,
    changed: list[bool],
    filter: str | None,
    out: TextIO,
    size: Callable[[], tuple[int, int]] | None,
    stop: threading.Event | None,
) -> None:
    """Redraw until Ctrl-C or `stop`; `current[0]` is the link, replaced on reconnects."""
    url = current[0].url
    status = ""  # while disconnected: why, in place of the title
    drawn_at = -REFRESH_S

    def draw() -> None:
        nonlocal drawn_at
        columns, lines = (size or _terminal_size)()
        title = status or f"edge-agent fleet watch · {url} · {view.prefix} · Ctrl-C quits"
        table = render(
            view, time.time(), columns, max_rows=max(1, lines - HEADER_LINES - 1), filter=filter
        )
        body = "\x1b[K\n".join([title[:columns], *table.split("\n")])
        out.write("\x1b[H" + body + "\x1b[K\n\x1b[J")  # home, draw over, clear what is left
        out.flush()
        drawn_at = time.monotonic()
        changed[0] = False

    def show(what: str) -> None:
        nonlocal status
        status = what
        draw()

    out.write("\x1b[H\x1b[2J")
    try:
        while stop is None or not stop.is_set():
            since = time.monotonic() - drawn_at
            if since >= REFRESH_S or (changed[0] and since >= REDRAW_S):
                draw()
            try:
                current[0].pump(_PUMP_S)
            except FleetError as exc:
                log.warning("%s", exc)
                current[0].close()
                link = _reconnect(open_link, str(exc), show, stop)
                if link is None:
                    break
                current[0] = link
                status = ""
                changed[0] = True
    except KeyboardInterrupt:
        pass
    finally:
        out.write("\n")
        out.flush()


def _reconnect(
    open_link: Callable[[float], _Link],
    why: str,
    show: Callable[[str], None],
    stop: threading.Event | None,
) -> _Link | None:
    """A new connection, after 1 s, 2 s, 4 s … 30 s; the table stays up with the reason in
    its title. None if `stop` was set first."""
    backoff = 1.0
    while stop is None or not stop.is_set():
        show(f"DISCONNECTED: {why}; retrying in {backoff:.0f} s")
        wait_until = time.monotonic() + backoff
        while time.monotonic() < wait_until and not (stop and stop.is_set()):
            time.sleep(0.1)
        try:
            link = open_link(time.monotonic() + RECONNECT_TIMEOUT_S)
        except FleetError as exc:
            log.warning("%s", exc)
            why = str(exc)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            continue
        log.info("reconnected to %s", link.url)
        return link
    return None


# ----------------------------------------------------------------------------- send


def send(
    opts: MqttOptions,
    prefix: str,
    device: str,
    command: str,
    args: Mapping[str, str] | None = None,
    body: bytes = b"",
    timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
) -> pb.CommandResponse:
    """Send `command` to `device` and return its `CommandResponse`.

    The answer comes on `<prefix>/<device>/resp/<requester>` (a topic the device's ACL lets it
    publish to), with a fresh requester id per call and random correlation data: MQTT 5
    properties, or the Command's reply_topic/correlation fields on 3.1.1. Anything else that
    arrives there is ignored. Raises FleetError if the broker cannot be reached or the device
    does not answer within `timeout_s` (counted from the start, connecting included).
    """
    try:
        check_device_id(device)
    except ValueError as exc:
        raise FleetError(str(exc)) from exc
    if not COMMAND_RE.fullmatch(command):
        raise FleetError(f"command {command!r} must match {COMMAND_RE.pattern}")
    topics = Topics(prefix, device)
    requester = f"op-{secrets.token_hex(6)}"
    reply_topic = topics.response(requester)
    correlation = secrets.token_bytes(16)
    answers: list[pb.CommandResponse] = []
    states: list[pb.DeviceState] = []

    def on_message(msg: mqtt.MQTTMessage) -> None:
        if msg.topic == topics.state:
            _keep_state(bytes(msg.payload), states)
            return
        if msg.topic != reply_topic or msg.retain:
            return
        if opts.v5:
            corr = getattr(msg.properties, "CorrelationData", None)
            if corr is None or bytes(corr) != correlation:
                log.info("ignoring a response on %s with other correlation data", msg.topic)
                return
        try:
            resp = pb.CommandResponse.FromString(bytes(msg.payload))
        except DecodeError:
            log.warning("ignoring a malformed response on %s", msg.topic)
            return
        if resp.command and resp.command != command:
            log.info("ignoring a response to %r on %s", resp.command, msg.topic)
            return
        answers.append(resp)

    deadline = time.monotonic() + timeout_s
    link = _Link(opts, _client_id(requester), on_message)
    try:
        link.connect(deadline)
        # the response topic first: the answer must not arrive before we listen
        link.subscribe([(reply_topic, 1), (topics.state, 0)], deadline)
        cmd = pb.Command(args=dict(args or {}), body=body)
        if opts.v5:
            props = publish_properties(
                opts, COMMAND_TYPE, response_topic=reply_topic, correlation=correlation
            )
        else:
            cmd.reply_topic, cmd.correlation, props = reply_topic, correlation, None
        link.publish(topics.command(command), cmd.SerializeToString(), props, deadline)
        log.info("sent %s to %s; waiting for the answer on %s", command, device, reply_topic)
        try:
            link.pump_until(lambda: bool(answers), deadline)
        except _Timeout as exc:
            raise FleetError(
                f"device {device} did not answer {command} within {timeout_s:g} s; "
                f"is it online? ({_last_state(states, prefix)})"
            ) from exc
    finally:
        link.close()
    return answers[0]


def _keep_state(payload: bytes, states: list[pb.DeviceState]) -> None:
    if not payload:
        return
    with contextlib.suppress(DecodeError):  # only a hint for the timeout message
        states.append(pb.DeviceState.FromString(payload))


def _last_state(states: list[pb.DeviceState], prefix: str) -> str:
    if not states:
        return f"no state was ever published for it under {prefix}"
    s = states[-1]
    kinds = {
        State.ONLINE: Presence.ONLINE,
        State.OFFLINE: Presence.OFFLINE,
        State.LOST: Presence.LOST,
    }
    kind = kinds.get(s.state, f"kind {s.state}")
    written = age(time.time() - s.timestamp_unix)
    return f"its retained state: {kind}, session {s.session}, written {written} ago"
