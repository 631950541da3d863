"""`fleet publish-update` whose broker dies in the middle of an MQTT block download: a real
daemon with `broker = [n1, n2]` and `publish_update` given the same two, on two real mosquittos
on loopback (no cluster: what the nodes share does not matter here, both clients fail over by
themselves). The first node is killed when the device's first DOWNLOADING report arrives, from
inside the operator's own message handling, so no more blocks can have been served through it;
both move to the second node, the device asks for its block again, and the update commits."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from agent.config.file import parse_broker
from agent.operator.publish import Progress, publish_update
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.broker import Mosquitto
from tests.support.daemon_harness import Daemon
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import (  # noqa: F401  (fixtures)
    Models,
    big_models,
    bundle,
    config,
    trusted,
)

Phase = fpb.UpdateStatus


def test_publish_update_survives_its_broker_dying_mid_download(
    big_models: Models,  # noqa: F811
    trusted: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    n1, n2 = Mosquitto(tmp_path / "n1"), Mosquitto(tmp_path / "n2")
    device = "dev-publish-fo"
    path = bundle(big_models, tmp_path)  # no URL: the payload comes in blocks over MQTT
    text = config(trusted).replace("[fleet]\n", f'[fleet]\nbroker = ["{n1.url}", "{n2.url}"]\n')
    d = Daemon(tmp_path, big_models.base, text, args=("--device-id", device))
    opts = dataclasses.replace(options(n1), other_brokers=(parse_broker("test", "broker", n2.url),))
    phases: list[str] = []
    killed = threading.Event()

    def on_status(_device: str, st: fpb.UpdateStatus) -> None:
        phases.append(Phase.Phase.Name(st.phase))
        if st.phase == Phase.DOWNLOADING and not killed.is_set():
            assert n1.proc is not None
            n1.proc.kill()  # the node dies, no clean shutdown
            n1.proc.wait()
            killed.set()

    seen = Observer(n1, "publish-fo-birth")
    try:
        seen.state(device, fpb.DeviceState.ONLINE)  # subscribed: a command now reaches it
        seen.close()
        assert d.client().info()["version"] == "1.0.0"
        result: dict[str, Progress] = publish_update(
            opts, PREFIX, path, [device], timeout_s=300, on_status=on_status
        )
        assert killed.is_set(), phases
        final = result[device].status
        assert final is not None and final.phase == Phase.COMMITTED, (final, phases)
        assert d.client().info()["version"] == "1.2.0"
        assert f"fleet: connected to {n2.url} as" in d.read_log()
        assert phases[-1] == "COMMITTED" and "DOWNLOADING" in phases, phases
    finally:
        assert d.stop() == 0, d.read_log()
        n1.stop()
        n2.stop()
