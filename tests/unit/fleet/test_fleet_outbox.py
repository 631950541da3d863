"""The fleet outbox: events on disk until acknowledged, in order, across restarts.

Real files under tmp_path, no mocks: failures are made with real file-system conditions (a
file where the directory should be, RLIMIT_FSIZE for a full disk).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.fleet.device.outbox import SEQ_FILE, Outbox, event_name
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb


def reload_event(message: str = "ok", ok: bool = True) -> fpb.Event:
    return fpb.Event(
        device_id="pi-1", reload=fpb.ReloadDone(ok=ok, model="demo 1.0", message=message)
    )


def update_event(update_id: str) -> fpb.Event:
    return fpb.Event(
        device_id="pi-1",
        update=fpb.UpdateStatus(update_id=update_id, phase=fpb.UpdateStatus.COMMITTED),
    )


def drain(box: Outbox) -> list[fpb.Event]:
    """Deliver everything: peek, ack, until empty."""
    out = []
    while (e := box.peek()) is not None:
        out.append(e)
        box.ack(e.seq)
    return out


def event_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".event"))


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail with EFBIG: a full disk without a small filesystem."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


# ---------------------------------------------------------------------------------- basics


def test_append_assigns_seq_and_time_and_keeps_order(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "events", max_items=10)
    assert len(box) == 0 and box.peek() is None
    a = box.append(reload_event("a"))
    b = box.append(update_event("u-1"))
    c = box.append(fpb.Event(timestamp_unix=123.0, reload=fpb.ReloadDone(ok=False)))
    assert [a.seq, b.seq, c.seq] == [1, 2, 3]
    assert a.timestamp_unix > 1.6e9 and c.timestamp_unix == 123.0
    assert a.reload.message == "a" and b.update.update_id == "u-1"
    assert len(box) == 3
    assert event_files(tmp_path / "events") == [event_name(1), event_name(2), event_name(3)]
    assert event_name(42) == "000000000042.event"
    assert stat.S_IMODE((tmp_path / "events").stat().st_mode) & 0o077 == 0
    assert drain(box) == [a, b, c]
    assert len(box) == 0 and event_files(tmp_path / "events") == []


def test_caller_copies_are_independent(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_items=10)
    event = reload_event("original")
    stored = box.append(event)
    assert event.seq == 0  # the caller's message is left alone
    stored.reload.message = "changed"
    peeked = box.peek()
    assert peeked is not None and peeked.reload.message == "original"
    peeked.reload.message = "changed again"
    again = box.peek()
    assert again is not None and again.reload.message == "original"


def test_ack_removes_only_that_event_and_unknown_is_a_noop(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_items=10)
    for i in range(3):
        box.append(reload_event(str(i)))
    box.ack(99)
    box.ack(0)
    assert len(box) == 3
    box.ack(2)  # out of order
    assert event_files(tmp_path) == [event_name(1), event_name(3)]
    assert [e.seq for e in drain(box)] == [1, 3]
    box.ack(1)  # twice
    assert len(box) == 0


def test_event_without_kind_is_refused(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_items=10)
    with pytest.raises(ValueError, match="kind"):
        box.append(fpb.Event(device_id="pi-1"))
    assert len(box) == 0 and event_files(tmp_path) == []


def test_max_items_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_items"):
        Outbox(tmp_path, max_items=0)


# ---------------------------------------------------------------------------------- restarts


def test_restart_keeps_undelivered_in_order_and_seq_continues(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_items=10)
    sent = [box.append(reload_event(str(i))) for i in range(5)]
    box.ack(1)
    box.ack(2)

    box = Outbox(tmp_path, max_items=10)
    assert len(box) == 3
    assert box.peek() == sent[2]
    nxt = box.append(reload_event("after restart"))
    assert nxt.seq == 6
    assert drain(box) == [*sent[2:], nxt]


def test_seq_continues_after_everything_was_delivered(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_items=10)
    for i in range(4):
        box.append(reload_event(str(i)))
    drain(box)
    assert event_files(tmp_path) == []

    box = Outbox(tmp_path, max_items=10)
    assert len(box) == 0 and box.peek() is None
    assert box.append(reload_event()).seq == 5
    drain(box)
    assert Outbox(tmp_path, max_items=10).append(reload_event()).seq == 6


def test_seq_file_lost_or_behind_falls_back_to_the_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = Outbox(tmp_path, max_items=10)
    for _ in range(3):
        box.append(reload_event())
    (tmp_path / SEQ_FILE).write_text("1\n")  # behind the files (never by the outbox, but)
    assert Outbox(tmp_path, max_items=10).append(reload_event()).seq == 4
    (tmp_path / SEQ_FILE).write_text("garbage")
    with caplog.at_level(logging.WARNING):
        assert Outbox(tmp_path, max_items=10).append(reload_event()).seq == 5
    assert "last_seq" in caplog.text


# ---------------------------------------------------------------------------------- bounds


def test_max_items_drops_oldest_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = Outbox(tmp_path, max_items=3)
    with caplog.at_level(logging.WARNING):
        sent = [box.append(reload_event(str(i))) for i in range(5)]
    assert len(box) == 3 and box.dropped == 2
    assert event_files(tmp_path) == [event_name(3), event_name(4), event_name(5)]
    assert sum("outbox full" in r.getMessage() for r in caplog.records) == 2
    box.ack(1)  # dropped while in flight: its late PUBACK is harmless
    assert drain(box) == sent[2:]


def test_smaller_max_items_at_restart_drops_oldest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = Outbox(tmp_path, max_items=10)
    for i in range(6):
        box.append(reload_event(str(i)))
    with caplog.at_level(logging.WARNING):
        box = Outbox(tmp_path, max_items=2)
    assert box.dropped == 4 and [e.seq for e in drain(box)] == [5, 6]
    assert sum("dropped the oldest" in r.getMessage() for r in caplog.records) == 1
    assert event_files(tmp_path) == []


# ---------------------------------------------------------------------------------- scan


def test_scan_removes_temp_and_corrupt_files_and_keeps_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = Outbox(tmp_path, max_items=20)
    good = [box.append(update_event(f"u-{i}")) for i in range(3)]
    data = (tmp_path / event_name(2)).read_bytes()
    # a whole event cut at every length, its seq matching its name: each cut is refused (a
    # DecodeError, or the kind missing when the cut falls between fields)
    cuts = 0
    for seq in range(200, 200 + len(data) + 8):
        whole = fpb.Event()
        whole.CopyFrom(good[1])
        whole.seq = seq
        full = whole.SerializeToString()
        if seq - 200 < len(full):
            (tmp_path / event_name(seq)).write_bytes(full[: seq - 200])
            cuts += 1
    (tmp_path / event_name(9)).write_bytes(data)  # seq 2 inside, named 9
    (tmp_path / "abc.event").write_bytes(data)  # not a seq name
    (tmp_path / "0042.event").write_bytes(data)  # not zero-padded to 12
    (tmp_path / event_name(10)).write_bytes(b"\xff" * 40)  # not protobuf
    (tmp_path / f".{event_name(4)}.x1y2.tmp").write_bytes(data[:5])  # a crash mid-write
    (tmp_path / ".last_seq.abc.tmp").write_text("9")
    (tmp_path / "README").write_text("not ours: left alone")
    corrupt = cuts + 4

    with caplog.at_level(logging.INFO):
        box = Outbox(tmp_path, max_items=20)

    assert drain(box) == good
    assert sorted(os.listdir(tmp_path)) == ["README", SEQ_FILE]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"outbox {tmp_path}: deleted {corrupt} corrupt event files"]
    assert "deleted 2 temp files" in caplog.text
    # the last seq comes from the seq file, not from the highest (corrupt) name
    assert box.append(reload_event()).seq == 4


# ---------------------------------------------------------------------------------- I/O errors


def test_directory_that_is_a_file_keeps_events_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events"
    path.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING):
        box = Outbox(path, max_items=3)
        sent = [box.append(reload_event(str(i))) for i in range(4)]
    assert [e.seq for e in sent] == [1, 2, 3, 4]
    assert len(box) == 3 and box.dropped == 1
    assert "kept in memory" in caplog.text
    assert drain(box) == sent[1:]
    assert path.read_text() == "a file where the directory should be"


def test_directory_gone_after_open_keeps_events_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events"
    box = Outbox(path, max_items=10)
    first = box.append(reload_event("on disk"))
    shutil.rmtree(path)
    path.write_text("now a file")
    with caplog.at_level(logging.WARNING):
        second = box.append(reload_event("in memory"))
        third = box.append(reload_event("in memory too"))
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1  # once per outage
    assert drain(box) == [first, second, third]


def test_full_disk_keeps_events_in_memory_until_a_write_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = Outbox(tmp_path, max_items=10)
    a = box.append(reload_event("a"))
    with caplog.at_level(logging.INFO), file_size_limit(1):
        b = box.append(reload_event("b" * 100))
        c = box.append(update_event("u-c"))
    assert "File too large" in caplog.text
    assert event_files(tmp_path) == [event_name(1)]
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []
    assert len(box) == 3 and box.peek() == a

    box.ack(a.seq)
    with caplog.at_level(logging.INFO):
        d = box.append(reload_event("d"))  # the disk is back: b and c are saved too
    assert "writable again" in caplog.text
    assert event_files(tmp_path) == [event_name(2), event_name(3), event_name(4)]
    assert drain(Outbox(tmp_path, max_items=10)) == [b, c, d]


def test_acked_while_only_in_memory_is_never_written(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_items=10)
    with file_size_limit(1):
        b = box.append(reload_event("b"))
    box.ack(b.seq)
    box.append(reload_event("c"))
    assert event_files(tmp_path) == [event_name(2)]


# ---------------------------------------------------------------------------------- threads


def test_append_and_deliver_from_two_threads(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_items=1000)
    n = 100
    seen: list[int] = []
    done = threading.Event()

    def deliver() -> None:  # the MQTT network thread
        while len(seen) < n:
            e = box.peek()
            if e is None:
                done.wait(0.001)
                continue
            seen.append(e.seq)
            box.ack(e.seq)

    consumer = threading.Thread(target=deliver)
    consumer.start()
    for i in range(n):
        box.append(reload_event(str(i)))
    consumer.join(timeout=60)
    done.set()
    assert not consumer.is_alive()
    assert seen == list(range(1, n + 1))
    assert len(box) == 0 and event_files(tmp_path) == []
