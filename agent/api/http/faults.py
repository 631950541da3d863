"""Fault injection for the HTTP tests: hold a request where the engine takes it in.

Active only when ``EDGE_AGENT_FAULT_INJECTION=1`` and ``EDGE_AGENT_HTTP_SUBMIT_GATE`` names a
FIFO: every generation request then waits, on the thread that renders and tokenizes it, until
the test opens the FIFO for writing and closes it. A test can so hold "a long tokenization"
open for as long as it needs and check that the event loop answers meanwhile, with no timing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

GATE_ENV = "EDGE_AGENT_HTTP_SUBMIT_GATE"


def submit_gate() -> None:
    """Wait at the gate if a test set one (see the module docstring); else return at once."""
    path = os.environ.get(GATE_ENV)
    if not path or os.environ.get("EDGE_AGENT_FAULT_INJECTION") != "1":
        return
    log.warning("fault injection: http submit waits at %s", path)
    with open(path, "rb") as gate:  # blocks until a writer opens the FIFO
        gate.read()  # until it closes
    log.warning("fault injection: http submit passed %s", path)
