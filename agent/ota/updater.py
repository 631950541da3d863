"""The update state machine: received → downloading → verified → staged → activating → trial →
committed | rolled_back | rejected (docs/UPDATES.md). The record is written before each side
effect, so a crash or power cut continues from it; the current model serves throughout.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from agent.base.clock import Clock, Stopwatch
from agent.base.errors import AgentError
from agent.config.file import UpdatesConfig
from agent.ota import orders, space
from agent.ota.artifact import keys, manifest, signing
from agent.ota.cleanup import Cleanup
from agent.ota.delta import files as delta
from agent.ota.download import download
from agent.ota.faults import UNREPORTED, crash_point, pause_point
from agent.ota.fetch import BlockSource, PayloadTooLarge
from agent.ota.host import UpdateHost
from agent.ota.interrupt import Interrupt
from agent.ota.reports import Reports, manifest_of
from agent.ota.staging import stage
from agent.ota.store import Installed, ModelRef, Store
from agent.ota.switch.gate import Switch
from agent.ota.timing import Timing
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

R = opb.UpdateRecord
Phase = fpb.UpdateStatus
FINAL = (R.COMMITTED, R.ROLLED_BACK, R.REJECTED)
CANCELLABLE = orders.CANCELLABLE
UNJUDGED = "; its validity window is judged once the clock is synchronized"
TRIAL_SAVE_S = 10.0  # the trial's elapsed time is written at least this often (and at every save)


class Updater:
    """The update state machine. The record (`Store.save`, fsynced) is written *before* each side
    effect, and each transition reported after it with an idempotency key, so after a crash or
    a power cut `boot()` (before the first load: which model to load; a crashed activation or a
    crash-looping trial is rolled back) and `resume()` (once serving) continue from it, and
    `attach()` re-reports the record's state. It runs on the daemon's event loop (downloads and
    patching in a worker thread); the current model serves until the new one has loaded beside
    it and passed its canary. Beside it: download.py, staging.py, store.py, reports.py,
    cleanup.py, space.py (a full disk), timing.py, interrupt.py and host.py (the daemon's side).
    """

    def __init__(
        self,
        store: Store,
        config: UpdatesConfig,
        shipped: ModelRef,
        blocks: BlockSource | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        # durations by its monotonic clock; its wall clock only once synchronized
        # (agent/base/clock.py)
        self.clock = clock or Clock(config.clock, config.timesync_file)
        self.config = config
        self.shipped = shipped  # what serves when no update was ever installed
        self.blocks = blocks
        self.host: UpdateHost | None = None
        self._task: asyncio.Task[None] | None = None
        self.interrupt = Interrupt()  # a cancel's reason; stops a download, cuts its pauses
        self.reports = Reports(self.installed)
        self.cleanup = Cleanup(self.store, self.installed)
        self.timing = Timing(self.clock, self.reports, self.interrupt)
        # when a committed download may switch, and the download's link (switch/)
        self.switch = Switch(config, self.clock, self.interrupt, self.reports, store)
        # why boot could not write (a full disk) and what serves instead: no update moves
        self.held: tuple[str, ModelRef] | None = None
        self.decisions = orders.Decisions()  # installers' commits (commit=external)
        self._resumed = asyncio.Event()  # offers wait for `resume` (the record's task first)

    # ------------------------------------------------------------------ state

    def installed(self) -> Installed:
        return self.store.installed() or Installed(self.shipped)

    def serving_ref(self) -> ModelRef:
        return self.held[1] if self.held else self.installed().current

    def last_status(self) -> fpb.UpdateStatus | None:
        rec = self.store.record()
        return self.reports.status(rec) if rec is not None else None

    # ------------------------------------------------------------------ boot

    def boot(self) -> ModelRef:
        """Before the first load: finish what a crash left, and say which model to load
        (`space.boot_on_a_full_disk` when that cannot be written)."""
        try:
            return self._boot()
        except OSError as exc:
            if not space.is_no_space(exc):
                raise
            ref = space.boot_on_a_full_disk(self.store, self.shipped, exc)
            self.held = (f"{exc.strerror or exc} at the start", ref)
            return ref

    def _boot(self) -> ModelRef:
        rec = self.store.record()
        inst = self.installed()
        if rec is not None and rec.state not in (*FINAL, R.STATE_UNSPECIFIED):
            # the state a crash interrupted may be unreported; `attach` sends it (once)
            self.reports.transition(rec, rec.reason, rec.reason_code)
        if rec is not None and rec.state == R.ACTIVATING:
            target = manifest_of(rec).target_model_sha256
            if inst.current.sha256 == target:  # the switch happened: this start is a trial start
                rec.state = R.TRIAL
                rec.trial_started_unix = rec.trial_started_unix or self.clock.wall()
                rec.reason = "serving the new model; trial running (the agent restarted)"
            else:
                self._finish(rec, R.ROLLED_BACK, "the agent restarted while activating")
        if rec is not None and rec.state == R.ROLLED_BACK:
            target = manifest_of(rec).target_model_sha256
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
        return self.store.usable(
            inst, self.shipped, lambda why: self.reports.text(Phase.ROLLED_BACK, why)
        )

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
        self.cleanup.remove_built(rec)
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
        self._resumed.set()  # (set first: what follows starts the record's task synchronously)
        rec = self.store.record()
        if self.held:  # a start on a full disk: nothing moves until a start with room
            space.held(self.reports, rec, self.held[0])
        elif rec is not None and rec.state in FINAL:
            space.complete(self.cleanup, rec)
            assert self.host is not None
            self.host.remove_unused_caches()
        elif rec is not None and rec.state != R.STATE_UNSPECIFIED:
            name = R.State.Name(rec.state)
            log.info("update %s: resuming in state %s", manifest_of(rec).update_id, name)
            self._start(rec)

    async def offer(
        self, signed_bytes: bytes, args: Mapping[str, str] | None = None, local: Path | None = None
    ) -> fpb.UpdateStatus:
        """The fleet's update command, or an install from this machine with its payload at
        `local` (moved into the store once accepted): verify and check the manifest
        and the arguments (`activate`, `allow_metered`: switch/policy.py; `commit`:
        orders.py), record them, start."""
        await self._resumed.wait()
        try:
            signed = opb.SignedManifest.FromString(signed_bytes)
        except Exception as exc:
            return self.reports.rejected("", "malformed", f"malformed SignedManifest: {exc}")
        if self.held:  # the pointer and record are not what serves: restart with room first
            why = f"{self.held[0]}: offers wait for a start with room"
            return self.reports.rejected("", space.NO_SPACE, why)
        busy = self.store.record()
        if busy is not None and busy.state not in FINAL and self._task and not self._task.done():
            m = manifest_of(busy)
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
        now = self.timing.now()
        try:
            ctx = self.host.install_context(inst.current)
            manifest.check(m, ctx, now)
            space.check(m, self.store, self.config.min_free_bytes, ctx.cache_dir)
            activate, allow_metered = self.switch.check_offer(args or {})
            external = orders.commit_external(args or {})
        except manifest.UpdateRejected as exc:
            return self.reports.rejected(m.update_id, exc.code, exc.message, m)
        rec = R(
            signed=signed,
            state=R.RECEIVED,
            times_checked=now is not None,
            reason="manifest verified" + ("" if now is not None else UNJUDGED),
            previous_model_dir=inst.current.model_dir,
            from_version=inst.current.label or str(inst.current.version),
            attempt=space.attempt(busy, m),
            activate=activate,
            allow_metered=allow_metered,
            local_payload=local is not None,
            commit_external=external,
        )
        if local is not None:  # (the store's own directory: an atomic rename)
            os.replace(local, self.store.payload_path(m.update_id))
        self.store.save(rec)
        crash_point(UNREPORTED + "received")
        status = self.reports.transition(rec, rec.reason)
        crash_point("received")
        self._start(rec)
        return status

    async def cancel(self, signed_bytes: bytes) -> fpb.UpdateStatus:
        """The fleet's signed cancel (orders.cancel)."""
        return await orders.cancel(self, signed_bytes)

    async def decide(self, update_id: str, wanted: str) -> fpb.UpdateStatus:
        """An installer's commit or rollback (orders.decide)."""
        return await orders.decide(self, update_id, wanted)

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def stop(self) -> None:
        self.interrupt.stop.set()
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ the machine

    def _start(self, rec: opb.UpdateRecord) -> None:
        self.interrupt.reset()
        self._task = asyncio.get_running_loop().create_task(self._run(rec))

    async def _run(self, rec: opb.UpdateRecord) -> None:
        m = manifest_of(rec)
        try:
            while rec.state not in FINAL:
                if rec.state in CANCELLABLE:
                    self.interrupt.check()
                step = self._steps().get(rec.state)
                if step is None:
                    raise AgentError(f"unknown update state {rec.state}")
                await pause_point(R.State.Name(rec.state).lower())
                await step(rec, m)
        except Exception as exc:  # whatever went wrong (not a CancelledError), the model serves
            if space.is_no_space(exc) and space.serving_new(rec, self.installed()):
                space.stalled(self.reports, rec, exc)  # no end can be written (space.py)
            elif space.is_no_space(exc):  # a full disk: the update ends, retryable (space.py)
                space.release(self.cleanup, rec)
                self._finish(rec, R.REJECTED, space.message(exc, self.store), space.NO_SPACE)
            elif isinstance(exc, manifest.UpdateRejected):
                self._finish(rec, R.REJECTED, exc.message, exc.code)
            elif isinstance(exc, PayloadTooLarge | delta.DeltaError):
                self._finish(rec, R.REJECTED, str(exc), "payload")
            else:
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
        await self.switch.before_download(rec, m)
        await download(
            rec,
            m,
            store=self.store,
            config=self.config,
            reports=self.reports,
            blocks=self.blocks,
            interrupt=self.interrupt,
            check_times=lambda: self.timing.check(rec, m),
        )
        self._enter(rec, R.VERIFIED, "payload sha256 verified")

    async def _stage(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        target = await stage(self.store, rec, m)
        self._enter(rec, R.STAGED, f"staged in {target.name}")

    async def _activate(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        assert self.host is not None
        if rec.state == R.STAGED:  # the last decisions before the new model loads
            await self.switch.before_activation(rec, m)
            await self.timing.before_activation(rec, m)
            cache_dir = self.host.install_context(self.installed().current).cache_dir
            space.check_activation(m, cache_dir, self.config.min_free_bytes)
        new = ModelRef(
            rec.staged_model_dir, m.quantization, m.target_model_sha256, m.version, m.version_label
        )
        self._enter(rec, R.ACTIVATING, "loading beside the serving model")
        canary = m.canary if m.HasField("canary") else None
        try:
            await self.host.activate(new, canary)
        except Exception as exc:  # the serving model is untouched; no_space: retryable
            code = space.NO_SPACE if space.is_no_space(exc) else ""
            why = f"the new model failed to activate: {exc}" + (code and space.AGAIN)
            self._finish(rec, R.ROLLED_BACK, why, code)
            self.host.remove_unused_caches()  # what loading the failed model prepared
            return
        inst = self.installed()
        try:
            self.store.switch(Installed(new, inst.current, inst.finished))
        except Exception as exc:  # the pointer still names the old model (replaced atomically)
            await self._unswitched(rec, inst.current, exc)
            return
        crash_point("switched")  # the record still says activating: a restart continues the trial
        rec.trial_started_unix, rec.trial_elapsed_s = self.clock.wall(), 0.0
        self._enter(rec, R.TRIAL, f"serving {m.version_label or m.version}; trial running")

    async def _trial(self, rec: opb.UpdateRecord, m: opb.Manifest) -> None:
        assert self.host is not None
        crash_point("trial")  # also when a restart continues the trial: a crash loop
        canary = m.canary if m.HasField("canary") else None
        # served time by the monotonic clock, continued from the record after a restart (time
        # while the agent was down does not count): a wall clock step neither ends nor
        # stretches it
        watch, trial_s = Stopwatch(self.clock, rec.trial_elapsed_s), self.config.trial_s
        saved = rec.trial_elapsed_s
        if saved > 0:
            log.info("update %s: trial continues at %.1f of %.0f s", m.update_id, saved, trial_s)
        while rec.trial_elapsed_s < trial_s:
            await asyncio.sleep(min(1.0, trial_s - rec.trial_elapsed_s))
            problem = await self.host.check_serving(None)
            rec.trial_elapsed_s = min(watch.elapsed(), trial_s)
            if problem is not None:
                await self.rollback(rec, f"health check failed during the trial: {problem}")
                return
            if self.decisions.wanted(m.update_id) == orders.ROLLBACK:
                await self.rollback(rec, "rolled back by the installer during the trial")
                return
            if rec.trial_elapsed_s - saved >= TRIAL_SAVE_S:
                self.store.save(rec)
                saved = rec.trial_elapsed_s
        problem = await self.host.check_serving(canary)
        if problem is not None:
            await self.rollback(rec, f"canary failed at the end of the trial: {problem}")
            return
        if not await orders.at_trial_end(self, rec):
            return
        inst = self.installed()
        self.store.switch(Installed(inst.current, inst.current, (*inst.finished, m.update_id)))
        self._finish(rec, R.COMMITTED, f"{m.version_label or m.version} is the last known good")
        keep = [Path(inst.current.model_dir)]
        self.store.remove_unused(keep)
        self.host.remove_unused_caches()

    async def rollback(self, rec: opb.UpdateRecord, reason: str) -> None:
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

    async def _unswitched(self, rec: opb.UpdateRecord, old: ModelRef, exc: Exception) -> None:
        """The new model serves but the pointer cannot name it (ENOSPC): serve the model the
        pointer names again, remove the new one, then end ROLLED_BACK (`no_space`: retryable)."""
        assert self.host is not None
        try:
            await self.host.activate(old, None)
        except Exception:
            log.exception("reloading %s failed; restarting", old.model_dir)
            os._exit(1)  # the pointer names the old model: a restart serves it
        code = space.NO_SPACE if space.is_no_space(exc) else ""
        space.release(self.cleanup, rec)  # (room for the record)
        why = f"the pointer to the new model cannot be written: {exc}" + (code and space.AGAIN)
        self._finish(rec, R.ROLLED_BACK, why, code)
        self.host.remove_unused_caches()

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
        space.save_final(self.store, rec)
        self.decisions.forget(manifest_of(rec).update_id)
        crash_point(UNREPORTED + R.State.Name(state).lower())
        if state in (R.REJECTED, R.ROLLED_BACK):
            space.complete(self.cleanup, rec)
        if report:
            self.reports.transition(rec, message, code)
        (log.info if state == R.COMMITTED else log.warning)(
            "update %s: %s: %s", manifest_of(rec).update_id, R.State.Name(state), message
        )
