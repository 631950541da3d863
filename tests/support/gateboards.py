"""Scripted boards for rollout-gate tests: devices that are a few MQTT messages each (a retained
online state, and a health with the serving model's figures, as the device side publishes them)
and answer an update command by reporting it committed with the target model's figures.
tests/unit/operator/test_rollout_gates_live.py and tests/system/test_console.py use them."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
from tests.support.broker import Mosquitto

PREFIX = "fleet/v1"
OLD_SHA = "0a" * 32
GOOD = {"decode": 20.0, "ttft": 400.0, "nll": 2.5, "errors": 1}


def model_run(sha: str, version: str, decode: float, ttft: float, nll: float, errors: int
              ) -> pb.ModelRun:  # fmt: skip
    run = pb.ModelRun(requests=200, samples=64, activated_unix=time.time())
    run.model.name, run.model.version, run.model.sha256 = "m", version, sha
    run.errors["internal"] = errors
    run.decode_tok_s.p50, run.ttft_ms.p95 = decode, ttft
    run.probe.probe_id, run.probe.nll_per_token, run.probe.nll_tokens = "probe-1", nll, 180
    run.probe.runs = 1
    return run


class Boards:
    """Devices as MQTT messages: each serves the old model with GOOD figures until an update
    command comes; then it reports the update committed and serves the target with `after`."""

    def __init__(self, broker: Mosquitto, update_id: str, target_sha: str, n: int,
                 after: dict[str, float], rk_after: dict[str, float] | None = None,
                 ) -> None:  # fmt: skip
        """`rk_after`: every other board is an rk3588 that runs the target so (pi5: `after`)."""
        self.update_id, self.target_sha, self.after = update_id, target_sha, after
        self.rk_after = rk_after
        self.devices = [f"board-{i:02d}" for i in range(n)]
        self.commands: dict[str, int] = {d: 0 for d in self.devices}
        self.seq = 0
        self.lock = threading.Lock()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="gate-boards", protocol=mqtt.MQTTv5
        )
        self.client.on_message = self._on_command
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        self.client.subscribe(f"{PREFIX}/+/cmd/update", qos=1)[0]
        for d in self.devices:
            state = pb.DeviceState(
                device_id=d, state=pb.DeviceState.ONLINE, session=1, timestamp_unix=time.time()
            )
            self._publish(f"{PREFIX}/{d}/state", state.SerializeToString(), retain=True)
            self.health(d, updated=False)

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def health(self, device: str, updated: bool) -> None:
        with self.lock:
            self.seq += 1
            h = pb.Health(seq=self.seq, session=1, device_id=device, timestamp_unix=time.time())
        h.profile, h.arch = self.profile(device), "aarch64"
        old = model_run(OLD_SHA, "1.0.0", GOOD["decode"], GOOD["ttft"], GOOD["nll"], 1)
        if updated:
            a = self.rk_after if h.profile == "rk3588" and self.rk_after else self.after
            h.run.CopyFrom(model_run(self.target_sha, "1.1.0", a["decode"], a["ttft"], a["nll"],
                                     int(a["errors"])))  # fmt: skip
            h.previous.CopyFrom(old)
            h.model.CopyFrom(h.run.model)
            h.last_update.update_id, h.last_update.phase = self.update_id, pb.UpdateStatus.COMMITTED
            h.last_update.timestamp_unix = h.timestamp_unix
        else:
            h.run.CopyFrom(old)
            h.model.CopyFrom(old.model)
        self._publish(f"{PREFIX}/{device}/health", h.SerializeToString(), retain=True)

    def _on_command(self, _c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        device = msg.topic.split("/")[-3]
        with self.lock:
            self.commands[device] += 1
        status = pb.UpdateStatus(
            update_id=self.update_id, phase=pb.UpdateStatus.COMMITTED, timestamp_unix=time.time()
        )
        event = pb.Event(seq=1, device_id=device, timestamp_unix=time.time(), update=status)
        # the health with the target's figures first, then the report: the gates see both
        threading.Thread(target=self._commit, args=(device, event), daemon=True).start()

    def _commit(self, device: str, event: pb.Event) -> None:
        self.health(device, updated=True)
        self._publish(f"{PREFIX}/{device}/update/status", event.SerializeToString(), False)

    def profile(self, device: str) -> str:
        return "rk3588" if self.rk_after and self.devices.index(device) % 2 else "pi5"

    def offered(self) -> list[str]:
        with self.lock:
            return sorted(d for d, n in self.commands.items() if n)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
