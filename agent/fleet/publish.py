"""`edge-agent fleet publish-update BUNDLE --device ID | --all`: offer a signed update to devices,
serve its payload in blocks over MQTT when the manifest has no URL, and follow each device's
update status until it is final (committed, rolled back, rejected or failed)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
from google.protobuf.message import DecodeError

from agent.fleet.codec import PayloadError
from agent.fleet.digest import Presence
from agent.fleet.mqtt import MqttOptions, decode_message, outgoing
from agent.fleet.operator import send, watch
from agent.fleet.operator_link import FleetError, _client_id, _Link
from agent.fleet.topics import Topics, parse
from agent.ota.bundle import BundleError, Payload, read_bundle
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

MAX_BLOCK = 1 << 20
FINAL = (
    fpb.UpdateStatus.COMMITTED,
    fpb.UpdateStatus.ROLLED_BACK,
    fpb.UpdateStatus.REJECTED,
    fpb.UpdateStatus.FAILED,
)


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


def online_devices(opts: MqttOptions, prefix: str) -> list[str]:
    """Every device whose retained state says online."""
    view = watch(opts, prefix, once=True, settle_s=0.5, timeout_s=15.0, out=None)
    rows = view.rows(time.time())
    return sorted(r.device.device_id for r in rows if r.presence == Presence.ONLINE)


def publish_update(
    opts: MqttOptions,
    prefix: str,
    bundle: Path,
    devices: list[str],
    *,
    timeout_s: float = 600.0,
    on_status: Callable[[str, fpb.UpdateStatus], None] | None = None,
) -> dict[str, Progress]:
    """Offer `bundle` to `devices` and follow them until each is final or `timeout_s` passes.

    `on_status` sees each distinct status of a device once (the command's answer and the
    device's report of the same transition are one status), none after a final one."""
    signed, manifest, payload = read_offer(bundle)
    progress = {d: Progress(d) for d in devices}
    by_block = {Topics(prefix, d).block_request: d for d in devices}
    seen: dict[str, set[bytes]] = {d: set() for d in devices}

    def record(device: str, status: fpb.UpdateStatus) -> None:
        key = status.SerializeToString(deterministic=True)
        if progress[device].final or key in seen[device]:
            return
        seen[device].add(key)
        progress[device].status = status
        if on_status is not None:
            on_status(device, status)

    def on_message(msg: mqtt.MQTTMessage) -> None:
        p = parse(prefix, msg.topic)
        if p is None or p.kind != "update" or p.device not in progress or msg.retain:
            return
        if msg.topic in by_block:
            serve_block(p.device, msg)
            return
        if p.name != "status":
            return
        try:
            event = decode_message(fpb.Event, msg)
        except PayloadError:
            return
        if event.WhichOneof("kind") == "update" and event.update.update_id == manifest.update_id:
            record(p.device, event.update)

    def serve_block(device: str, msg: mqtt.MQTTMessage) -> None:
        try:
            req = decode_message(opb.BlockRequest, msg)
        except PayloadError:
            return
        if req.update_id != manifest.update_id or req.offset >= payload.size:
            return
        length = min(req.length, MAX_BLOCK, payload.size - req.offset)
        with open(payload.path, "rb") as f:
            f.seek(payload.offset + req.offset)
            chunk = f.read(length)
        block = opb.Block(
            update_id=req.update_id, offset=req.offset, data=chunk, total=payload.size
        )
        data, props = outgoing(opts, block)
        link.client.publish(Topics(prefix, device).block_data, data, qos=1, properties=props)
        progress[device].blocks_served += 1

    deadline = time.monotonic() + timeout_s
    link = _Link(opts, _client_id("publish"), on_message)
    try:
        link.connect(deadline)
        filters = []
        for d in devices:
            t = Topics(prefix, d)
            filters += [(t.update_status, 1), (t.block_request, 1)]
        link.subscribe(filters, deadline)
        for d in devices:  # the manifest, as the body of the update command
            try:
                resp = send(opts, prefix, d, "update", {}, signed.SerializeToString(), 30.0)
            except FleetError as exc:
                failed = fpb.UpdateStatus.FAILED
                record(
                    d,
                    fpb.UpdateStatus(update_id=manifest.update_id, phase=failed, message=str(exc)),
                )
                continue
            if resp.HasField("update"):
                record(d, resp.update)
            if resp.code != fpb.CommandResponse.OK and not progress[d].final:
                rejected = fpb.UpdateStatus.REJECTED
                record(
                    d,
                    fpb.UpdateStatus(
                        update_id=manifest.update_id, phase=rejected, message=resp.message
                    ),
                )
        while not all(p.final for p in progress.values()) and time.monotonic() < deadline:
            link.pump(min(0.2, max(0.0, deadline - time.monotonic())))
    finally:
        link.close()
    return progress
