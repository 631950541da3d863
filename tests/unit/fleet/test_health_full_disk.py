"""Health on a filling disk (issue 35): the free space of the state directory's filesystem, read
on a real tmpfs the test mounts, flagged `low` below `[updates] min_free_bytes`; the flag is a
change that goes out at once, and its crossing is one log line each way, not one per health."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.fleet.device.health import HealthReporter, changes, read_disk
from tests.support.tmpfs import PAGE, fill, tmpfs
from tests.unit.fleet.test_fleet_health import agent_status, model_info, thermal

pytestmark = pytest.mark.root

MiB = 1 << 20


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "state", 8 * MiB) as path:
        yield path


def test_free_space_and_the_low_flag_are_the_filesystems(fs: Path) -> None:
    d = read_disk(fs, min_free_bytes=2 * MiB)
    assert (d.path, d.total_bytes, d.free_bytes) == (str(fs), 8 * MiB, 8 * MiB)
    assert d.min_free_bytes == 2 * MiB and not d.low
    filler = fill(fs, leave=MiB)
    d = read_disk(fs / "ota" / "payload", min_free_bytes=2 * MiB)  # not made yet: its parent
    assert MiB - PAGE <= d.free_bytes <= MiB + PAGE and d.total_bytes == 8 * MiB
    assert d.low
    assert not read_disk(fs).low  # no threshold, no flag
    filler.unlink()
    assert not read_disk(fs, min_free_bytes=2 * MiB).low


def test_crossing_the_threshold_is_a_change_and_one_log_line_each_way(
    fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    r = HealthReporter(device_id="pi-1", session=1, interval_s=60, min_interval_s=0)
    status, info = agent_status(), model_info()

    def tick(now: float):  # type: ignore[no-untyped-def]
        disk = read_disk(fs, min_free_bytes=2 * MiB)
        return r.next(status, info, thermal=thermal(), disk=disk, last_update=None, now=now)

    assert tick(1.0) is not None  # the first
    assert tick(2.0) is None  # nothing changed
    filler = fill(fs, leave=MiB)
    caplog.set_level(logging.INFO, logger="agent.fleet.device.health")
    low = tick(3.0)
    assert low is not None and low.disk.low  # out at once, not at the heartbeat
    assert tick(4.0) is None and tick(5.0) is None  # still low: no new message, no new line
    filler.unlink()
    back = tick(6.0)
    assert back is not None and not back.disk.low
    assert "disk" in changes(low, back)
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("disk:")]
    assert len(lines) == 2, lines
    assert "below updates.min_free_bytes (2097152)" in lines[0] and "no_space" in lines[0]
    assert "back above" in lines[1]
    warned = [rec for rec in caplog.records if rec.getMessage().startswith("disk:")]
    assert [rec.levelno for rec in warned] == [logging.WARNING, logging.INFO]
