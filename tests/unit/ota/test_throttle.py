"""The download's bandwidth cap (agent/ota/switch/throttle.py): its arithmetic on an injected
monotonic clock, and that a capped block download still fetches every byte."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent.ota.fetch import BLOCK, fetch_blocks
from agent.ota.switch.throttle import BURST_S, Throttle, throttle
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_rate_is_held_whatever_the_read_sizes() -> None:
    clock = Clock()
    cap = Throttle(1000, clock)
    assert cap.read_size(64 * 1024) == 1000  # a read never asks for more than a second's worth
    assert cap.delay(1000) == pytest.approx(1.0)  # 1000 bytes at t=0: next read at t=1
    clock.t += 1.0
    assert cap.delay(250) == pytest.approx(0.25)
    clock.t += 0.1  # the caller came back early (a cancel cut its wait): the debt stays
    assert cap.delay(500) == pytest.approx(0.65)
    clock.t += 0.65
    assert cap.delay(0) == pytest.approx(0.0)


def test_a_stall_earns_no_more_than_the_burst() -> None:
    clock = Clock()
    cap = Throttle(1000, clock)
    cap.delay(1000)
    clock.t += 60.0  # a slow source or a retry pause: a minute without a byte
    assert cap.delay(100) == 0.0  # forgiven, counted on from BURST_S ago
    assert cap.delay(int(BURST_S * 1000)) == pytest.approx(0.0)
    assert cap.delay(1000) == pytest.approx(1.0)  # then the rate again


def test_no_cap_is_none_and_a_negative_cap_is_an_error() -> None:
    assert throttle(0) is None
    assert throttle(5).bytes_s == 5  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="above 0"):
        Throttle(-1)


class Blocks:
    """A block server in memory: what the MQTT link would answer."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.asked: list[int] = []

    def fetch_block(self, request: opb.BlockRequest, timeout_s: float) -> opb.Block:
        self.asked.append(request.length)
        chunk = self.data[request.offset : request.offset + request.length]
        return opb.Block(update_id=request.update_id, offset=request.offset, data=chunk)


def test_a_capped_block_download_is_whole(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    source = Blocks(data)
    waits: list[float] = []
    clock = Clock()
    cap = Throttle(4096, clock)

    class Stop(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:  # the throttle's wait: no sleep
            waits.append(timeout or 0.0)
            clock.t += timeout or 0.0
            return False

    dest = tmp_path / "p.part"
    fetch_blocks(source, "u", dest, len(data), lambda n: None, Stop(), cap=cap)
    assert dest.read_bytes() == data
    assert max(source.asked) == 4096 < BLOCK  # blocks no bigger than a second's worth
    assert sum(waits) == pytest.approx(len(data) / 4096)
