"""Orders for the update in progress from outside its machine (agent.ota.updater): the
fleet's signed cancel (`cancel`), and an installer's commit or rollback (`decide`).

An update installed with the argument ``commit=external`` (by the Mender Update Module, say;
docs/UPDATES.md, "Installing from this machine") does not commit when its trial passes: it
keeps serving the new model, still checked, and waits (`at_trial_end`) for the installer's
COMMIT (it ends COMMITTED) or ROLLBACK (the last known good model serves again: ROLLED_BACK).
The record says so (`commit_external`), so a restart while it waits runs the trial's end again
and waits again. A rollback that comes during the trial acts at the trial's next check; one
that comes before the new model loads cancels the update. Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, Protocol

from agent.base.errors import NotFound, UpdateConflict
from agent.config.file import UpdatesConfig
from agent.ota.artifact import keys
from agent.ota.artifact.cancel import check_cancellable, verify_cancel
from agent.ota.artifact.manifest import UpdateRejected
from agent.ota.fetch import HTTP_TIMEOUT_S
from agent.ota.host import UpdateHost
from agent.ota.interrupt import Interrupt
from agent.ota.reports import Reports, manifest_of
from agent.ota.store import Store
from agent.ota.timing import Timing
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb


class Updater(Protocol):
    """What the orders act on (agent.ota.updater.Updater)."""

    config: UpdatesConfig
    timing: Timing
    store: Store
    interrupt: Interrupt
    decisions: Decisions
    reports: Reports
    host: UpdateHost | None

    @property
    def task(self) -> asyncio.Task[None] | None: ...

    def last_status(self) -> fpb.UpdateStatus | None: ...

    async def rollback(self, rec: opb.UpdateRecord, reason: str) -> None: ...


log = logging.getLogger("agent.ota.updater")

R = opb.UpdateRecord
COMMIT_ARG: Final = "commit"
COMMIT_VALUES: Final = ("auto", "external")
COMMIT, ROLLBACK = "commit", "rollback"
CANCELLABLE: Final = (R.RECEIVED, R.DOWNLOADING, R.VERIFIED, R.STAGED)  # before the new model loads
WAITING: Final = "trial passed; waiting for the installer to commit or roll back"
CHECK_S: Final = 1.0  # while it waits, the new model's health is checked this often


def commit_external(args: Mapping[str, str]) -> bool:
    """The install's `commit` argument: True for "external"; UpdateRejected ("commit")."""
    value = args.get(COMMIT_ARG, "auto")
    if value not in COMMIT_VALUES:
        raise UpdateRejected("commit", f"commit={value!r}: allowed: {', '.join(COMMIT_VALUES)}")
    return value == "external"


class Decisions:
    """The installers' decisions, by update id, until the update acts on them."""

    def __init__(self) -> None:
        self._wanted: dict[str, str] = {}
        self._changed: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def ask(self, update_id: str, decision: str) -> None:
        self._wanted[update_id] = decision
        self._event().set()

    def wanted(self, update_id: str) -> str | None:
        return self._wanted.get(update_id)

    async def changed(self, timeout: float) -> None:
        event = self._event()
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return
        event.clear()

    def forget(self, update_id: str) -> None:
        self._wanted.pop(update_id, None)


async def cancel(u: Updater, signed_bytes: bytes) -> fpb.UpdateStatus:
    """The fleet's cancel command: a signed cancel of the update in progress (before its new
    model loads). Returns the update's status once it has ended (rejected, code `cancelled`);
    raises UpdateRejected when the cancel is refused."""
    try:
        trusted = keys.load_trusted(u.config.trusted_keys_dir)
    except keys.KeyFileError as exc:
        raise UpdateRejected("trusted_keys", str(exc)) from exc
    order, kid = verify_cancel(signed_bytes, trusted, u.timing.now())
    rec = u.store.record()
    task = u.task
    running = rec is not None and task is not None and not task.done()
    check_cancellable(order, rec if running else None, rec, CANCELLABLE)
    assert rec is not None and task is not None
    m = manifest_of(rec)
    reason = f"cancelled by the operator (key {kid})" + (
        f": {order.reason}" if order.reason else ""
    )
    log.warning("update %s: %s", m.update_id, reason)
    u.interrupt.cancel(reason)  # a download stops at its next read
    await asyncio.wait({task}, timeout=HTTP_TIMEOUT_S + 10)
    status = u.last_status()
    assert status is not None
    return status


async def at_trial_end(u: Updater, rec: opb.UpdateRecord) -> bool:
    """A passed trial: True to commit now (as always without commit=external); False when it
    was rolled back instead."""
    if not rec.commit_external:
        return True
    assert u.host is not None
    host = u.host
    return await await_decision(
        rec,
        u.decisions,
        u.store,
        lambda why: u.reports.progress(rec, why),
        lambda: host.check_serving(None),
        lambda why: u.rollback(rec, why),
    )


async def decide(u: Updater, update_id: str, wanted: str) -> fpb.UpdateStatus:
    """An installer's commit or rollback of an update installed with commit=external."""
    rec = u.store.record()

    async def cancel_early() -> None:  # before the new model loads: the update just ends
        if rec is not None and rec.state in CANCELLABLE:
            u.interrupt.cancel("rolled back by the installer")

    return await _decide(rec, update_id, wanted, u.decisions, u.last_status, cancel_early)


async def await_decision(
    rec: opb.UpdateRecord,
    decisions: Decisions,
    store: Store,
    announce: Callable[[str], None],
    check_serving: Callable[[], Awaitable[str | None]],
    rollback: Callable[[str], Awaitable[None]],
) -> bool:
    """At the end of a passed trial of a `commit_external` update: wait for the installer.
    True: commit now; False: it was rolled back (by the installer, or its health failed)."""
    update_id = manifest_of(rec).update_id
    if rec.reason != WAITING:
        rec.reason = WAITING
        store.save(rec)
        announce(WAITING)
    while True:
        wanted = decisions.wanted(update_id)
        if wanted == COMMIT:
            return True
        if wanted == ROLLBACK:
            await rollback("rolled back by the installer")
            return False
        problem = await check_serving()
        if problem is not None:
            await rollback(f"health check failed while waiting for the commit: {problem}")
            return False
        await decisions.changed(CHECK_S)


async def _decide(
    record: opb.UpdateRecord | None,
    update_id: str,
    decision: str,
    decisions: Decisions,
    status: Callable[[], fpb.UpdateStatus | None],
    rollback_now: Callable[[], Awaitable[None]] | None,
) -> fpb.UpdateStatus:
    """Hand the installer's decision to the update, and its final status once it has acted.
    `rollback_now`: rolls back an update still before its trial's end (None: none running).
    NotFound for an update that is not the latest; UpdateConflict for a decision its state
    does not allow (a commit of one that rolled back, a rollback of a committed one)."""
    m = manifest_of(record) if record is not None else None
    if record is None or m is None or (update_id and m.update_id != update_id):
        latest = f"; the latest is {m.update_id}" if m is not None else "; none was installed"
        raise NotFound(f"update {update_id!r} is not this device's latest update{latest}")
    done = {R.COMMITTED: COMMIT, R.ROLLED_BACK: ROLLBACK, R.REJECTED: ROLLBACK}
    if record.state in done:
        if done[record.state] != decision:
            state = R.State.Name(record.state)
            raise UpdateConflict(f"update {m.update_id} has ended {state}: it cannot {decision}")
        final = status()
        assert final is not None
        return final
    if not record.commit_external:
        raise UpdateConflict(
            f"update {m.update_id} was not installed with commit=external: its trial decides"
        )
    decisions.ask(m.update_id, decision)
    if decision == ROLLBACK and rollback_now is not None and record.state != R.TRIAL:
        await rollback_now()
    return await _final(m.update_id, status)


async def _final(update_id: str, status: Callable[[], fpb.UpdateStatus | None]) -> fpb.UpdateStatus:
    """The update's status once it has ended (polled: the machine writes the record)."""
    ends = (fpb.UpdateStatus.COMMITTED, fpb.UpdateStatus.ROLLED_BACK, fpb.UpdateStatus.REJECTED)
    while True:
        st = status()
        if st is not None and st.update_id == update_id and st.phase in ends:
            return st
        await asyncio.sleep(0.05)
