"""The state lock on a full disk (issue 35): the lock is the `flock`, the pid written into the
file only tells a refused daemon who holds it, so a disk with no room for that pid must not
keep the daemon from starting and serving. A real tmpfs the test mounts, filled to the brim."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.base.errors import AlreadyRunning
from agent.base.statelock import LOCK_NAME, StateLock
from tests.support.tmpfs import fill, free

pytestmark = pytest.mark.root


def test_a_full_disk_still_gives_the_lock_without_the_pid(
    one_mib_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fill(one_mib_fs, leave=0)
    assert free(one_mib_fs) == 0
    with caplog.at_level(logging.WARNING, logger="agent.base.statelock"):
        lock = StateLock.acquire(one_mib_fs / "state")
    try:
        assert (one_mib_fs / "state" / LOCK_NAME).read_bytes() == b""
        assert "No space left on device" in caplog.text and "no pid in" in caplog.text
        with pytest.raises(AlreadyRunning, match="has not written its pid yet"):
            StateLock.acquire(one_mib_fs / "state")  # held all the same
    finally:
        lock.release()
    StateLock.acquire(one_mib_fs / "state").release()  # and let go


def test_a_lock_file_from_an_earlier_run_takes_the_new_pid_on_a_full_disk(one_mib_fs: Path) -> None:
    StateLock.acquire(one_mib_fs / "state").release()  # the file and its page exist
    fill(one_mib_fs, leave=0)
    lock = StateLock.acquire(one_mib_fs / "state")  # truncating frees the page the pid then takes
    try:
        assert (one_mib_fs / "state" / LOCK_NAME).read_text().strip().isdigit()
    finally:
        lock.release()
