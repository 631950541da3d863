"""What a running rollout knows of the fleet: each device's presence, group and serving model
(its `agent.operator.inventory` row, from the retained `state` and `health` in a
`agent.operator.view.FleetView`: late Wills, out-of-order health and both encodings handled
there), the last update status each health carries, and how its models run (`DeviceRuns`,
from the health's `run` and `previous`: what rollout gates compare).

A device heard live (a health or state as it is published, not a retained copy) with no state
known is online: a broker that sends no retained message to wildcard subscriptions (RabbitMQ
3.10, docs/FLEET.md) shows a rollout only live messages, and one of them is as good.

Pure (messages in, `Seen` out): the driver feeds it every state and health message its one
connection receives; a device's `Seen` is rebuilt only when one of its messages changed it.
"""

from __future__ import annotations

import time

from agent.fleet.codec import ContentType, PayloadError, decode
from agent.fleet.topics import parse
from agent.operator.digest import Presence
from agent.operator.inventory import inventory_row
from agent.operator.rollout.figures import DeviceRuns, Figures
from agent.operator.rollout.plan import Heard, Seen
from agent.operator.view import FleetView
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb


class RolloutView:
    """Devices by id, message by message; malformed payloads are the FleetView's to count."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.fleet = FleetView(prefix)
        self.seen: dict[str, Seen] = {}
        self.runs: dict[str, DeviceRuns] = {}  # from each device's newest health

    def update(
        self,
        topic: str,
        payload: bytes,
        *,
        retained: bool = False,
        content: ContentType | None = None,
        received_unix: float | None = None,
    ) -> tuple[str, Heard | None] | None:
        """Apply a state or health message: (device id, the update status a health carries,
        if any) when it was one, else None."""
        p = parse(self.prefix, topic)
        if p is None or p.kind not in ("state", "health"):
            return None
        received = time.time() if received_unix is None else received_unix
        if self.fleet.update(topic, payload, received, retained=retained, content=content):
            d = self.fleet.devices.get(p.device)
            if d is None:
                self.seen.pop(p.device, None)
            else:
                row = inventory_row(d)
                presence = row.presence.value
                if row.presence is Presence.UNKNOWN and d.live_unix:
                    presence = "online"  # no state yet, but it publishes now
                self.seen[p.device] = Seen(
                    p.device,
                    presence,
                    row.group,
                    row.model,
                    row.version,
                    row.sha256,
                    row.digest,
                )
        if p.kind != "health" or not payload:
            return p.device, None
        try:
            h = decode(pb.Health, payload, content)
        except PayloadError:
            return p.device, None
        self._runs(p.device, h)
        if not h.HasField("last_update") or not h.last_update.update_id:
            return p.device, None
        u = h.last_update
        try:
            phase = pb.UpdateStatus.Phase.Name(u.phase)
        except ValueError:
            return p.device, None
        return p.device, Heard(u.update_id, phase, u.reason_code, u.message, u.timestamp_unix)

    def _runs(self, device: str, h: pb.Health) -> None:
        old = self.runs.get(device)
        if old is not None and h.timestamp_unix < old.timestamp_unix:
            return  # an older health, come late
        self.runs[device] = DeviceRuns(
            h.profile,
            h.arch,
            h.timestamp_unix,
            Figures.from_pb(h.run) if h.HasField("run") else None,
            Figures.from_pb(h.previous) if h.HasField("previous") else None,
        )
