"""What a running rollout knows of the fleet: each device's presence, group and serving model
from its retained `state` and `health`, and the last update status its health carries.

Pure (bytes in, `Seen` out): the driver feeds it every state and health message its one
connection receives. A Last Will older than the session we know (a late Will) does not make a
device offline, as in `agent.fleet.view.FleetView`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from google.protobuf.message import DecodeError

from agent.fleet.rollout_plan import Heard, Seen
from agent.fleet.topics import parse
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

_PRESENCE: Final = {
    pb.DeviceState.ONLINE: "online",
    pb.DeviceState.OFFLINE: "offline",
    pb.DeviceState.LOST: "lost",
}


@dataclass(frozen=True, slots=True)
class _Known:
    seen: Seen
    session: int = 0  # the newest session heard from it (state or health)
    state_session: int = 0
    health_ts: float = 0.0
    state_ts: float = 0.0


class RolloutView:
    """Devices by id, message by message. Malformed payloads are counted and ignored."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._known: dict[str, _Known] = {}
        self.malformed = 0

    @property
    def seen(self) -> dict[str, Seen]:
        return {d: k.seen for d, k in self._known.items()}

    def get(self, device_id: str) -> Seen | None:
        k = self._known.get(device_id)
        return k.seen if k else None

    def update(self, topic: str, payload: bytes) -> tuple[str, Heard | None] | None:
        """Apply a state or health message: (device id, the update status its health carries,
        if any) when it was one, else None."""
        p = parse(self.prefix, topic)
        if p is None or p.kind not in ("state", "health") or not payload:
            return None
        old = self._known.get(p.device) or _Known(Seen(p.device, "unknown"))
        try:
            if p.kind == "state":
                self._state(old, pb.DeviceState.FromString(payload))
                return p.device, None
            return p.device, self._health(old, pb.Health.FromString(payload))
        except (DecodeError, ValueError, RuntimeError):
            self.malformed += 1
            return None

    def _state(self, old: _Known, m: pb.DeviceState) -> None:
        if m.state not in _PRESENCE or (m.device_id and m.device_id != old.seen.device_id):
            self.malformed += 1
            return
        presence = _PRESENCE[m.state]
        if presence == "lost" and m.session < old.session:
            return  # a late Will of an earlier session
        s = replace(old.seen, presence=presence, group=m.group or old.seen.group)
        if m.model_sha256 and m.timestamp_unix >= old.health_ts:
            name, _, rest = m.model.partition(" ")
            s = replace(s, sha256=m.model_sha256, model_name=name, version=rest.split(" ")[0])
        self._known[s.device_id] = replace(
            old,
            seen=s,
            session=max(old.session, m.session),
            state_session=m.session,
            state_ts=m.timestamp_unix,
        )

    def _health(self, old: _Known, m: pb.Health) -> Heard | None:
        if m.device_id and m.device_id != old.seen.device_id:
            self.malformed += 1
            return None
        s = old.seen
        if s.presence == "lost" and m.session > old.state_session:
            s = replace(s, presence="online")  # a late Will overwrote a newer session's birth
        if m.timestamp_unix >= old.state_ts:
            ref = m.model
            s = replace(
                s, group=m.group or s.group, model_name=ref.name, version=ref.version,
                sha256=ref.sha256 or s.sha256,
            )  # fmt: skip
        self._known[s.device_id] = replace(
            old, seen=s, session=max(old.session, m.session), health_ts=m.timestamp_unix
        )
        if not m.HasField("last_update") or not m.last_update.update_id:
            return None
        u = m.last_update
        return Heard(
            u.update_id,
            pb.UpdateStatus.Phase.Name(u.phase),
            u.reason_code,
            u.message,
            u.timestamp_unix,
        )
