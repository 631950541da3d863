"""Downloading an update's payload into `<state>/ota/payload/<id>.part`, resumable: HTTP(S)
ranges from the manifest's URL, or MQTT blocks asked for by offset (fleets with only a broker).
Both append to the same partial file and never write past the manifest's declared size.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from agent.base.errors import AgentError
from agent.ota.switch.throttle import Throttle
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
BLOCK = 64 * 1024  # MQTT block size: well below common broker packet limits
HTTP_TIMEOUT_S = 30.0
Progress = Callable[[int], None]


class PayloadTooLarge(AgentError):
    """The source sent more than the manifest declared."""


class DownloadFailed(AgentError):
    """The source cannot be used right now (retry later)."""


class BlockSource(Protocol):
    """Asks for one block over MQTT (the fleet link); None on timeout."""

    def fetch_block(self, request: opb.BlockRequest, timeout_s: float) -> opb.Block | None: ...


def _open_part(path: Path, total: int) -> tuple[BinaryIO, int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "ab")  # noqa: SIM115 - closed by the caller
    have = f.tell()
    if have > total:  # cannot happen through this module; a damaged file starts over
        f.truncate(0)
        have = 0
    return f, have


def _close(f: BinaryIO) -> None:
    """Flush, fsync and close `f`; closed even when the flush fails (ENOSPC: the buffered tail
    does not fit), so no descriptor outlives the download and the cleanup frees the space."""
    try:
        f.flush()
        os.fsync(f.fileno())
    finally:
        f.close()  # (a failing flush again; the descriptor is released all the same)


def _append(f: BinaryIO, data: bytes, have: int, total: int) -> int:
    if have + len(data) > total:
        raise PayloadTooLarge(
            f"the source sent more than the declared {total} bytes (at least {have + len(data)})"
        )
    f.write(data)
    return have + len(data)


def fetch_http(
    url: str,
    dest: Path,
    total: int,
    progress: Progress,
    stop: threading.Event,
    cap: Throttle | None = None,
) -> None:
    """Fetch `url` into `dest` until it holds `total` bytes, resuming from what it holds
    (at most `cap`'s rate)."""
    f, have = _open_part(dest, total)
    try:
        if have == total:
            return
        req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            resp = urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S)
        except (urllib.error.URLError, OSError) as exc:
            raise DownloadFailed(f"GET {url}: {exc}") from exc
        with resp:
            if have and resp.status == 200:  # the server ignored the range: start over
                log.info("update download: %s does not resume; starting over", url)
                f.truncate(0)
                f.seek(0)
                have = 0
            elif have and resp.status != 206:
                raise DownloadFailed(f"GET {url}: HTTP {resp.status} for a range request")
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and have + int(length) > total:
                raise PayloadTooLarge(
                    f"{url} announces {have + int(length)} bytes, the manifest declares {total}"
                )
            while not stop.is_set():
                try:
                    data = resp.read(cap.read_size(CHUNK) if cap else CHUNK)
                except (OSError, http.client.HTTPException) as exc:
                    raise DownloadFailed(f"GET {url}: {exc}") from exc
                if not data:
                    break
                have = _append(f, data, have, total)
                progress(have)
                if cap is not None:
                    cap.wait(len(data), stop)
            if have == total and resp.read(1):
                raise PayloadTooLarge(f"{url} sends more than the declared {total} bytes")
    finally:
        _close(f)
    if not stop.is_set() and have < total:
        raise DownloadFailed(f"GET {url}: the connection ended at {have} of {total} bytes")


def fetch_blocks(
    source: BlockSource,
    update_id: str,
    dest: Path,
    total: int,
    progress: Progress,
    stop: threading.Event,
    timeout_s: float = 10.0,
    cap: Throttle | None = None,
) -> None:
    """Ask for blocks from where `dest` ends until it holds `total` bytes (at most `cap`'s
    rate)."""
    f, have = _open_part(dest, total)
    try:
        while have < total and not stop.is_set():
            want = min(cap.read_size(BLOCK) if cap else BLOCK, total - have)
            block = source.fetch_block(
                opb.BlockRequest(update_id=update_id, offset=have, length=want), timeout_s
            )
            if block is None:
                raise DownloadFailed(f"no block at offset {have} within {timeout_s:.0f} s")
            if block.total and block.total != total:
                raise PayloadTooLarge(
                    f"the block server's payload is {block.total} bytes, the manifest declares "
                    f"{total}"
                )
            if len(block.data) > want:
                raise PayloadTooLarge(f"a block of {len(block.data)} bytes for {want} asked")
            if not block.data:
                raise DownloadFailed(f"empty block at offset {have}")
            have = _append(f, block.data, have, total)
            progress(have)
            if cap is not None:
                cap.wait(len(block.data), stop)
            if have % (16 * BLOCK) == 0:
                f.flush()
                os.fsync(f.fileno())
    finally:
        _close(f)


class RateLimit:
    """At most one call per `interval_s` (plus the last one, forced)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = 0.0

    def ready(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False
