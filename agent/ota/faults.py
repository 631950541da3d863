"""Fault injection for the update crash tests: SIGKILL the agent at a named point, or hold an
update at a state until a file exists. Off unless ``EDGE_AGENT_FAULT_INJECTION=1``; the
variables: `crash_point`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CRASH_ENV = "EDGE_AGENT_OTA_CRASH_AT"
UNREPORTED = "unreported-"  # + a state: between saving the record and writing its report
PAUSE_ENV = "EDGE_AGENT_OTA_PAUSE_AT"
RESUME_ENV = "EDGE_AGENT_OTA_RESUME_FILE"


def crash_point(name: str) -> None:
    """SIGKILL ourselves if the crash tests asked for point `name`.

    Active only when ``EDGE_AGENT_FAULT_INJECTION=1`` and ``EDGE_AGENT_OTA_CRASH_AT`` names the
    point: a state entered (``verified``), ``unreported-<state>`` (the record says that state, its
    report is not written yet), ``switched`` (the pointer names the new model, the record still says
    activating), ``mid-download``, ``mid-staging``.

    ``EDGE_AGENT_OTA_PAUSE_AT=<state>`` holds the update, once its record says that state and before
    the state's work starts, until the file ``EDGE_AGENT_OTA_RESUME_FILE`` exists (the clock tests
    move the wall clock there).
    """
    if os.environ.get(CRASH_ENV) == name and os.environ.get("EDGE_AGENT_FAULT_INJECTION") == "1":
        log.warning("fault injection: SIGKILL at %s", name)
        os.kill(os.getpid(), 9)


async def pause_point(name: str) -> None:
    """Wait at point `name` until the resume file exists, if the tests asked for it."""
    if os.environ.get(PAUSE_ENV) != name or os.environ.get("EDGE_AGENT_FAULT_INJECTION") != "1":
        return
    resume = Path(os.environ.get(RESUME_ENV, "resume"))
    log.warning("fault injection: paused at %s until %s exists", name, resume)
    while not resume.exists():
        await asyncio.sleep(0.05)


def crash_when_written(staging: Path) -> None:
    """SIGKILL (point ``mid-staging``) once the patcher has written bytes into `staging`."""

    def watch() -> None:
        while True:
            files = list(staging.glob("*")) if staging.is_dir() else []
            if any(f.stat().st_size > 0 for f in files if f.is_file()):
                crash_point("mid-staging")
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()
