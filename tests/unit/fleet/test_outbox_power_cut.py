"""The outbox across a power cut at every fsync/rename boundary (tests/support/lazyfs.py):
every event whose `append` returned is there after the cut, whole; a delivered one may come
back (at least once); seqs keep increasing and a taken idempotency key stays taken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.fleet.device.outbox import Outbox
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.lazyfs import LazyFS, every_cut, mounted

pytestmark = pytest.mark.fuse


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path) as mount:
        yield mount


def _event(n: int) -> fpb.Event:
    return fpb.Event(
        device_id="pi-1",
        key=f"k{n}",
        reload=fpb.ReloadDone(ok=True, model="demo", message=f"event {n}"),
    )


def _operation(state: Path, done: list[Any]) -> None:
    box = Outbox(state / "outbox", max_items=10)
    for n in range(1, 4):
        stored = box.append(_event(n))
        assert stored is not None
        if box._disk_ok:  # the disk took it: recorded (not only held in memory)
            done.append(("recorded", stored))
    first = box.peek()
    assert first is not None
    box.ack(first.seq)
    done.append(("delivered", first.seq))
    box.append(_event(4))


def _check(state: Path, done: list[Any]) -> list[str]:
    """Re-open the outbox as the daemon does at start; what is wrong."""
    box = Outbox(state / "outbox", max_items=10)
    waiting: dict[int, fpb.Event] = {}
    while (e := box.peek()) is not None:
        waiting[e.seq] = e
        box.ack(e.seq)
    delivered = {seq for what, seq in done if what == "delivered"}
    wrong = []
    for what, event in done:
        if what != "recorded":
            continue
        if event.seq not in delivered and waiting.get(event.seq) != event:
            wrong.append(f"recorded event {event.seq} is {waiting.get(event.seq)}")
        if not box.has_key(event.key):
            wrong.append(f"the key of recorded event {event.seq} was forgotten")
    again = box.append(fpb.Event(device_id="pi-1", reload=fpb.ReloadDone(ok=True)))
    assert again is not None
    top = max([e.seq for w, e in done if w == "recorded"] + list(waiting), default=0)
    if again.seq <= top:
        wrong.append(f"seq {again.seq} given out again (events up to {top} existed)")
    return wrong


def test_no_recorded_event_is_lost_at_any_cut(lazyfs: tuple[LazyFS, Path]) -> None:
    """From the first start (the outbox's directory made then) to an ack and more appends."""
    fs, mnt = lazyfs
    state = mnt / "state"

    def setup(m: Path) -> None:
        state.mkdir()

    problems: list[str] = []

    def check(m: Path, done: list[Any], where: str) -> None:
        problems.extend(f"{where}: {p}" for p in _check(state, done))

    def operation(m: Path, done: list[Any]) -> None:
        _operation(state, done)

    points = every_cut(fs, mnt, setup, operation, check)
    assert points > 20
    assert problems == [], "\n".join(problems[:8])
