"""What the operator's tools say about a device: a refused replay (the same update offered
again, which changes nothing there) is not an issue of a healthy device, and a lost device's
age is never the age of its Will (set when it connected, maybe hours before the loss)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.operator.client import send
from agent.operator.link import FleetError
from agent.operator.view import FleetView
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
from tests.support.broker import Mosquitto
from tests.unit.operator.test_fleet_operator import options

PREFIX = "fleet/v1"


def _view_with(phase: int, reason: str, now: float) -> FleetView:
    view = FleetView(PREFIX)
    state = pb.DeviceState(state=pb.DeviceState.ONLINE, session=1, device_id="d1",
                           timestamp_unix=now - 5)  # fmt: skip
    health = pb.Health(seq=1, session=1, device_id="d1", timestamp_unix=now - 1,
                       agent_state="serving",
                       last_update=pb.UpdateStatus(update_id="u-1", phase=phase,  # type: ignore[arg-type]
                                                   reason_code=reason))  # fmt: skip
    view.update(f"{PREFIX}/d1/state", state.SerializeToString(), now, retained=True)
    view.update(f"{PREFIX}/d1/health", health.SerializeToString(), now, retained=True)
    return view


def test_a_refused_replay_is_not_an_issue() -> None:
    now = time.time()
    (row,) = _view_with(pb.UpdateStatus.REJECTED, "replay", now).rows(now)
    assert row.issues == () and row.rank == 3
    (row,) = _view_with(pb.UpdateStatus.REJECTED, "unknown_key", now).rows(now)
    assert row.issues == ("update rejected (unknown_key)",) and row.rank == 1


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker")
    yield b
    b.stop()


def test_a_lost_device_is_not_dated_by_its_will(broker: Mosquitto) -> None:
    will_set = time.time() - 18 * 60  # it connected 18 minutes ago; lost at an unknown time
    lost = pb.DeviceState(state=pb.DeviceState.LOST, session=4, device_id="dev-lost",
                          timestamp_unix=will_set)  # fmt: skip
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="will-stand-in")
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    topic = f"{PREFIX}/dev-lost/state"
    c.publish(topic, lost.SerializeToString(), qos=1, retain=True).wait_for_publish(30)
    c.loop_stop()
    c.disconnect()
    with pytest.raises(FleetError) as err:
        send(options(broker), PREFIX, "dev-lost", "ping", timeout_s=0.5)
    msg = str(err.value)
    assert "its retained state: lost, session 4" in msg
    assert "written" not in msg and "lost at a time the broker does not say" in msg
    assert "Will was set 18m ago" in msg
