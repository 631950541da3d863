"""The update's download step: fetch the payload into the store (resuming a partial file,
retrying a source that fails, the progress persisted and reported), then check its sha256
against the manifest. Runs on the daemon's event loop; the fetch runs in a worker thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from agent.config.file import UpdatesConfig
from agent.model.directory import sha256_file
from agent.ota.artifact.manifest import UpdateRejected
from agent.ota.faults import crash_point
from agent.ota.fetch import BlockSource, DownloadFailed, RateLimit, fetch_blocks, fetch_http
from agent.ota.interrupt import Interrupt
from agent.ota.reports import Reports
from agent.ota.store import Store
from agent.ota.switch.throttle import Throttle, throttle
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)


async def download(
    rec: opb.UpdateRecord,
    m: opb.Manifest,
    *,
    store: Store,
    config: UpdatesConfig,
    reports: Reports,
    blocks: BlockSource | None,
    interrupt: Interrupt,
    check_times: Callable[[], None],
) -> None:
    """Fetch the payload of `m` into `store.payload_path` and verify its sha256; raise
    UpdateRejected when it expires (`check_times`, before every attempt: it judges the
    manifest's window only on a synchronized clock), is cancelled, is given up on or does not
    match."""
    part = store.payload_path(m.update_id)
    cap = throttle(config.switch.max_download_bytes_s)  # one rate across attempts
    limit = RateLimit(config.progress_interval_s)

    def progress(have: int) -> None:
        rec.downloaded = have
        if have < m.payload_size:
            crash_point("mid-download")
        if limit.ready(force=have == m.payload_size):
            store.save(rec)
            reports.progress(rec, f"{have} of {m.payload_size} bytes")

    while not rec.local_payload:  # (installed from this machine: delivered with it)
        check_times()
        before = _size(part)
        try:
            await asyncio.to_thread(_fetch, m, part, progress, blocks, interrupt.stop, cap)
            break
        except DownloadFailed as exc:
            interrupt.check()
            # an attempt that added bytes starts a new count: only a source that ends short
            # (or fails) every time without progress is given up on
            rec.failed_attempts = 1 if _size(part) > before else rec.failed_attempts + 1
            store.save(rec)  # the count survives a restart
            limit_n = config.max_download_attempts
            if rec.failed_attempts >= limit_n:
                raise UpdateRejected(
                    "payload",
                    f"gave up after {rec.failed_attempts} download attempts in a row without "
                    f"progress (updates.max_download_attempts = {limit_n}): {exc}",
                ) from exc
            log.warning(
                "update %s: download attempt %d of %d failed: %s; retrying in %.0f s",
                m.update_id,
                rec.failed_attempts,
                limit_n,
                exc,
                config.retry_s,
            )
            await interrupt.pause(config.retry_s)
    if rec.local_payload and _size(part) != m.payload_size:
        raise UpdateRejected(
            "payload",
            f"the payload installed with it is {_size(part)} of {m.payload_size} bytes; "
            "install the bundle again",
        )
    interrupt.check()  # a cancel stops the fetch early: the file is not whole
    digest = await asyncio.to_thread(sha256_file, part)
    if digest != m.payload_sha256:
        part.unlink(missing_ok=True)
        raise UpdateRejected(
            "payload_hash",
            f"payload sha256 {digest[:12]}… != manifest {m.payload_sha256[:12]}…",
        )


def _fetch(
    m: opb.Manifest,
    part: Path,
    progress: Callable[[int], None],
    blocks: BlockSource | None,
    stop: threading.Event,
    cap: Throttle | None,
) -> None:
    if m.payload_url:
        fetch_http(m.payload_url, part, m.payload_size, progress, stop, cap)
    elif blocks is not None:
        fetch_blocks(blocks, m.update_id, part, m.payload_size, progress, stop, cap=cap)
    else:
        raise UpdateRejected("no_transport", "no payload URL and no fleet link")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
