"""The update state machine: received → downloading → verified → staged → activating → trial →
committed | rolled_back | rejected (docs/UPDATES.md).

The record (`Store.save`, fsynced) is written *before* each side effect, so after a crash or a
power cut `boot()` and `resume()` continue from it:

* `boot()` runs before the first model load and decides which model to load: the pointer's
  current model if its file still has the recorded sha256 (else the last known good one); an
  update that crashed while activating, or crash-loops in its trial, is rolled back here.
* `resume()` runs once the daemon serves and continues an interrupted download, stage,
  activation or trial.

Everything here runs on the daemon's event loop; downloads and patching run in a worker
thread. The current model serves throughout; nothing changes until the new model has loaded
beside it and passed its canary.
"""

from __future__ import annotations

import asyncio
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
from agent.ota import delta, keys, manifest
from agent.ota.fetch import (
    BlockSource,
    DownloadFailed,
    PayloadTooLarge,
    RateLimit,
    fetch_blocks,
    fetch_http,
)
from agent.ota.store import Installed, ModelRef, Store
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

R = opb.UpdateRecord
Phase = fpb.UpdateStatus
FINAL = (R.COMMITTED, R.ROLLED_BACK, R.REJECTED)
CRASH_ENV = "EDGE_AGENT_OTA_CRASH_AT"  # tests: SIGKILL ourselves on entering this state


class UpdateHost(Protocol):
    """What the updater needs from the daemon."""

    def install_context(self, installed: ModelRef) -> manifest.InstallContext: ...

    async def activate(self, ref: ModelRef, canary: opb.Canary | None) -> None:
        """Load `ref` beside the serving model, check it, switch to it; raise if it fails
        (the serving model keeps serving)."""

    async def check_serving(self, canary: opb.Canary | None) -> str | None:
        """None if the serving model is healthy, else why not (the trial's checks)."""

    def report(self, status: fpb.UpdateStatus) -> None: ...

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
        self._pending: list[fpb.UpdateStatus] = []

    # ------------------------------------------------------------------ state

    def installed(self) -> Installed:
        return self.store.installed() or Installed(self.shipped)

    def serving_ref(self) -> ModelRef:
        return self.installed().current

    def last_status(self) -> fpb.UpdateStatus | None:
        rec = self.store.record()
        return self._status(rec) if rec is not None else None

    # ------------------------------------------------------------------ boot

    def boot(self) -> ModelRef:
        """Before the first load: finish what a crash left, and say which model to load."""
        rec = self.store.record()
        inst = self.installed()
        if rec is not None and rec.state == R.ACTIVATING:
            target = self._manifest(rec).target_model_sha256
            if inst.current.sha256 == target:  # the switch happened: this start is a trial start
                rec.state, rec.trial_started_unix = R.TRIAL, rec.trial_started_unix or time.time()
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
            self._report_text(fpb.UpdateStatus.ROLLED_BACK, f"active model refused: {problem}")
            return good
        if inst.current != self.shipped and self.shipped.verify() is None:
            self.store.switch(Installed(self.shipped, None, inst.finished))
            self._report_text(fpb.UpdateStatus.ROLLED_BACK, f"active model refused: {problem}")
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
        if report:
            self._report(rec, reason)
        return rolled

    # ------------------------------------------------------------------ entry points

    def attach(self, host: UpdateHost) -> None:
        self.host = host
        pending, self._pending = self._pending, []
        for status in pending:
            host.report(status)

    async def resume(self) -> None:
        """Once serving: continue an interrupted update."""
        rec = self.store.record()
        if rec is not None and rec.state not in FINAL and rec.state != R.STATE_UNSPECIFIED:
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
            return self._reject_status("", "malformed", f"malformed SignedManifest: {exc}")
        busy = self.store.record()
        if busy is not None and busy.state not in FINAL and self._task is not None:
            m = self._manifest(busy)
            return self._reject_status(
                "", "busy", f"update {m.update_id} is in progress ({R.State.Name(busy.state)})"
            )
        try:
            trusted = keys.load_trusted(self.config.trusted_keys_dir)
            m = manifest.verify(signed, trusted)
        except manifest.UpdateRejected as exc:
            return self._reject_status("", exc.code, exc.message)
        except AgentError as exc:
            return self._reject_status("", "bad_signature", str(exc))
        inst = self.installed()
        assert self.host is not None
        try:
            manifest.check(m, self.host.install_context(inst.current), time.time())
        except manifest.UpdateRejected as exc:
            return self._reject_status(m.update_id, exc.code, exc.message, m)
        rec = R(signed=signed, state=R.RECEIVED, previous_model_dir=inst.current.model_dir)
        self.store.save(rec)
        status = self._report(rec, "manifest verified")
        crash_point("received")
        self._start(rec)
        return status

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ the machine

    def _start(self, rec: opb.UpdateRecord) -> None:
        self._stop.clear()
        self._task = asyncio.get_running_loop().create_task(self._run(rec))

    async def _run(self, rec: opb.UpdateRecord) -> None:
        m = self._manifest(rec)
        try:
            while rec.state not in FINAL:
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
                self._report(rec, f"{have} of {m.payload_size} bytes")

        while True:
            if time.time() >= m.expires_unix:
                raise manifest.UpdateRejected("expired", "the manifest expired during download")
            try:
                await asyncio.to_thread(self._fetch, m, part, progress)
                break
            except DownloadFailed as exc:
                log.warning("update %s: download: %s; retrying", m.update_id, exc)
                await asyncio.sleep(self.config.retry_s)
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
            _crash_when_written(staging)
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
            return
        inst = self.installed()
        self.store.switch(Installed(new, inst.current, inst.finished))
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
        self._report(rec, reason)

    # ------------------------------------------------------------------ records and reports

    def _enter(self, rec: opb.UpdateRecord, state: int, message: str) -> None:
        rec.state = state  # type: ignore[assignment]
        rec.reason = message
        self.store.save(rec)
        self._report(rec, message)
        crash_point(R.State.Name(state).lower())

    def _finish(
        self, rec: opb.UpdateRecord, state: int, message: str, code: str = "", report: bool = True
    ) -> None:
        rec.state = state  # type: ignore[assignment]
        rec.reason = message
        self.store.save(rec)
        if state in (R.REJECTED, R.ROLLED_BACK):
            m = self._manifest(rec)
            inst = self.installed()
            if m.update_id not in inst.finished:
                self.store.switch(dataclasses.replace(inst, finished=(*inst.finished, m.update_id)))
            self.store.payload_path(m.update_id).unlink(missing_ok=True)
            serving = {Path(inst.current.model_dir), Path(rec.previous_model_dir)}
            if (
                rec.staged_model_dir
                and state == R.REJECTED
                and Path(rec.staged_model_dir) not in serving
            ):
                shutil.rmtree(rec.staged_model_dir, ignore_errors=True)
        if report:
            self._report(rec, message, code)
        (log.info if state == R.COMMITTED else log.warning)(
            "update %s: %s: %s", self._manifest(rec).update_id, R.State.Name(state), message
        )

    def _status(self, rec: opb.UpdateRecord, message: str = "", code: str = "") -> fpb.UpdateStatus:
        m = self._manifest(rec)
        return fpb.UpdateStatus(
            update_id=m.update_id,
            phase=fpb.UpdateStatus.Phase.Value(R.State.Name(rec.state)),
            message=message or rec.reason,
            reason_code=code,
            from_version=str(self.installed().current.label or self.installed().current.version),
            to_version=m.version_label or str(m.version),
            timestamp_unix=time.time(),
            downloaded_bytes=rec.downloaded,
            total_bytes=m.payload_size,
        )

    def _report(self, rec: opb.UpdateRecord, message: str, code: str = "") -> fpb.UpdateStatus:
        status = self._status(rec, message, code)
        self._send(status)
        return status

    def _report_text(self, phase: fpb.UpdateStatus.Phase, message: str) -> None:
        self._send(fpb.UpdateStatus(phase=phase, message=message, timestamp_unix=time.time()))

    def _send(self, status: fpb.UpdateStatus) -> None:
        """To the host, or kept until `attach` (reports made by `boot`)."""
        if self.host is None:
            self._pending.append(status)
        else:
            self.host.report(status)

    def _reject_status(
        self, update_id: str, code: str, message: str, m: opb.Manifest | None = None
    ) -> fpb.UpdateStatus:
        status = fpb.UpdateStatus(
            update_id=update_id,
            phase=fpb.UpdateStatus.REJECTED,
            message=message,
            reason_code=code,
            to_version=(m.version_label or str(m.version)) if m is not None else "",
            timestamp_unix=time.time(),
        )
        log.warning("update %s rejected (%s): %s", update_id or "?", code, message)
        self._send(status)
        return status

    @staticmethod
    def _manifest(rec: opb.UpdateRecord) -> opb.Manifest:
        m: opb.Manifest = opb.Manifest.FromString(rec.signed.manifest)
        return m


def crash_point(name: str) -> None:
    """Fault injection for the crash tests: SIGKILL ourselves when entering state `name`."""
    if os.environ.get(CRASH_ENV) == name and os.environ.get("EDGE_AGENT_FAULT_INJECTION") == "1":
        log.warning("fault injection: SIGKILL at %s", name)
        os.kill(os.getpid(), 9)


def _crash_when_written(staging: Path) -> None:
    """Fault injection: SIGKILL once the patcher has written bytes into the staging dir."""

    def watch() -> None:
        while True:
            files = list(staging.glob("*")) if staging.is_dir() else []
            if any(f.stat().st_size > 0 for f in files if f.is_file()):
                crash_point("mid-staging")
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


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
