"""A committed download waiting to switch, as health carries it and `fleet inventory` shows
it (docs/UPDATES.md, "When to switch"): the device's reporter publishes a change of what it
waits for at once, and the inventory's SWITCH column and JSON keys show it."""

from __future__ import annotations

import time

import pytest

from agent.fleet.device.health import HealthReporter
from agent.operator.inventory import inventory
from agent.operator.publish import switch_args
from agent.operator.render import inventory_json, inventory_table
from agent.operator.view import FleetView
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
from tests.unit.fleet.test_fleet_health import agent_status, disk, model_info, thermal

PREFIX = "fleet/v1"
WAITING = pb.Activation(
    update_id="u-7",
    policy="window",
    waiting_for="window",
    window="0 2 * * * 3h",
    next_window_unix=1.8e9,
    bandwidth_bytes_s=50_000,
)


def test_the_reporter_sends_a_change_of_what_the_update_waits_for_at_once() -> None:
    r = HealthReporter(device_id="d1", session=1, interval_s=600.0, min_interval_s=0.0)
    shown: list[pb.Activation | None] = [None]
    r.activation = lambda: shown[0]

    def tick(now: float) -> pb.Health | None:
        return r.next(
            agent_status(), model_info(), thermal=thermal(), disk=disk(), last_update=None,
            now=now, mono=now,
        )  # fmt: skip

    assert tick(1000.0) is not None  # the first one
    assert tick(1001.0) is None  # nothing changed, no heartbeat due
    shown[0] = WAITING
    h = tick(1002.0)
    assert h is not None and h.activation == WAITING
    assert tick(1003.0) is None  # the same wait: nothing new


def test_the_inventory_shows_the_wait() -> None:
    now = time.time()
    view = FleetView(PREFIX)
    for device, activation in (("d1", WAITING), ("d2", pb.Activation(policy="now"))):
        health = pb.Health(seq=1, session=1, device_id=device, timestamp_unix=now - 1,
                           agent_state="serving", activation=activation)  # fmt: skip
        view.update(f"{PREFIX}/{device}/health", health.SerializeToString(), now, retained=True)
    rows = inventory(view)
    assert (rows["d1"].switch_policy, rows["d1"].waiting_for) == ("window", "window")
    assert rows["d1"].next_window_unix == 1.8e9 and rows["d1"].switch_window == "0 2 * * * 3h"
    table = inventory_table(rows, now, 200)
    assert "SWITCH" in table and "window: waits for window" in table
    d2_line = next(line for line in table.splitlines() if line.startswith("d2"))
    assert "waits" not in d2_line
    doc = {d["device"]: d for d in inventory_json(rows, now)}
    assert doc["d1"]["waiting_for"] == "window" and doc["d2"]["waiting_for"] == ""
    assert doc["d1"]["next_window_unix"] == 1.8e9


def test_the_rollout_flags_become_the_update_command_arguments() -> None:
    assert switch_args() == {}
    assert switch_args("idle", allow_metered=True) == {"activate": "idle", "allow_metered": "true"}
    assert switch_args("window:0 2 * * * 3h") == {"activate": "window:0 2 * * * 3h"}
    for bad in ("later", "idle:1h", "window:0 2 * * * 3"):
        with pytest.raises(ValueError, match="--activate"):
            switch_args(bad)
