"""The operator's side of the fleet link: watch the fleet's retained state and health, and send
one command to one device and wait for its answer.

Each call owns one short-lived `agent.operator.link._Link` (a paho client driven from the
calling thread; foreign errors become `FleetError` there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Final, TextIO

import paho.mqtt.client as mqtt

from agent.config.fleet import check_device_id
from agent.fleet.codec import PayloadError
from agent.fleet.mqtt import MqttOptions, decode_message, outgoing, payload_content, payload_type
from agent.fleet.topics import COMMAND_RE, Topics
from agent.operator.digest import Presence
from agent.operator.link import _PUMP_S, FleetError, _client_id, _Link, _Timeout, read_answer
from agent.operator.render import render
from agent.operator.view import DEFAULT_STALE_AFTER_S, FleetView, age
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
COMMAND_TYPE: Final = pb.Command.DESCRIPTOR.full_name
State = pb.DeviceState


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
    group: str | None = None,
    out: TextIO | None = None,
    size: Callable[[], tuple[int, int]] | None = None,
    stop: threading.Event | None = None,
    screen: bool | None = None,
) -> FleetView:
    """Subscribe to every device's state and health under `prefix` and build the view.

    `once`: return when no new retained message arrived for `settle_s` (at most `timeout_s`
    after connecting). Otherwise redraw the table on `out` (default stdout; at most twice a
    second, sized by `size()` = (columns, lines), default the terminal) until Ctrl-C or `stop`
    is set, reconnecting with backoff if the broker goes away; returns the last view.
    `screen` (default: whether `out` is a terminal): redraw in place with cursor codes; else
    (a pipe, a file) write the whole table again, plain, each time it changes.
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
            content=payload_content(msg),
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
            shown = (filter, group)
            out = out or sys.stdout
            if screen is None:
                screen = _is_terminal(out)
            _live(current, open_link, view, changed, shown, out, size, stop, screen)
            return view
        last_retained[0] = time.monotonic()
        while True:
            now = time.monotonic()
            quiet_for = now - last_retained[0]
            if quiet_for >= settle_s:
                # quiet by our clock, but this process may not have run (a loaded machine):
                # what already waits on the socket is read before the view counts as settled
                seen = last_retained[0]
                current[0].pump(0)
                if last_retained[0] == seen:  # no retained message was waiting
                    break
                continue
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


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _terminal_size() -> tuple[int, int]:
    s = shutil.get_terminal_size((120, 40))
    return s.columns, s.lines


def _live(
    current: list[_Link],
    open_link: Callable[[float], _Link],
    view: FleetView,
    changed: list[bool],
    shown: tuple[str | None, str | None],  # the rows the table shows: (filter, group)
    out: TextIO,
    size: Callable[[], tuple[int, int]] | None,
    stop: threading.Event | None,
    screen: bool,
) -> None:
    """Redraw until Ctrl-C or `stop`; `current[0]` is the link, replaced on reconnects. Not on
    a `screen`: no cursor codes, and a new table only when something changed."""
    status = ""  # while disconnected: why, in place of the title
    drawn_at = -REFRESH_S

    def draw() -> None:
        nonlocal drawn_at
        columns, lines = (size or _terminal_size)()
        url = current[0].url  # the node we are on now (a cluster: it changes on failover)
        title = status or f"edge-agent fleet watch · {url} · {view.prefix} · Ctrl-C quits"
        rows = max(1, lines - HEADER_LINES - 1)
        table = render(view, time.time(), columns, rows, filter=shown[0], group=shown[1])
        if screen:
            body = "\x1b[K\n".join([title[:columns], *table.split("\n")])
            out.write("\x1b[H" + body + "\x1b[K\n\x1b[J")  # home, draw over, clear the rest
        else:
            out.write("\n".join([title[:columns], *table.split("\n")]) + "\n\n")
        out.flush()
        drawn_at = time.monotonic()
        changed[0] = False

    def show(what: str) -> None:
        nonlocal status
        status = what
        draw()

    if screen:
        out.write("\x1b[H\x1b[2J")
    try:
        while stop is None or not stop.is_set():
            since = time.monotonic() - drawn_at
            due = since >= REFRESH_S and (screen or drawn_at < 0)  # ages tick on a screen
            if due or (changed[0] and since >= REDRAW_S):
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
    does not answer within `timeout_s` (counted from the start, connecting included). If the
    connection is lost on the way, the command goes again through the first broker that
    answers (`opts.brokers`: a cluster's other nodes).
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
    states: list[_HeardState] = []

    def on_message(msg: mqtt.MQTTMessage) -> None:
        if msg.topic == topics.state:
            _keep_state(msg, states)
            return
        if msg.topic != reply_topic or msg.retain:
            return
        resp = read_answer(opts, msg, correlation, command)
        if resp is not None:
            answers.append(resp)

    deadline = time.monotonic() + timeout_s
    cmd = pb.Command(args=dict(args or {}), body=body)
    if not opts.v5:
        cmd.reply_topic, cmd.correlation = reply_topic, correlation
    payload, props = outgoing(opts, cmd, response_topic=reply_topic, correlation=correlation)
    while True:
        link = _Link(opts, _client_id(requester), on_message)
        try:
            link.connect(deadline)
            # the response topic first: the answer must not arrive before we listen
            link.subscribe([(reply_topic, 1), (topics.state, 0)], deadline)
            link.publish(topics.command(command), payload, props, deadline)
            log.info("sent %s to %s; waiting for the answer on %s", command, device, reply_topic)
            link.pump_until(lambda: bool(answers), deadline)
            return answers[0]
        except _Timeout as exc:
            raise FleetError(
                f"device {device} did not answer {command} within {timeout_s:g} s; "
                f"is it online? ({_last_state(states, prefix)})"
            ) from exc
        except FleetError as exc:
            # our broker node went away after we connected: send again through the next one
            # that answers (the same correlation; an answer that was lost with the node is
            # asked for again, so the command may run twice)
            if link.connected_once and time.monotonic() < deadline and not answers:
                log.warning("%s; sending %s again", exc, command)
                continue
            if answers:
                return answers[0]
            raise
        finally:
            link.close()


@dataclasses.dataclass(frozen=True, slots=True)
class _HeardState:
    state: pb.DeviceState
    received_unix: float
    retained: bool  # the broker's copy from before we subscribed, not a live arrival


def _keep_state(msg: mqtt.MQTTMessage, states: list[_HeardState]) -> None:
    if not msg.payload:
        return
    with contextlib.suppress(PayloadError):  # only a hint for the timeout message
        states.append(_HeardState(decode_message(pb.DeviceState, msg), time.time(), msg.retain))


def _last_state(states: list[_HeardState], prefix: str) -> str:
    """What the device's state says, with the right age: a Will's timestamp is when the device
    set it (at connect), not when it was lost, so a loss is dated only when we saw it arrive."""
    if not states:
        return f"no state was ever published for it under {prefix}"
    heard = states[-1]
    s, now = heard.state, time.time()
    kinds = {
        State.ONLINE: Presence.ONLINE,
        State.OFFLINE: Presence.OFFLINE,
        State.LOST: Presence.LOST,
    }
    kind = kinds.get(s.state, f"kind {s.state}")
    if s.state == State.LOST and not heard.retained:
        when = f"lost {age(now - heard.received_unix)} ago"
    elif s.state == State.LOST:
        when = (
            "lost at a time the broker does not say (its Will was set "
            f"{age(now - s.timestamp_unix)} ago, when it connected)"
        )
    else:
        when = f"written {age(now - s.timestamp_unix)} ago"
    where = "retained" if heard.retained else "latest"
    return f"its {where} state: {kind}, session {s.session}, {when}"
