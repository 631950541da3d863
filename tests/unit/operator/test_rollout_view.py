"""What a running rollout knows of a device (agent/operator/rollout/view.py): a live health
makes a device with no known state online, as a retained birth would; a retained copy alone
does not; a state, live or retained, still decides (a Will makes it lost)."""

from __future__ import annotations

from agent.operator.rollout.view import RolloutView
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

PREFIX = "fleet/v1"
T = 1_800_000_000.0


def health(device: str, seq: int = 1) -> bytes:
    h = pb.Health(seq=seq, session=1, device_id=device, timestamp_unix=T + seq)
    h.model.name, h.model.version, h.model.sha256 = "m", "1.0.0", "ab" * 32
    return h.SerializeToString()


def state(device: str, kind: int) -> bytes:
    return pb.DeviceState(
        device_id=device, state=kind, session=1, timestamp_unix=T
    ).SerializeToString()


def test_a_live_health_with_no_state_known_is_online() -> None:
    """RabbitMQ 3.10 sends no retained message to `+/state`: a rollout there hears only live
    health, and a named device heard so must be offered (docs/FLEET.md, "Broker clusters")."""
    view = RolloutView(PREFIX)
    view.update(f"{PREFIX}/dev-1/health", health("dev-1"), retained=False, received_unix=T)
    seen = view.seen["dev-1"]
    assert seen.online and (seen.model_name, seen.version) == ("m", "1.0.0")


def test_a_retained_health_alone_is_not_online_and_a_state_decides() -> None:
    view = RolloutView(PREFIX)
    view.update(f"{PREFIX}/dev-2/health", health("dev-2"), retained=True, received_unix=T)
    assert view.seen["dev-2"].presence == "unknown"  # maybe long gone: only a copy
    view.update(f"{PREFIX}/dev-2/state", state("dev-2", pb.DeviceState.ONLINE), retained=True)
    assert view.seen["dev-2"].online
    view.update(f"{PREFIX}/dev-3/health", health("dev-3"), retained=False, received_unix=T)
    view.update(f"{PREFIX}/dev-3/state", state("dev-3", pb.DeviceState.LOST), retained=False)
    assert view.seen["dev-3"].presence == "lost"  # its Will, live: not online any more
