"""A full disk and updates (docs/UPDATES.md): the space an update needs, checked at the offer
(the payload and the new model directory in the state directory, the new model's first load in
the weight cache directory) and again before the new model loads (its first load), and what an
update that meets ENOSPC anyway leaves — nothing. Its payload and the directory it was building
are removed before its record and report are written (they need the room), it ends REJECTED
with code `no_space` (ROLLED_BACK if its new model was loading beside the serving one: that
state says what happened, the code why), and its id stays usable: the device does not retry
by itself, a later offer of the same update (a rollout's `retry-failed`) starts it again once
the check at the offer passes, i.e. once space is back.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from agent.base.errors import AgentError
from agent.model import room
from agent.ota.artifact.manifest import UpdateRejected
from agent.ota.cleanup import Cleanup
from agent.ota.reports import Reports, manifest_of
from agent.ota.store import Installed, ModelRef, Store
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

R = opb.UpdateRecord
NO_SPACE = "no_space"
_LOAD = "first load of the new model, a bound"
AGAIN = "; offer it again once there is room"
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
ENDED = (R.COMMITTED, R.ROLLED_BACK, R.REJECTED)


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, is ENOSPC/EDQUOT."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Bytes available on the filesystem of `path` (or its nearest existing parent)."""
    return room.free_bytes(path)


def needed_bytes(m: opb.Manifest) -> int:
    """The most an update holds in the state directory at once: the payload and the rebuilt
    model directory (the payload is removed only once the directory is in place)."""
    return int(m.payload_size) + sum(int(f.size) for f in m.files)


def first_load_bytes(m: opb.Manifest) -> int:
    """A bound of what loading the new model the first time writes to the weight cache
    directory (its prepared copy and packed weights, `agent.model.room.first_load_bound`),
    from the size of the model file the manifest names (`target_model_sha256`)."""
    sizes = [int(f.size) for f in m.files if f.sha256 == m.target_model_sha256]
    return room.first_load_bound(max(sizes or [int(f.size) for f in m.files] or [0]))


def _refuse(where: Path, need: int, what: str, margin: int) -> None:
    free = free_bytes(where)
    if free is not None and free < need + margin:
        raise UpdateRejected(
            NO_SPACE,
            f"the update needs {need} bytes on the filesystem of {where} ({what}) and {margin} "
            f"more are kept free (updates.min_free_bytes); {free} are free: offer it again "
            "once there is room",
        )


def check(m: opb.Manifest, store: Store, margin: int, cache_dir: Path | None = None) -> None:
    """At the offer: raise UpdateRejected `no_space` unless the state directory's filesystem has
    room for the payload and the new model directory, and the weight cache directory's (the
    same or another) for the new model's first load, each with `margin`
    (`updates.min_free_bytes`) beside it."""
    state = store.models.parent
    what = f"payload {m.payload_size} + model files {needed_bytes(m) - m.payload_size}"
    need, load = needed_bytes(m), first_load_bytes(m) if cache_dir is not None else 0
    if cache_dir is not None and room.device_of(cache_dir) == room.device_of(state):
        _refuse(state, need + load, what + f" + {_LOAD} {load}", margin)
        return
    _refuse(state, need, what, margin)
    if cache_dir is not None:
        _refuse(cache_dir, load, f"{_LOAD} {load}", margin)


def check_activation(m: opb.Manifest, cache_dir: Path | None, margin: int) -> None:
    """Before the new model loads: raise UpdateRejected `no_space` unless the weight cache
    directory has room for its first load and `margin`. Room may have gone since the offer;
    a load without it would serve the model unprepared, its weights packed in memory
    (agent/runtime/prepare/cachefiles.py), at every start until there is room."""
    if cache_dir is not None:
        load = first_load_bytes(m)
        _refuse(cache_dir, load, f"{_LOAD} {load}", margin)


def retryable(rec: opb.UpdateRecord) -> bool:
    """An update that ended for want of space, rejected, or rolled back while its new model
    loaded beside the serving one (it never served): its id is not used up."""
    return rec.state in (R.REJECTED, R.ROLLED_BACK) and rec.reason_code == NO_SPACE


def attempt(previous: opb.UpdateRecord | None, m: opb.Manifest) -> int:
    """The attempt number of a new record for `m`: one more than the previous record's when that
    was the same update ended `no_space` (its reports get new idempotency keys), else 0."""
    same = previous is not None and manifest_of(previous).update_id == m.update_id
    return previous.attempt + 1 if same and previous is not None and retryable(previous) else 0


def release(cleanup: Cleanup, rec: opb.UpdateRecord) -> None:
    """Remove what the update wrote: its payload, and the model directory it built or was
    building unless something names it (the serving, last known good or previous model)."""
    cleanup.store.payload_path(manifest_of(rec).update_id).unlink(missing_ok=True)
    cleanup.remove_built(rec)


def complete(cleanup: Cleanup, rec: opb.UpdateRecord) -> None:
    """`Cleanup.complete`, except that a `no_space` end leaves its id usable."""
    if retryable(rec):
        release(cleanup, rec)
    else:
        cleanup.complete(rec)


def save_final(store: Store, rec: opb.UpdateRecord) -> None:
    """Save an ended record; a `no_space` end whose record still does not fit (something else
    filled the disk) is logged and left: the record on disk keeps its earlier state, which the
    next start resumes (and meets the full disk again, or finishes)."""
    try:
        store.save(rec)
    except OSError as exc:
        if not (retryable(rec) and is_no_space(exc)):
            raise
        log.error(
            "update %s: the record of its end cannot be written either (%s); it is reported",
            manifest_of(rec).update_id,
            exc,
        )


def serving_new(rec: opb.UpdateRecord, inst: Installed) -> bool:
    """Whether the pointer names the update's new model (switched at activation): in the
    trial, or ending it (the state set, its record refused)."""
    target = manifest_of(rec).target_model_sha256
    after = (R.ACTIVATING, R.TRIAL, R.COMMITTED, R.ROLLED_BACK)
    return rec.state in after and inst.current.sha256 == target


def stalled(reports: Reports, rec: opb.UpdateRecord, exc: BaseException) -> None:
    """ENOSPC once the pointer names the new model (entering or during its trial, writing its
    end): ending the update needs writes the disk refuses, and ending it REJECTED would
    misreport a device that serves the new model. The update stops where the record and the
    pointer on disk say, the new model serving: the next start continues its trial (counted as
    a restart), as after a crash. Logged and reported as progress."""
    why = (
        f"no space left on the device while the new model serves ({exc}): the update stops "
        "here; the next start continues its trial"
    )
    log.error("update %s: %s", manifest_of(rec).update_id, why)
    reports.progress(rec, why)


def message(exc: BaseException, store: Store) -> str:
    """The reason of a `no_space` end (after `release`)."""
    free = free_bytes(store.models.parent)
    return (
        f"no space left on the device: {exc}; what the update wrote is removed "
        f"({free if free is not None else '?'} bytes free now); offer it again once there is room"
    )


def boot_on_a_full_disk(store: Store, shipped: ModelRef, exc: BaseException) -> ModelRef:
    """A start whose boot could not write (ENOSPC): the model to serve, chosen without writing
    anything. An update that had not ended (activating, in its trial, or a rollback whose
    pointer did not move yet) is left as it is on disk and its new model is not loaded — this
    start could not count a trial restart, and that count is what stops a crash loop — so the
    last known good model serves (the shipped one if none verifies); the next start with room
    carries the update on. AgentError when no model verifies."""
    rec, inst = store.record(), store.installed() or Installed(shipped)
    unended = rec is not None and rec.state not in (R.COMMITTED, R.REJECTED, R.STATE_UNSPECIFIED)
    target = manifest_of(rec).target_model_sha256 if rec is not None and unended else ""
    choices = [inst.current, inst.last_good, shipped]
    for ref in choices:
        if ref is not None and ref.sha256 != target and ref.verify() is None:
            log.warning(
                "the disk is full (%s): serving %s %s without writing; the update waits for "
                "a start with room",
                exc,
                ref.version,
                ref.sha256[:12],
            )
            return ref
    raise AgentError(f"the disk is full ({exc}) and no model other than the update's verifies")


def held(reports: Reports, rec: opb.UpdateRecord | None, why: str) -> None:
    """`resume` after `boot_on_a_full_disk`: an update that had not ended waits (progress)."""
    if rec is not None and rec.state not in (*ENDED, R.STATE_UNSPECIFIED):
        text = f"{why}: the last good model serves; the update goes on at a start with room"
        log.warning("update %s: %s", manifest_of(rec).update_id, text)
        reports.progress(rec, text)
