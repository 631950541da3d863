"""The update's staging step: rebuild the new model directory from the one the update started
from and the payload, beside it (`<dir>.staging`), check every file against the manifest, fsync
it and rename it into place. The record names the directory before anything is written, so a
crash leaves nothing that the updater cannot find and remove."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from agent.ota.artifact.manifest import UpdateRejected
from agent.ota.delta import files as delta
from agent.ota.faults import CRASH_ENV, crash_when_written
from agent.ota.store import Store
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb


async def stage(store: Store, rec: opb.UpdateRecord, m: opb.Manifest) -> Path:
    """Build the model directory of `m` from `rec.previous_model_dir` and the downloaded
    payload (removed once the directory is in place); its path. Raises UpdateRejected
    "target_hash" when the rebuilt files are not the manifest's."""
    target = store.model_dir_for(m.version, m.target_model_sha256)
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)  # a crash mid-staging leaves a partial one
    base = Path(rec.previous_model_dir)
    part = store.payload_path(m.update_id)
    rec.staged_model_dir = str(target)
    store.save(rec)
    if os.environ.get(CRASH_ENV) == "mid-staging":
        crash_when_written(staging)
    files = await asyncio.to_thread(delta.patch_dirs, base, part, staging)
    want = {f.name: (f.sha256, f.size) for f in m.files}
    got = {name: (sha, size) for name, sha, size in files}
    if got != want:
        shutil.rmtree(staging, ignore_errors=True)
        raise UpdateRejected("target_hash", f"rebuilt files {got} != manifest {want}")
    _fsync_tree(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    _fsync_dir(target.parent)
    part.unlink(missing_ok=True)
    return target


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)
