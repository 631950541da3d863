"""The update state machine: received → downloading → verified → staged → activating → trial →
committed | rolled_back | rejected (docs/UPDATES.md).

The record (`Store.save`, fsynced) is written *before* each side effect, so after a crash or a
power cut `boot()` and `resume()` continue from it:

* `boot()` runs before the first model load and decides which model to load: the pointer's
  current model if its file still has the recorded sha256 (else the last known good one); an
  update that crashed while activating, or crash-loops in its trial, is rolled back here.
* `resume()` runs once the daemon serves and continues an interrupted download, stage,
  activation or trial.

Reports: each transition is reported right after its record is saved, with an idempotency key
(update id and state); `attach()` re-reports the record's state at every start, so a crash
between the record and its report loses nothing, and the outbox records each key once.

Everything here runs on the daemon's event loop; downloads and patching run in a worker
thread. The current model serves throughout; nothing changes until the new model has loaded
beside it and passed its canary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from agent.config import UpdatesConfig
from agent.errors import AgentError
from agent.modeldir import sha256_file
from agent.ota import delta, keys, manifest, signing
from agent.ota.cancel import check_cancellable, verify_cancel
from agent.ota.faults import CRASH_ENV, UNREPORTED, crash_point, crash_when_written
from agent.ota.fetch import (
    HTTP_TIMEOUT_S,
    BlockSource,
    DownloadFailed,
    PayloadTooLarge,
    RateLimit,
    fetch_blocks,
    fetch_http,
)
from agent.ota.reports import Reports, manifest_of
from agent.ota.store import Installed, ModelRef, Store
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

R = opb.UpdateRecord
Phase = fpb.UpdateStatus
FINAL = (R.COMMITTED, R.ROLLED_BACK, R.REJECTED)
CANCELLABLE = (R.RECEIVED, R.DOWNLOADING, R.VERIFIED, R.STAGED)  # before the new model loads


class UpdateHost(Protocol):
    """What the updater needs from the daemon."""

    def install_context(self, installed: ModelRef) -> manifest.InstallContext: ...

    async def activate(self, ref: ModelRef, canary: opb.Canary | None) -> None:
        """Load `ref` beside the serving model, check it, switch to it; raise if it fails
        (the serving model keeps serving)."""

    async def check_serving(self, canary: opb.Canary | None) -> str | None:
        """None if the serving model is healthy, else why not (the trial's checks)."""

    def report(self, status: fpb.UpdateStatus, key: str = "") -> None:
        """Record a status report (durably, when there is a fleet link); a report with a `key`
        that was recorded before is not recorded again."""

    def remove_unused_caches(self) -> None:
        """Delete what loading models left that the serving model does not use (its prepared
        copies and packed weights): called once an update has ended."""


class Updater:
    def __init__(
        self,
        store: Store,
        config: UpdatesConfig,
        shipped: ModelRef,
        blocks: BlockSource | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.shipped = shipped  # what serves when no update was ever installed
        self.blocks = blocks
        self.host: UpdateHost | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None  # cuts the pause between download attempts
        self._cancel = ""  # why the update in progress was cancelled (set by `cancel`)
        self.reports = Reports(self.installed)

    # ------------------------------------------------------------------ state

    def installed(self) -> Installed:
        return self.store.installed() or Installed(self.shipped)

    def serving_ref(self) -> ModelRef:
        return self.installed().current

    def last_status(self) -> fpb.UpdateStatus | None:
        rec = self.store.record()
        return self.reports.status(rec) if rec is not None else None

    # ------------------------------------------------------------------ boot

    def boot(self) -> ModelRef:
        """Before the first load: finish what a crash left, and say which model to load."""
        rec = self.store.record()
        inst = self.installed()
        if rec is not None and rec.state not in (*FINAL, R.STATE_UNSPECIFIED):
            # the state a crash interrupted may be unreported; `attach` sends it (once)
            self.reports.transition(rec, rec.reason, rec.reason_code)
        if rec is not None and rec.state == R.ACTIVATING:
            target = self._manifest(rec).target_model_sha256
            if inst.current.sha256 == target:  # the switch happened: this start is a trial start
                rec.state, rec.trial_started_unix = R.TRIAL, rec.trial_started_unix or time.time()
                rec.reason = "serving the new model; trial running (the agent restarted)"
            else:
                self._finish(rec, R.ROLLED_BACK, "the agent restarted while activating")
        if rec is not None and rec.state == R.ROLLED_BACK:
            target = self._manifest(rec).target_model_sha256
            if inst.current.sha256 == target:  # a crash between the record and the switch
                inst = self._rollback_pointer(rec, rec.reason, report=False)
        if rec is not None and rec.state == R.TRIAL:
            rec.trial_restarts += 1
            self.store.save(rec)
            if rec.trial_restarts >= self.config.max_trial_restarts:
                reason = f"{rec.trial_restarts} restarts during the trial (crash loop)"
                inst = self._rollback_pointer(rec, reason)
        if self.store.installed() is None:  # never updated: the engine checks its sha256
            return self.shipped
        problem = inst.current.verify()
        if problem is None:
            return inst.current
        log.error("the active model is not what was installed: %s", problem)
        good = inst.last_good
        if good is not None and good.verify() is None:
            self.store.switch(Installed(good, None, inst.finished))
            self.reports.text(fpb.UpdateStatus.ROLLED_BACK, f"active model refused: {problem}")
            return good
        if inst.current != self.shipped and self.shipped.verify() is None:
            self.store.switch(Installed(self.shipped, None, inst.finished))
            self.reports.text(fpb.UpdateStatus.ROLLED_BACK, f"active model refused: {problem}")
            return self.shipped
        raise AgentError(f"no usable model: {problem}")

    def _rollback_pointer(
        self, rec: opb.UpdateRecord, reason: str, report: bool = True
    ) -> Installed:
        """Record the rollback, then point back at the last known good model. (In this order:
        `boot` completes a pointer switch that a crash interrupted.)"""
        self._finish(rec, R.ROLLED_BACK, reason, report=False)
        inst = self.installed()
        previous = inst.last_good if inst.last_good != inst.current else None
        rolled = Installed(previous or self.shipped, None, inst.finished)
        self.store.switch(rolled)
        self._remove_built(rec)
        if report:
            self.reports.transition(rec, reason)
        return rolled

    # ------------------------------------------------------------------ entry points

    def attach(self, host: UpdateHost) -> None:
        """Once the daemon can report: send what `boot` reported, re-report the record's state
        (recorded once: a crash may have come between the record and its report), and say if
        the trusted keys are unusable."""
        self.host = host
        self.reports.attach(host.report)
        rec = self.store.record()
        if rec is not None and rec.state != R.STATE_UNSPECIFIED:
            self.reports.transition(rec, rec.reason, rec.reason_code)
        try:
            if self.config.trusted_keys_dir.is_dir():  # (a missing one is logged at an offer)
                keys.load_trusted(self.config.trusted_keys_dir)
        except keys.KeyFileError as exc:
            self.reports.rejected("", "trusted_keys", f"{exc}; every update is refused until fixed")

    async def resume(self) -> None:
        """Once serving: continue an interrupted update, or finish the cleanup of an ended one
        (a crash may have come between its record and its cleanup)."""
        rec = self.store.record()
        if rec is not None and rec.state in FINAL:
            self._complete(rec)
            assert self.host is not None
            self.host.remove_unused_caches()
        elif rec is not None and rec.state != R.STATE_UNSPECIFIED:
            log.info(
                "update %s: resuming in state %s",
                self._manifest(rec).update_id,
                R.State.Name(rec.state),
            )
            self._start(rec)

    async def offer(self, signed_bytes: bytes) -> fpb.UpdateStatus:
        """The fleet's update command: verify and check the manifest, record it, start."""
        try:
            signed = opb.SignedManifest.FromString(signed_bytes)
        except Exception as exc:
            return self.reports.rejected("", "malformed", f"malformed SignedManifest: {exc}")
        busy = self.store.record()
        if busy is not None and busy.state not in FINAL and self._task is not None:
            m = self._manifest(busy)
            return self.reports.rejected(
                "", "busy", f"update {m.update_id} is in progress ({R.State.Name(busy.state)})"
            )
        try:
            trusted = keys.load_trusted(self.config.trusted_keys_dir)
        except keys.KeyFileError as exc:  # the device's configuration, not the update
            return self.reports.rejected("", "trusted_keys", str(exc))
        try:
            m = signing.verify(signed, trusted)
        except manifest.UpdateRejected as exc:
            return self.reports.rejected("", exc.code, exc.message)
        inst = self.installed()
        assert self.host is not None
        try:
            manifest.check(m, self.host.install_context(inst.current), time.time())
        except manifest.UpdateRejected as exc:
            return self.reports.rejected(m.update_id, exc.code, exc.message, m)
        rec = R(
            signed=signed,
            state=R.RECEIVED,
            reason="manifest verified",
            previous_model_dir=inst.current.model_dir,
            from_version=inst.current.label or str(inst.current.version),
        )
        self.store.save(rec)
        crash_point(UNREPORTED + "received")
        status = self.reports.transition(rec, rec.reason)
        crash_point("received")
        self._start(rec)
        return status

    async def cancel(self, signed_bytes: bytes) -> fpb.UpdateStatus:
        """The fleet's cancel command: a signed cancel of the update in progress (before its
        new model loads). Returns the update's status once it has ended (rejected, code
        `cancelled`); raises UpdateRejected when the cancel is refused."""
        try:
            trusted = keys.load_trusted(self.config.trusted_keys_dir)
        except keys.KeyFileError as exc:
            raise manifest.UpdateRejected("trusted_keys", str(exc)) from exc
        cancel, kid = verify_cancel(signed_bytes, trusted, time.time())
        rec = self.store.record()
        task = self._task
        running = rec is not None and task is not None and not task.done()
        check_cancellable(cancel, rec if running else None, rec, CANCELLABLE)
        assert rec is not None and task is not None
        m = self._manifest(rec)
        self._cancel = f"cancelled by the operator (key {kid})" + (
            f": {cancel.reason}" if cancel.reason else ""
        )
        log.warning("update %s: %s", m.update_id, self._cancel)
        self._stop.set()  # a download stops at its next read
        if self._wake is not None:
            self._wake.set()
        await asyncio.wait({task}, timeout=HTTP_TIMEOUT_S + 10)
        status = self.last_status()
        assert status is not None
        return status

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ the machine

    def _start(self, rec: opb.UpdateRecord) -> None:
        self._stop.clear()
        self._cancel = ""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(rec))

    async def _run(self, rec: opb.UpdateRecord) -> None:
        m = self._manifest(rec)
        try:
            while rec.state not in FINAL:
                if rec.state in CANCELLABLE:
                    self._check_cancel()
                step = self._steps().get(rec.state)
                if step is None:
                    raise AgentError(f"unknown update state {rec.state}")
                await step(rec, m)
        except asyncio.CancelledError:
            raise
        except manifest.UpdateRejected as exc:
            self._finish(rec, R.REJECTED, exc.message, exc.code)
        except (PayloadTooLarge, delta.DeltaError) as exc:
            self._finish(rec, R.REJECTED, str(exc), "payload")
        except Exception as exc:  # whatever went wrong, the serving model keeps serving
            log.exception("update %s failed", m.update_id)
            self._finish(rec, R.REJECTED, f"{type(exc).__name__}: {exc}", "failed")

    def _steps(
        self,
    ) -> dict[int, Callable[[opb.UpdateRecord, opb.Manifest], Awaitable[None]]]:
        return {
            R.RECEIVED: self._received,
            R.DOWNLOADING: self._download,
            R.VERIFIED: self._stage,
            R.STAGED: self._activate,
            R.ACTIVATING: self._activate,
            R.TRIAL: self._trial,
        }

    async def _received(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        self._enter(rec, R.DOWNLOADING, "downloading")

    async def _download(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        part = self.store.payload_path(m.update_id)
        limit = RateLimit(self.config.progress_interval_s)

        def progress(have: int) -> None:
            rec.downloaded = have
            if have < m.payload_size:
                crash_point("mid-download")
            if limit.ready(force=have == m.payload_size):
                self.store.save(rec)
                self.reports.progress(rec, f"{have} of {m.payload_size} bytes")

        while True:
            if time.time() >= m.expires_unix:
                raise manifest.UpdateRejected("expired", "the manifest expired during download")
            before = _size(part)
            try:
                await asyncio.to_thread(self._fetch, m, part, progress)
                break
            except DownloadFailed as exc:
                self._check_cancel()
                # an attempt that added bytes starts a new count: only a source that ends short
                # (or fails) every time without progress is given up on
                rec.failed_attempts = 1 if _size(part) > before else rec.failed_attempts + 1
                self.store.save(rec)  # the count survives a restart
                limit_n = self.config.max_download_attempts
                if rec.failed_attempts >= limit_n:
                    raise manifest.UpdateRejected(
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
                    self.config.retry_s,
                )
                await self._pause(self.config.retry_s)
        self._check_cancel()  # a cancel stops the fetch early: the file is not whole
        digest = await asyncio.to_thread(sha256_file, part)
        if digest != m.payload_sha256:
            part.unlink(missing_ok=True)
            raise manifest.UpdateRejected(
                "payload_hash",
                f"payload sha256 {digest[:12]}… != manifest {m.payload_sha256[:12]}…",
            )
        self._enter(rec, R.VERIFIED, "payload sha256 verified")

    def _fetch(self, m: opb.Manifest, part: Path, progress: Callable[[int], None]) -> None:
        if m.payload_url:
            fetch_http(m.payload_url, part, m.payload_size, progress, self._stop)
        elif self.blocks is not None:
            fetch_blocks(self.blocks, m.update_id, part, m.payload_size, progress, self._stop)
        else:
            raise manifest.UpdateRejected("no_transport", "no payload URL and no fleet link")

    async def _stage(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        target = self.store.model_dir_for(m.version, m.target_model_sha256)
        staging = target.with_name(target.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)  # a crash mid-staging leaves a partial one
        base = Path(rec.previous_model_dir)
        part = self.store.payload_path(m.update_id)
        rec.staged_model_dir = str(target)
        self.store.save(rec)
        if os.environ.get(CRASH_ENV) == "mid-staging":
            crash_when_written(staging)
        files = await asyncio.to_thread(delta.patch_dirs, base, part, staging)
        want = {f.name: (f.sha256, f.size) for f in m.files}
        got = {name: (sha, size) for name, sha, size in files}
        if got != want:
            shutil.rmtree(staging, ignore_errors=True)
            raise manifest.UpdateRejected("target_hash", f"rebuilt files {got} != manifest {want}")
        _fsync_tree(staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        _fsync_dir(target.parent)
        part.unlink(missing_ok=True)
        self._enter(rec, R.STAGED, f"staged in {target.name}")

    async def _activate(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        assert self.host is not None
        new = ModelRef(
            rec.staged_model_dir, m.quantization, m.target_model_sha256, m.version, m.version_label
        )
        self._enter(rec, R.ACTIVATING, "loading beside the serving model")
        canary = m.canary if m.HasField("canary") else None
        try:
            await self.host.activate(new, canary)
        except Exception as exc:  # the serving model is untouched
            self._finish(rec, R.ROLLED_BACK, f"the new model failed to activate: {exc}")
            self.host.remove_unused_caches()  # what loading the failed model prepared
            return
        inst = self.installed()
        self.store.switch(Installed(new, inst.current, inst.finished))
        crash_point("switched")  # the record still says activating: a restart continues the trial
        rec.trial_started_unix = time.time()
        self._enter(rec, R.TRIAL, f"serving {m.version_label or m.version}; trial running")

    async def _trial(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        assert self.host is not None
        crash_point("trial")  # also when a restart continues the trial: a crash loop
        canary = m.canary if m.HasField("canary") else None
        end = rec.trial_started_unix + self.config.trial_s
        while time.time() < end:
            await asyncio.sleep(min(1.0, max(0.0, end - time.time())))
            problem = await self.host.check_serving(None)
            if problem is not None:
                await self._rollback(rec, f"health check failed during the trial: {problem}")
                return
        problem = await self.host.check_serving(canary)
        if problem is not None:
            await self._rollback(rec, f"canary failed at the end of the trial: {problem}")
            return
        inst = self.installed()
        self.store.switch(Installed(inst.current, inst.current, (*inst.finished, m.update_id)))
        self._finish(rec, R.COMMITTED, f"{m.version_label or m.version} is the last known good")
        keep = [Path(inst.current.model_dir)]
        self.store.remove_unused(keep)
        self.host.remove_unused_caches()

    async def _rollback(self, rec: opb.UpdateRecord, reason: str) -> None:
        """Serve the last known good model again; reported once it serves."""
        assert self.host is not None
        inst = self._rollback_pointer(rec, reason, report=False)
        try:
            await self.host.activate(inst.current, None)
        except Exception:
            log.exception("rollback: reloading %s failed; restarting", inst.current.model_dir)
            os._exit(1)  # the pointer names the old model: a restart serves it
        self.store.remove_unused([Path(inst.current.model_dir)])
        self.host.remove_unused_caches()
        self.reports.transition(rec, reason)

    def _check_cancel(self) -> None:
        if self._cancel:
            raise manifest.UpdateRejected("cancelled", self._cancel)

    async def _pause(self, seconds: float) -> None:
        """Sleep between download attempts; a cancel ends it at once."""
        assert self._wake is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._check_cancel()

    # ------------------------------------------------------------------ records and reports

    def _enter(self, rec: opb.UpdateRecord, state: int, message: str) -> None:
        rec.state = state  # type: ignore[assignment]
        rec.reason = message
        self.store.save(rec)
        crash_point(UNREPORTED + R.State.Name(state).lower())
        self.reports.transition(rec, message)
        crash_point(R.State.Name(state).lower())

    def _finish(
        self, rec: opb.UpdateRecord, state: int, message: str, code: str = "", report: bool = True
    ) -> None:
        rec.state = state  # type: ignore[assignment]
        rec.reason = message
        rec.reason_code = code
        self.store.save(rec)
        crash_point(UNREPORTED + R.State.Name(state).lower())
        if state in (R.REJECTED, R.ROLLED_BACK):
            self._complete(rec)
        if report:
            self.reports.transition(rec, message, code)
        (log.info if state == R.COMMITTED else log.warning)(
            "update %s: %s: %s", self._manifest(rec).update_id, R.State.Name(state), message
        )

    def _complete(self, rec: opb.UpdateRecord) -> None:
        """What follows an ended record, idempotent (run again at the next start): the id is
        finished (replay protection), the payload and the model directories nothing names any
        more are removed."""
        m = self._manifest(rec)
        inst = self.installed()
        if rec.state in (R.REJECTED, R.ROLLED_BACK) and m.update_id not in inst.finished:
            self.store.switch(dataclasses.replace(inst, finished=(*inst.finished, m.update_id)))
        self.store.payload_path(m.update_id).unlink(missing_ok=True)
        if rec.state == R.COMMITTED:
            keep = [Path(inst.current.model_dir)]
            if inst.last_good is not None:
                keep.append(Path(inst.last_good.model_dir))
            self.store.remove_unused(keep)
        else:
            self._remove_built(rec)

    def _remove_built(self, rec: opb.UpdateRecord) -> None:
        """Delete the model directory this update built once nothing names it: not the serving
        model, the last known good or the one the update started from."""
        if rec.staged_model_dir:
            inst = self.installed()
            keep = [inst.current.model_dir, rec.previous_model_dir]
            keep += [inst.last_good.model_dir] if inst.last_good is not None else []
            self.store.remove_built(Path(rec.staged_model_dir), [Path(k) for k in keep if k])

    @staticmethod
    def _manifest(rec: opb.UpdateRecord) -> opb.Manifest:
        return manifest_of(rec)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


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
