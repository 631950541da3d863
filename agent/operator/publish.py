"""Offering a signed update over MQTT: `Offer` sends the `update` command to devices, serves the
payload in blocks when the manifest has no URL, and follows each device's update status, all
over ONE connection the caller owns and pumps (`edge-agent fleet publish-update` here, and the
rollout driver, `agent.operator.rollout.run`). It subscribes to wildcards
(`<prefix>/+/update/status`,
`<prefix>/+/update/block`, `<prefix>/+/resp/<requester>`), so a thousand devices cost the same
three subscriptions as one.

`publish_update` (`edge-agent fleet publish-update BUNDLE --device ID | --all`): offer to a
list of devices and follow them until each is final (committed, rolled back, rejected or failed).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import paho.mqtt.client as mqtt
from google.protobuf.message import DecodeError

from agent.config.window import BadWindow, parse_window
from agent.fleet.codec import PayloadError
from agent.fleet.mqtt import MqttOptions, decode_message, outgoing
from agent.fleet.topics import Topics, parse
from agent.operator.client import watch
from agent.operator.digest import Presence
from agent.operator.link import FleetError, _client_id, _Link, read_answer
from agent.ota.artifact.bundle import BundleError, Payload, read_bundle
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

MAX_BLOCK: Final = 1 << 20
ANSWER_TIMEOUT_S: Final = 30.0
FINAL = (
    fpb.UpdateStatus.COMMITTED,
    fpb.UpdateStatus.ROLLED_BACK,
    fpb.UpdateStatus.REJECTED,
    fpb.UpdateStatus.FAILED,
)
StatusHook = Callable[[str, fpb.UpdateStatus, str], None]  # device, status, "answer" | "event"


@dataclass
class Progress:
    device: str
    status: fpb.UpdateStatus | None = None
    blocks_served: int = 0

    @property
    def final(self) -> bool:
        return self.status is not None and self.status.phase in FINAL


def read_offer(bundle: Path) -> tuple[opb.SignedManifest, opb.Manifest, Payload]:
    """What `publish_update` offers: the signed manifest, its content (not verified: the devices
    do that) and where the payload is. BundleError naming the file if any of it does not read."""
    signed, payload = read_bundle(bundle)
    manifest = opb.Manifest()
    try:
        manifest.ParseFromString(signed.manifest)
    except DecodeError as exc:
        raise BundleError(f"{bundle}: the manifest in manifest.pb does not parse: {exc}") from exc
    if not manifest.update_id:
        raise BundleError(f"{bundle}: the manifest has no update_id")
    return signed, manifest, payload


def switch_args(activate: str = "", allow_metered: bool = False) -> dict[str, str]:
    """The update command's arguments for when devices switch (docs/UPDATES.md, "When to
    switch"): `activate` "now" | "idle" | "window" (the device's) | "window:<cron> <duration>"
    ("" = each device's `[updates] activate`); ValueError for a bad one, before anything is
    sent. Carried beside the signed manifest: the rollout cannot change what is signed."""
    args: dict[str, str] = {}
    if activate:
        name, _, spec = activate.partition(":")
        if name not in ("now", "idle", "window") or (spec and name != "window"):
            raise ValueError(
                f"--activate {activate!r}: allowed: now, idle, window, window:<cron> <duration> "
                '(e.g. "window:0 2 * * * 3h")'
            )
        if spec:
            try:
                parse_window(spec)
            except BadWindow as exc:
                raise ValueError(f"--activate {activate!r}: {exc}") from exc
        args["activate"] = activate
    if allow_metered:
        args["allow_metered"] = "true"
    return args


def online_devices(opts: MqttOptions, prefix: str) -> list[str]:
    """Every device whose retained state says online."""
    view = watch(opts, prefix, once=True, settle_s=0.5, timeout_s=15.0, out=None)
    rows = view.rows(time.time())
    return sorted(r.device.device_id for r in rows if r.presence == Presence.ONLINE)


class Offer:
    """One update offered over one link: `handle` every message the link receives, `send` the
    command to a device, `expire` answers that never came. `on_status(device, status, source)`
    sees each status of a followed device: the command's answer ("answer") and the device's
    reports on update/status ("event"), in arrival order; duplicates are the caller's to drop.
    """

    def __init__(
        self,
        opts: MqttOptions,
        prefix: str,
        signed: opb.SignedManifest,
        manifest: opb.Manifest,
        payload: Payload,
        on_status: StatusHook,
        args: Mapping[str, str] | None = None,
    ) -> None:
        """`args`: the update command's arguments (`switch_args`), the same for every device."""
        self.opts, self.prefix = opts, prefix
        self.args = dict(args or {})
        self.signed, self.manifest, self.payload = signed, manifest, payload
        self.on_status = on_status
        self.requester = f"op-{secrets.token_hex(6)}"
        self.following: set[str] = set()
        self.blocks_served: dict[str, int] = {}
        self._waiting: dict[str, tuple[bytes, float]] = {}  # device → (correlation, deadline)

    def filters(self) -> list[tuple[str, int]]:
        p = self.prefix
        return [
            (f"{p}/+/resp/{self.requester}", 1),
            (f"{p}/+/update/status", 1),
            (f"{p}/+/update/block", 1),
        ]

    def follow(self, devices: Iterable[str]) -> None:
        """Devices whose statuses and block requests are ours (offered here or earlier)."""
        self.following.update(devices)

    def send(self, link: _Link, device: str, deadline: float) -> None:
        """Publish the update command (the signed manifest as its body) to `device` and wait
        for the broker's PUBACK; the answer comes later, through `handle`."""
        self.following.add(device)
        topics = Topics(self.prefix, device)
        reply = topics.response(self.requester)
        correlation = secrets.token_bytes(16)
        cmd = fpb.Command(args=self.args, body=self.signed.SerializeToString())
        if not self.opts.v5:
            cmd.reply_topic, cmd.correlation = reply, correlation
        payload, props = outgoing(self.opts, cmd, response_topic=reply, correlation=correlation)
        self._waiting[device] = (correlation, time.monotonic() + ANSWER_TIMEOUT_S)
        link.publish(topics.command("update"), payload, props, deadline)
        log.info("offered update %s to %s", self.manifest.update_id, device)

    def expire(self) -> None:
        """Devices that did not answer the command within ANSWER_TIMEOUT_S: FAILED."""
        now = time.monotonic()
        for device, (_, deadline) in list(self._waiting.items()):
            if now >= deadline:
                del self._waiting[device]
                why = f"device {device} did not answer update within {ANSWER_TIMEOUT_S:g} s"
                st = fpb.UpdateStatus(
                    update_id=self.manifest.update_id,
                    phase=fpb.UpdateStatus.FAILED,
                    message=why,
                    reason_code="no-answer",
                )
                self.on_status(device, st, "answer")

    def handle(self, link: _Link, msg: mqtt.MQTTMessage) -> bool:
        """True if `msg` was for this offer (an answer, a status report, a block request)."""
        p = parse(self.prefix, msg.topic)
        if p is None or p.device not in self.following or msg.retain:
            return False
        if p.kind == "resp" and p.name == self.requester:
            self._answer(p.device, msg)
        elif p.kind == "update" and p.name == "block":
            self._serve_block(link, p.device, msg)
        elif p.kind == "update" and p.name == "status":
            try:
                event = decode_message(fpb.Event, msg)
            except PayloadError:
                log.info("ignoring a malformed update status from %s", p.device)
                return True
            ours = event.WhichOneof("kind") == "update"
            if ours and event.update.update_id == self.manifest.update_id:
                # the device reports on our update: it has the offer, whether or not the
                # command's answer reaches us (it may be lost with a broker node)
                self._waiting.pop(p.device, None)
                self.on_status(p.device, event.update, "event")
        else:
            return False
        return True

    def _answer(self, device: str, msg: mqtt.MQTTMessage) -> None:
        waiting = self._waiting.get(device)
        if waiting is None:
            return
        resp = read_answer(self.opts, msg, waiting[0], "update")
        if resp is None:
            return
        del self._waiting[device]
        if resp.HasField("update"):
            st = fpb.UpdateStatus()
            st.CopyFrom(resp.update)
            # the answer to our offer is about our update, also when the device could not
            # read its id (a manifest it cannot verify is reported as update "?", id "")
            st.update_id = st.update_id or self.manifest.update_id
            self.on_status(device, st, "answer")
        if resp.code != fpb.CommandResponse.OK and (
            not resp.HasField("update") or resp.update.phase not in FINAL
        ):
            st = fpb.UpdateStatus(
                update_id=self.manifest.update_id,
                phase=fpb.UpdateStatus.REJECTED,
                message=resp.message,
                reason_code=fpb.CommandResponse.Code.Name(resp.code).lower(),
            )
            self.on_status(device, st, "answer")

    def _serve_block(self, link: _Link, device: str, msg: mqtt.MQTTMessage) -> None:
        try:
            req = decode_message(opb.BlockRequest, msg)
        except PayloadError:
            return
        size = self.payload.size
        if req.update_id != self.manifest.update_id or req.offset >= size:
            return
        length = min(req.length, MAX_BLOCK, size - req.offset)
        with open(self.payload.path, "rb") as f:
            f.seek(self.payload.offset + req.offset)
            chunk = f.read(length)
        block = opb.Block(update_id=req.update_id, offset=req.offset, data=chunk, total=size)
        data, props = outgoing(self.opts, block)
        link.client.publish(Topics(self.prefix, device).block_data, data, qos=1, properties=props)
        self.blocks_served[device] = self.blocks_served.get(device, 0) + 1


def publish_update(
    opts: MqttOptions,
    prefix: str,
    bundle: Path,
    devices: list[str],
    *,
    timeout_s: float = 600.0,
    on_status: Callable[[str, fpb.UpdateStatus], None] | None = None,
    args: Mapping[str, str] | None = None,
) -> dict[str, Progress]:
    """Offer `bundle` to `devices` and follow them until each is final or `timeout_s` passes.

    `on_status` sees each distinct status of a device once (the command's answer and the
    device's report of the same transition are one status), none after a final one. A lost
    connection is opened again through the first of `opts.brokers` that answers."""
    signed, manifest, payload = read_offer(bundle)
    progress = {d: Progress(d) for d in devices}
    seen: dict[str, set[bytes]] = {d: set() for d in devices}

    def record(device: str, status: fpb.UpdateStatus, _source: str) -> None:
        key = status.SerializeToString(deterministic=True)
        if device not in progress or progress[device].final or key in seen[device]:
            return
        seen[device].add(key)
        progress[device].status = status
        if on_status is not None:
            on_status(device, status)

    offer = Offer(opts, prefix, signed, manifest, payload, record, args)
    deadline = time.monotonic() + timeout_s

    def on_message(msg: mqtt.MQTTMessage) -> None:
        offer.handle(link, msg)

    def open_link() -> _Link:
        new = _Link(opts, _client_id("publish"), on_message)
        try:
            new.connect(deadline)
            new.subscribe(offer.filters(), deadline)
        except BaseException:
            new.close()
            raise
        return new

    link = open_link()
    offer.follow(devices)
    sent: set[str] = set()
    # a lost connection is opened again (through the first broker that answers: a cluster's
    # next node), as many times as there are brokers; commands the broker took are not sent
    # again (the devices' reports come through the new node; a block asked for is asked again)
    failovers = len(opts.brokers)
    try:
        while True:
            try:
                for d in devices:  # the manifest, as the body of the update command
                    if d not in sent:
                        offer.send(link, d, deadline)
                        sent.add(d)
                while not all(p.final for p in progress.values()) and time.monotonic() < deadline:
                    link.pump(min(0.2, max(0.0, deadline - time.monotonic())))
                    offer.expire()
                break
            except FleetError as exc:
                if not (link.lost and failovers and time.monotonic() < deadline):
                    raise
                failovers -= 1
                log.warning("%s; connecting again", exc)
                link.close()
                link = open_link()
    finally:
        link.close()
    for d, n in offer.blocks_served.items():
        progress[d].blocks_served = n
    return progress
