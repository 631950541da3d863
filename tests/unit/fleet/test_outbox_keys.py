"""The outbox's idempotency keys: an event whose key was taken is not recorded again — while it
waits, after it was delivered, after a restart, and when a crash came between the event file
and the keys file. Real files under tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

from agent.fleet.device.outbox import KEYS_FILE, MAX_KEYS, Outbox
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb


def status(phase: int, key: str = "", message: str = "") -> fpb.Event:
    return fpb.Event(
        update=fpb.UpdateStatus(update_id="u-1", phase=phase, message=message),  # type: ignore[arg-type]
        key=key,
    )


def drain(box: Outbox) -> list[fpb.Event]:
    out = []
    while (e := box.peek()) is not None:
        out.append(e)
        box.ack(e.seq)
    return out


def test_a_key_is_recorded_once_waiting_delivered_or_restarted(tmp_path: Path) -> None:
    box = Outbox(tmp_path, 100)
    first = box.append(status(fpb.UpdateStatus.VERIFIED, "update/u-1/VERIFIED"))
    assert first is not None and first.key == "update/u-1/VERIFIED"
    assert box.append(status(fpb.UpdateStatus.VERIFIED, "update/u-1/VERIFIED")) is None  # waiting
    assert [e.seq for e in drain(box)] == [first.seq]
    assert box.append(status(fpb.UpdateStatus.VERIFIED, "update/u-1/VERIFIED")) is None  # sent
    again = Outbox(tmp_path, 100)  # a restart
    assert again.append(status(fpb.UpdateStatus.VERIFIED, "update/u-1/VERIFIED")) is None
    assert drain(again) == []
    # another key, and events without a key (download progress), are recorded each time
    staged = again.append(status(fpb.UpdateStatus.STAGED, "update/u-1/STAGED"))
    p1 = again.append(status(fpb.UpdateStatus.DOWNLOADING, message="10 of 20 bytes"))
    p2 = again.append(status(fpb.UpdateStatus.DOWNLOADING, message="10 of 20 bytes"))
    assert staged is not None and p1 is not None and p2 is not None
    assert [e.seq for e in drain(again)] == [staged.seq, p1.seq, p2.seq]
    assert staged.seq > first.seq


def test_a_crash_between_the_event_file_and_the_keys_file_keeps_the_key(tmp_path: Path) -> None:
    box = Outbox(tmp_path, 100)
    box.append(status(fpb.UpdateStatus.RECEIVED, "update/u-1/RECEIVED"))
    box.append(status(fpb.UpdateStatus.TRIAL, "update/u-1/TRIAL"))
    # as if the process died after writing the TRIAL event but before the keys file
    (tmp_path / KEYS_FILE).write_text("update/u-1/RECEIVED\n")
    after = Outbox(tmp_path, 100)
    assert after.has_key("update/u-1/TRIAL")  # from the undelivered event itself
    assert after.append(status(fpb.UpdateStatus.TRIAL, "update/u-1/TRIAL")) is None
    assert [e.key for e in drain(after)] == ["update/u-1/RECEIVED", "update/u-1/TRIAL"]
    # and with no keys file at all
    os.unlink(tmp_path / KEYS_FILE)
    box = Outbox(tmp_path, 100)
    box.append(status(fpb.UpdateStatus.STAGED, "update/u-1/STAGED"))
    os.unlink(tmp_path / KEYS_FILE)
    assert (
        Outbox(tmp_path, 100).append(status(fpb.UpdateStatus.STAGED, "update/u-1/STAGED")) is None
    )


def test_the_keys_kept_are_bounded_oldest_first(tmp_path: Path) -> None:
    box = Outbox(tmp_path, 10)
    for i in range(MAX_KEYS + 5):
        box.append(status(fpb.UpdateStatus.RECEIVED, f"update/u-{i}/RECEIVED"))
        drain(box)
    lines = (tmp_path / KEYS_FILE).read_text().splitlines()
    assert len(lines) == MAX_KEYS
    assert lines[0] == "update/u-5/RECEIVED" and lines[-1] == f"update/u-{MAX_KEYS + 4}/RECEIVED"
    after = Outbox(tmp_path, 10)
    assert not after.has_key("update/u-0/RECEIVED")
    assert after.has_key("update/u-5/RECEIVED")
