"""An update's status reports (`UpdateStatus`), as the fleet's status topic carries them.

A transition's report carries an idempotency key (`transition_key`): the updater sends it right
after the record moves and again at every start (re-derived from the record), and the outbox
records each key once, so a crash between the record and its report loses nothing and
duplicates nothing. Download progress and refusals at the offer carry no key. Reports made
before the daemon can send them (`Updater.boot`) wait here until `attach`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.ota.store import Installed
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

R = opb.UpdateRecord
Send = Callable[[fpb.UpdateStatus, str], None]


def manifest_of(rec: opb.UpdateRecord) -> opb.Manifest:
    """The manifest a record holds (verified when it was received)."""
    m: opb.Manifest = opb.Manifest.FromString(rec.signed.manifest)
    return m


def transition_key(update_id: str, state: int, attempt: int = 0) -> str:
    """``update/<id>/<STATE>``; ``update/<id>/<attempt>/<STATE>`` for an offer of the same id
    after it ended `no_space` (agent/ota/space.py), whose transitions are new events."""
    again = f"{attempt}/" if attempt else ""
    return f"update/{update_id}/{again}{R.State.Name(state)}"


class Reports:
    """Builds the reports of an update and hands them to `send` (kept until `attach`)."""

    def __init__(self, installed: Callable[[], Installed]) -> None:
        self._installed = installed  # for the version of a record that does not carry one
        self._send: Send | None = None
        self._pending: list[tuple[fpb.UpdateStatus, str]] = []

    def attach(self, send: Send) -> None:
        """From now on reports go to `send`; the ones kept so far go first, in order."""
        self._send = send
        pending, self._pending = self._pending, []
        for status, key in pending:
            send(status, key)

    def status(self, rec: opb.UpdateRecord, message: str = "", code: str = "") -> fpb.UpdateStatus:
        """The record as a report (its reason and code unless others are given)."""
        m = manifest_of(rec)
        current = self._installed().current
        return fpb.UpdateStatus(
            update_id=m.update_id,
            phase=fpb.UpdateStatus.Phase.Value(R.State.Name(rec.state)),
            message=message or rec.reason,
            reason_code=code or rec.reason_code,
            from_version=rec.from_version or str(current.label or current.version),
            to_version=m.version_label or str(m.version),
            timestamp_unix=time.time(),
            downloaded_bytes=rec.downloaded,
            total_bytes=m.payload_size,
        )

    def transition(
        self, rec: opb.UpdateRecord, message: str = "", code: str = ""
    ) -> fpb.UpdateStatus:
        """Report the record's state, keyed: recorded once however often it is sent."""
        status = self.status(rec, message, code)
        self._emit(status, transition_key(status.update_id, rec.state, rec.attempt))
        return status

    def progress(self, rec: opb.UpdateRecord, message: str) -> None:
        """A download progress report (no key: each one is new)."""
        self._emit(self.status(rec, message), "")

    def text(self, phase: fpb.UpdateStatus.Phase, message: str) -> None:
        """A report outside any update (a refused active model at start)."""
        self._emit(fpb.UpdateStatus(phase=phase, message=message, timestamp_unix=time.time()), "")

    def rejected(
        self, update_id: str, code: str, message: str, m: opb.Manifest | None = None
    ) -> fpb.UpdateStatus:
        """A refusal before any record (a check, `busy`, the device's keys)."""
        status = fpb.UpdateStatus(
            update_id=update_id,
            phase=fpb.UpdateStatus.REJECTED,
            message=message,
            reason_code=code,
            to_version=(m.version_label or str(m.version)) if m is not None else "",
            timestamp_unix=time.time(),
        )
        log.warning("update %s rejected (%s): %s", update_id or "?", code, message)
        self._emit(status, "")
        return status

    def _emit(self, status: fpb.UpdateStatus, key: str) -> None:
        if self._send is None:
            self._pending.append((status, key))
        else:
            self._send(status, key)
