"""The outbox on a full disk (issue 35): a report appended while the state directory's
filesystem is full (ENOSPC, a real tmpfs the test mounts) is taken and kept in memory, the
events already on disk stay, whole and in order, delivery and acks go on, an idempotency key
taken in the outage is still refused, and once there is room the next append writes everything
that waited, so a restart finds every event not delivered and every key."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.fleet.device.outbox import Outbox, event_name
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.tmpfs import fill, free

pytestmark = pytest.mark.root


def _update(update_id: str, phase: int, key: bool = True) -> fpb.Event:
    status = fpb.UpdateStatus(update_id=update_id, phase=phase)  # type: ignore[arg-type]
    name = fpb.UpdateStatus.Phase.Name(phase)
    return fpb.Event(
        device_id="pi-1", update=status, key=f"update/{update_id}/{name}" if key else ""
    )


def _files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith((".event", ".tmp")))


def test_reports_on_a_full_disk_wait_in_memory_and_reach_the_disk_when_room_is_back(
    one_mib_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    P = fpb.UpdateStatus
    box = Outbox(one_mib_fs / "events", max_items=100)
    a = box.append(_update("u1", P.RECEIVED))
    b = box.append(_update("u1", P.DOWNLOADING))
    assert a is not None and b is not None
    filler = fill(one_mib_fs, leave=0)
    assert free(one_mib_fs) == 0
    with caplog.at_level(logging.INFO, logger="agent.fleet.device.outbox"):
        c = box.append(_update("u1", P.REJECTED))  # the no_space report, say
        d = box.append(_update("u1", P.REJECTED))  # re-derived after a restart: same key
        e = box.append(_update("u1", P.DOWNLOADING, key=False))  # progress: no key
    assert c is not None and d is None and e is not None
    assert "No space left on device" in caplog.text
    assert _files(one_mib_fs / "events") == [
        event_name(a.seq),
        event_name(b.seq),
    ]  # no partial file
    # delivery goes on, from disk and from memory, in order
    assert box.peek() == a
    box.ack(a.seq)  # frees a's file: room for one page
    assert [box.peek()] == [b]
    box.ack(b.seq)
    assert box.peek() == c
    # room again: the next append writes what waited
    filler.unlink()
    with caplog.at_level(logging.INFO, logger="agent.fleet.device.outbox"):
        f = box.append(_update("u2", P.RECEIVED))
    assert f is not None and "writable again" in caplog.text
    assert _files(one_mib_fs / "events") == [event_name(s) for s in (c.seq, e.seq, f.seq)]
    again = Outbox(one_mib_fs / "events", max_items=100)  # a restart
    assert [again.peek()] == [c]
    assert again.has_key(c.key) and again.has_key(f.key)
    assert again.append(_update("u1", P.REJECTED)) is None
    got = []
    while (ev := again.peek()) is not None:
        got.append(ev)
        again.ack(ev.seq)
    assert got == [c, e, f]
