"""A payload file that meets ENOSPC is closed, whatever failed (issue 35): the final flush of a
download into a full filesystem raises, and the file must not stay open behind it (a leaked
descriptor, and on a full disk a half-written file the cleanup cannot free while it is held).
A real tmpfs the test mounts, filled to a few pages; the blocks come from memory."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.ota.fetch import fetch_blocks
from agent.ota.space import is_no_space
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.tmpfs import PAGE, fill, tmpfs

pytestmark = pytest.mark.root


class _SmallBlocks:
    """The payload in blocks smaller than asked for: each stays in the file's write buffer until
    the buffer is full or the download ends, so the last of them reach the disk only at the
    final flush."""

    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    def fetch_block(self, request: opb.BlockRequest, timeout_s: float) -> opb.Block | None:
        end = request.offset + min(request.length, self.size)
        return opb.Block(data=self.data[request.offset : end], total=len(self.data))


def _open_on(path: Path) -> list[str]:
    """The descriptors of this process open on `path`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                found.append(fd)
        except OSError:
            continue
    return found


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", 1 << 20) as path:
        yield path


@pytest.mark.parametrize("room_pages", [0, 2])
def test_a_download_into_a_full_disk_raises_enospc_and_closes_its_file(
    fs: Path, room_pages: int
) -> None:
    filler = fill(fs, leave=room_pages * PAGE)
    part = fs / "payload" / "u.part"
    part.parent.mkdir()
    data = os.urandom((room_pages + 3) * PAGE)  # more than fits: the last bytes cannot be written
    with pytest.raises(OSError) as raised:
        fetch_blocks(
            _SmallBlocks(data, 1000), "u", part, len(data), lambda n: None, threading.Event()
        )
    assert is_no_space(raised.value), raised.value
    assert _open_on(part) == [], "the payload file is still open"
    # and the space is given back once the cleanup removes it
    part.unlink()
    filler.unlink()
    assert not part.exists()
