"""No update transition goes unreported across a crash (docs/UPDATES.md, "Every transition is
reported"): a real daemon is SIGKILLed (fault injection) right after it saved the update record
for a state and before that state's report reached the outbox; after the restart the operator,
watching the real broker, has seen every transition exactly once, in order."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import pytest

from agent.fleet.topics import Topics
from agent.operator.client import send
from agent.operator.link import FleetError
from agent.ota.faults import UNREPORTED
from agent.ota.store import Store
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.system import test_updates
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import (
    _lie_about_the_tokenizer,
    _req,
    _resign,
    _signed,
    over_http,
    start,
    wait_final,
)

# the update tests' module fixtures: the tiny model and its fine-tune, the trusted key, mosquitto
models, trusted, broker = test_updates.models, test_updates.trusted, test_updates.broker

Phase = fpb.UpdateStatus
R = opb.UpdateRecord
HAPPY = ["RECEIVED", "DOWNLOADING", "VERIFIED", "STAGED", "ACTIVATING", "TRIAL", "COMMITTED"]


def transitions(watch: Observer, device: str) -> list[str]:
    """The phases of the update reports the broker delivered, each event once (a QoS 1
    redelivery after the kill has the same seq), download progress left out."""
    topic = Topics(PREFIX, device).update_status
    with watch._cv:
        events = [fpb.Event.FromString(s.payload) for s in watch.seen if s.topic == topic]
    seen: dict[int, fpb.Event] = {}
    for e in events:
        seen.setdefault(e.seq, e)
    ordered = [seen[k] for k in sorted(seen)]
    return [
        Phase.Phase.Name(e.update.phase)
        for e in ordered
        if not (e.update.phase == Phase.DOWNLOADING and e.update.message.endswith(" bytes"))
    ]


def _kill_between_record_and_report(  # type: ignore[no-untyped-def]
    tmp: Path, crash_at: str, body: bytes, device: str, models, broker, trusted
) -> opb.UpdateRecord:
    """Offer `body` to a daemon that SIGKILLs itself at fault-injection point `crash_at`
    (`unreported-<state>`: the record says <state>, its report is not written); return the
    record as the kill left it."""
    d = start(tmp, models, broker, trusted, device, EDGE_AGENT_OTA_CRASH_AT=crash_at)
    with contextlib.suppress(FleetError):  # the answer may not make it out before the kill
        send(options(broker), PREFIX, device, "update", {}, body, 5)
    assert d.proc.wait(60) == -signal.SIGKILL, d.read_log()
    d.stop()
    rec = Store(tmp / "state").record()
    assert rec is not None
    return rec


@pytest.mark.parametrize("state", [p.lower() for p in HAPPY])
def test_a_kill_between_the_record_and_its_report_loses_no_report(
    state, models, trusted, broker, tmp_path
):
    _kill_and_check(state, UNREPORTED + state, models, trusted, broker, tmp_path)


def test_a_kill_after_the_switch_before_the_trial_is_recorded_loses_no_report(
    models, trusted, broker, tmp_path
):
    """The pointer names the new model, the record still says activating."""
    _kill_and_check("activating", "switched", models, trusted, broker, tmp_path)


def _kill_and_check(state: str, crash_at: str, models, trusted, broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _served, http, path = over_http(models, tmp_path, 2)
    device = f"dev-{crash_at}"
    watch = Observer(broker, f"ota-{crash_at}")
    d = None
    try:
        rec = _kill_between_record_and_report(
            tmp_path,
            crash_at,
            _signed(path),
            device,
            models,
            broker,
            trusted,
        )
        assert R.State.Name(rec.state) == state.upper()  # killed right after the record moved
        d = start(tmp_path, models, broker, trusted, device)
        final = wait_final(watch, device)
        if crash_at == UNREPORTED + "activating":  # not switched: "restarted while activating"
            assert final.phase == Phase.ROLLED_BACK, final
            want = [*HAPPY[:5], "ROLLED_BACK"]
        else:
            assert final.phase == Phase.COMMITTED, final
            want = HAPPY
        deadline = time.monotonic() + 10  # the final report may overtake nothing, but wait a bit
        while transitions(watch, device) != want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert transitions(watch, device) == want
        assert d.client().generate(_req()).finish_reason in ("length", "stop")
    finally:
        if d is not None:
            d.stop()
        http.close()
        watch.close()


def test_a_kill_before_a_rollback_is_reported(models, trusted, broker, tmp_path):
    """The new model fails its canary at activation; the agent dies as the rollback is recorded."""
    _served, http, path = over_http(models, tmp_path, 6)
    device = "dev-unreported-rolled-back"
    watch = Observer(broker, "ota-unreported-rolled-back")

    def expect_wrong_tokens(m: opb.Manifest) -> None:
        m.canary.prompt = "def f(x):"
        m.canary.expected_tokens.extend([3, 3, 3, 3])

    d = None
    try:
        rec = _kill_between_record_and_report(
            tmp_path,
            UNREPORTED + "rolled_back",
            _resign(path, expect_wrong_tokens),
            device,
            models,
            broker,
            trusted,
        )
        assert rec.state == R.ROLLED_BACK
        d = start(tmp_path, models, broker, trusted, device)
        final = wait_final(watch, device)
        assert final.phase == Phase.ROLLED_BACK and "canary" in final.message, final
        assert transitions(watch, device) == [*HAPPY[:5], "ROLLED_BACK"]
        assert d.client().info()["version"] == "1.0.0"
        assert sorted(p.name for p in (tmp_path / "state" / "models").iterdir()) == []
        # the end the kill interrupted is completed: the id is used up
        resp = send(options(broker), PREFIX, device, "update", {}, _signed(path), 30)
        assert resp.update.reason_code == "replay", resp.update
    finally:
        if d is not None:
            d.stop()
        http.close()
        watch.close()


def test_a_kill_before_a_rejection_is_reported(models, trusted, broker, tmp_path):
    """A rebuilt file that is not the manifest's: rejected; the agent dies as that is recorded."""
    _served, http, path = over_http(models, tmp_path, 8)
    device = "dev-unreported-rejected"
    watch = Observer(broker, "ota-unreported-rejected")
    d = None
    try:
        rec = _kill_between_record_and_report(
            tmp_path,
            UNREPORTED + "rejected",
            _resign(path, _lie_about_the_tokenizer),
            device,
            models,
            broker,
            trusted,
        )
        assert rec.state == R.REJECTED
        d = start(tmp_path, models, broker, trusted, device)
        final = wait_final(watch, device)
        assert final.phase == Phase.REJECTED, final
        assert final.reason_code in ("target_hash", "payload"), final
        assert transitions(watch, device) == [*HAPPY[:3], "REJECTED"]
        assert d.client().info()["version"] == "1.0.0"
        assert sorted(p.name for p in (tmp_path / "state" / "models").iterdir()) == []
    finally:
        if d is not None:
            d.stop()
        http.close()
        watch.close()
