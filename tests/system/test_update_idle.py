"""`[updates] activate = "idle"` on the real daemon (docs/UPDATES.md, "When to switch"): a
committed download waits while sessions are in use, health says so, the wait survives a
restart, and the model switches once the traffic stops. Real `edge-agent run` processes, a
real mosquitto, real gRPC sessions; idleness is driven by the traffic, not by sleeps.
"""

from __future__ import annotations

import threading
from pathlib import Path

from agent.operator.client import send
from agent.ota.store import Store
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.daemon_harness import Daemon
from tests.system import test_updates
from tests.system.test_daemon import req
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import statuses, wait_final
from tests.unit.ota.test_update_clock import _healths, _over_http, _wait

# the update tests' module fixtures: the tiny model and its fine-tune, the trusted key, mosquitto
models, trusted, broker = test_updates.models, test_updates.trusted, test_updates.broker

Phase = fpb.UpdateStatus
DEVICE = "dev-idle"


def _daemon(tmp: Path, models, trusted, broker, idle_s: float) -> Daemon:  # type: ignore[no-untyped-def]
    text = test_updates.config(trusted) + f'activate = "idle"\nidle_s = {idle_s}\n'
    return test_updates.start(tmp, models, broker, trusted, DEVICE, text=text)  # type: ignore[no-any-return]


def _waiting_for(watch: Observer) -> str:
    healths = _healths(watch, DEVICE)
    return healths[-1].activation.waiting_for if healths else ""


class Traffic:
    """Sessions used back to back on a thread (create, one turn, delete) until `stop`."""

    def __init__(self, d: Daemon) -> None:
        self.turns = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(d,), daemon=True)
        self._thread.start()

    def _run(self, d: Daemon) -> None:
        try:
            c = d.client()
            while not self._stop.is_set():
                sid = c.create_session()
                c.generate(req("def f(x):", n=4, session=sid))
                c.delete_session(sid)
                self.turns += 1
        except BaseException as exc:  # handed to the test
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive() and self.error is None, self.error


def test_idle_waits_through_traffic_and_a_restart_then_switches(models, trusted, broker, tmp_path):
    http, signed = _over_http(models, tmp_path)
    watch = Observer(broker, "idle-watch")
    d = _daemon(
        tmp_path, models, trusted, broker, idle_s=3600
    )  # a start counts as use: an hour to wait
    try:
        resp = send(options(broker), PREFIX, DEVICE, "update", {}, signed, 30)
        assert resp.update.phase == Phase.RECEIVED, resp
        _wait(lambda: _waiting_for(watch) == "idle", "health never said waiting_for idle")
        shown = _healths(watch, DEVICE)[-1].activation
        assert shown.policy == "idle" and shown.update_id == resp.update.update_id
        d.stop()
        rec = Store(tmp_path / "state").record()
        assert rec is not None and rec.waiting_for == "idle" and rec.activate == ""

        d = _daemon(
            tmp_path, models, trusted, broker, idle_s=2
        )  # restarted: the record still waits
        traffic = Traffic(d)
        try:
            _wait(lambda: traffic.turns >= 3, "no session traffic")
            # health's heartbeat is 1 s: four more of them span more than idle_s of traffic
            seen = len(_healths(watch, DEVICE))
            _wait(
                lambda: len(_healths(watch, DEVICE)) > seen + 4 and _waiting_for(watch) == "idle",
                "health did not keep saying waiting_for idle through the traffic",
            )
            phases = [s.phase for s in statuses(watch, DEVICE)]
            assert Phase.ACTIVATING not in phases, phases  # not while sessions are in use
        finally:
            traffic.stop()
        final = wait_final(watch, DEVICE)
        assert final.phase == Phase.COMMITTED, (final, test_updates.phases(watch, DEVICE))
        assert d.client().info()["version"] == "1.1.0"
        _wait(lambda: _waiting_for(watch) == "", "health still shows a wait")
    finally:
        d.stop()
        http.close()
        watch.close()
