"""The fleet link's network thread sleeps until it has work (agent/fleet/device/link.py): with
its idle poll and keepalive set to an hour, everything a device does over MQTT must still happen
at once — the birth, health, an update's MQTT blocks and status events, a command's reply and a
clean stop — because each of them wakes the thread. A link that only found its work by polling
would sit an hour on each, far past these tests' limits (safety nets, not speeds)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions, new_client
from agent.operator.client import send
from agent.operator.publish import publish_update
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.broker import Mosquitto
from tests.support.fleetsim import FleetSim, SimDevice, SimModels, scratch_root

HOUR_S = 3600.0


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker")
    yield b
    b.stop()


class _Health:
    """Every health message on the broker, by device."""

    def __init__(self, opts: MqttOptions) -> None:
        self.seen: dict[str, int] = {}
        self._cv = threading.Condition()
        self._client = new_client("test-health-watch", opts, persistent=False)
        self._client.on_message = self._on_message
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *_a: subscribed.set()
        self._client.on_connect = lambda c, *_a: c.subscribe("fleet/v1/+/health", qos=1)
        b = opts.broker
        self._client.connect(b.host, b.port, 60)
        self._client.loop_start()
        assert subscribed.wait(30)

    def _on_message(self, _c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        fpb.Health.FromString(bytes(msg.payload))
        with self._cv:
            device = msg.topic.split("/")[-2]
            self.seen[device] = self.seen.get(device, 0) + 1
            self._cv.notify_all()

    def wait(self, devices: list[str], timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: all(d in self.seen for d in devices), timeout_s)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


def test_an_idle_link_wakes_for_each_piece_of_work(broker: Mosquitto, tmp_path: Path) -> None:
    models = SimModels.create(tmp_path / "models")
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    opts = MqttOptions(broker=parse_broker("test", "broker", broker.url))
    ids = ["wake-a", "wake-b"]
    watch = _Health(opts)
    try:
        with scratch_root(tmp_path / "fleet") as root:
            sim = FleetSim(
                broker.url, root, [SimDevice(d) for d in ids], trusted_keys_dir=models.trusted,
                shipped=models.shipped, health_interval_s=HOUR_S, loop_s=HOUR_S,
            )  # fmt: skip
            sim.fleet = dataclasses.replace(sim.fleet, keepalive_s=int(HOUR_S))
            with sim:  # births: CONNECT and the birth are written by a woken thread
                links = [sim._devices[d].agent.link for d in ids]  # type: ignore[union-attr]
                assert all(link.loop_s == HOUR_S for link in links)
                assert watch.wait(ids, 60), f"no health from {set(ids) - set(watch.seen)}"
                # the offer's answer, the update's blocks (asked from the updater's thread)
                # and its status events (from the outbox)
                progress = publish_update(opts, "fleet/v1", bundle, ["wake-a"], timeout_s=120)
                final = progress["wake-a"].status
                assert final is not None and final.phase == fpb.UpdateStatus.COMMITTED, final
                assert sim.version("wake-a") == "1.1.0" and sim.version("wake-b") == "1.0.0"
                # a command nobody knows: its reply comes back from the woken thread
                resp = send(opts, "fleet/v1", "wake-b", "no-such-command", {}, b"", 30.0)
                assert resp.code == fpb.CommandResponse.NOT_FOUND, resp
            # stop() woke each network thread: none sits out its hour
            assert not any(link._thread.is_alive() for link in links)
    finally:
        watch.close()
