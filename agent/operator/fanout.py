"""One command to many devices over one connection (`edge-agent fleet send --group G CMD`).

The targets come from the inventory (`agent.operator.inventory`): a device whose retained state is
not online is reported and not sent to. The others get the command, at most `MAX_IN_FLIGHT`
unanswered at a time, each with its own correlation data; every answer comes on
`<prefix>/<device>/resp/<requester>` (one requester id for the whole run, one subscription
`<prefix>/+/resp/<requester>`), and a device that does not answer within `timeout_s` of its
command going out is reported as such, never waited on longer.
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import paho.mqtt.client as mqtt

from agent.fleet.mqtt import MqttOptions, outgoing
from agent.fleet.topics import COMMAND_RE, Topics, parse
from agent.operator.digest import Presence
from agent.operator.inventory import InventoryRow
from agent.operator.link import _PUMP_S, FleetError, _client_id, _Link, read_answer
from agent.operator.view import age
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

log = logging.getLogger(__name__)

MAX_IN_FLIGHT: Final = 16  # commands sent and not yet answered or timed out


class Outcome(enum.StrEnum):
    OK = "ok"  # answered OK
    ERROR = "error"  # answered with an error code
    NO_ANSWER = "no_answer"  # no answer within the timeout after the command went out
    OFFLINE = "offline"  # its retained state is not online: not sent
    NOT_SENT = "not_sent"  # the broker refused the publish, or the connection was lost


@dataclass(frozen=True, slots=True)
class Result:
    device_id: str
    outcome: Outcome
    message: str  # why, for people ("" when answered: the response says it)
    response: pb.CommandResponse | None = None


def send_many(
    opts: MqttOptions,
    prefix: str,
    targets: Mapping[str, InventoryRow],
    command: str,
    args: Mapping[str, str] | None = None,
    body: bytes = b"",
    *,
    timeout_s: float = 10.0,
    max_in_flight: int = MAX_IN_FLIGHT,
    on_result: Callable[[Result], None] | None = None,
) -> dict[str, Result]:
    """Send `command` to every online device of `targets`; a Result per target, by device id.

    `on_result` sees each result as it is known (the offline ones first). Raises FleetError
    only if the broker cannot be reached at the start. A connection lost on the way is opened
    again (through the first of `opts.brokers` that answers) and the unanswered commands sent
    again; when that fails too, the devices still waiting are `not_sent`/`no_answer` with the
    reason.
    """
    if not COMMAND_RE.fullmatch(command):
        raise FleetError(f"command {command!r} must match {COMMAND_RE.pattern}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
    results: dict[str, Result] = {}

    def finish(result: Result) -> None:
        results[result.device_id] = result
        if on_result is not None:
            on_result(result)

    todo: deque[str] = deque()
    for device_id in sorted(targets):
        row = targets[device_id]
        if row.presence is Presence.ONLINE:
            todo.append(device_id)
        else:
            seen = age(time.time() - row.last_seen_unix) if row.last_seen_unix else "never"
            finish(Result(device_id, Outcome.OFFLINE, f"{row.presence}, last seen {seen} ago"))
    if not todo:
        return results

    requester = f"op-{secrets.token_hex(6)}"
    waiting: dict[str, tuple[bytes, float]] = {}  # device -> (correlation, monotonic time sent)

    def on_message(msg: mqtt.MQTTMessage) -> None:
        p = parse(prefix, msg.topic)
        if p is None or p.kind != "resp" or p.name != requester or msg.retain:
            return
        if p.device not in waiting:
            return
        resp = read_answer(opts, msg, waiting[p.device][0], command)
        if resp is None:
            return
        del waiting[p.device]
        ok = resp.code == pb.CommandResponse.OK
        finish(Result(p.device, Outcome.OK if ok else Outcome.ERROR, "", resp))

    def open_link() -> _Link:
        link = _Link(opts, _client_id(requester), on_message)
        try:
            deadline = time.monotonic() + timeout_s
            link.connect(deadline)
            link.subscribe([(f"{prefix}/+/resp/{requester}", 1)], deadline)
        except BaseException:
            link.close()
            raise
        return link

    def publish(device_id: str) -> None:
        topics = Topics(prefix, device_id)
        reply_topic = topics.response(requester)
        correlation = waiting[device_id][0]
        cmd = pb.Command(args=dict(args or {}), body=body)
        if not opts.v5:
            cmd.reply_topic, cmd.correlation = reply_topic, correlation
        payload, props = outgoing(opts, cmd, response_topic=reply_topic, correlation=correlation)
        link.publish(topics.command(command), payload, props, time.monotonic() + timeout_s)

    link = open_link()
    # a lost connection: connect again (to the first node that answers: a cluster's others)
    # and send the unanswered commands again, the same correlation (one may run twice); as
    # many times as there are brokers, so a flapping broker cannot keep the run going
    failovers = len(opts.brokers)
    try:
        log.info("sending %s to %d devices, %d at a time", command, len(todo), max_in_flight)
        gone = ""

        def lost(exc: FleetError) -> None:
            nonlocal link, failovers, gone
            while failovers and not gone:
                failovers -= 1
                log.warning("%s; connecting again", exc)
                link.close()
                try:
                    link = open_link()
                except FleetError as again:
                    exc = again
                    continue
                for device_id in list(waiting):  # their answers may have gone with the node
                    waiting[device_id] = (waiting[device_id][0], time.monotonic())
                    try:
                        publish(device_id)
                    except FleetError as again:
                        if link.lost:
                            exc = again
                            break
                        del waiting[device_id]
                        finish(Result(device_id, Outcome.NOT_SENT, str(again)))
                else:
                    return
            gone = gone or str(exc)

        while todo or waiting:
            while todo and len(waiting) < max_in_flight and not gone:
                device_id = todo.popleft()
                # waiting first: an answer that comes while we wait for the PUBACK counts
                waiting[device_id] = (secrets.token_bytes(16), time.monotonic())
                try:
                    publish(device_id)
                except FleetError as exc:
                    if link.lost:
                        lost(exc)  # sends it again with the others waiting
                    elif waiting.pop(device_id, None) is not None:  # refused, not answered
                        finish(Result(device_id, Outcome.NOT_SENT, str(exc)))
            now = time.monotonic()
            for device_id, (_, sent) in list(waiting.items()):
                if now - sent >= timeout_s:
                    del waiting[device_id]
                    why = f"no answer within {timeout_s:g} s (its retained state: online)"
                    finish(Result(device_id, Outcome.NO_ANSWER, why))
            if gone:
                break
            if waiting:
                first = min(sent for _, sent in waiting.values())
                try:
                    link.pump(max(0.0, min(_PUMP_S, first + timeout_s - now)))
                except FleetError as exc:
                    lost(exc)
        for device_id in list(waiting):
            finish(Result(device_id, Outcome.NO_ANSWER, f"no answer, then: {gone}"))
        for device_id in todo:
            finish(Result(device_id, Outcome.NOT_SENT, gone))
    finally:
        link.close()
    return results
