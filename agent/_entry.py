"""The `edge-agent` console script's entry point (and ``python -m agent``'s).

A Ctrl-C at any moment must end a command with exit 130, one line and no traceback, within a
second. Until the command itself runs (Python still importing the CLI, which takes a while on
a board), SIGINT exits at once; the command then gets Python's usual KeyboardInterrupt so that
it can clean up (a rollout saves its state, a client says "interrupted"), and after that a
second Ctrl-C, or a shutdown that hangs (gRPC's channel finalizers once did for minutes), ends
the process at once. SIGINT is unblocked here in case the parent left it blocked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType

INTERRUPTED = 130  # agent.base.exitcodes.INTERRUPTED, without importing anything yet


def quiet_exit(signum: int, frame: FrameType | None) -> None:
    """SIGINT where no cleanup is left to do: one line, exit 130, nothing else runs."""
    with contextlib.suppress(OSError):
        os.write(2, b"\nedge-agent: interrupted\n")
    os._exit(INTERRUPTED)


def main() -> int:
    signal.signal(signal.SIGINT, quiet_exit)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from agent.cli import main as cli_main

    return cli_main(on_interrupt=quiet_exit)


if __name__ == "__main__":
    sys.exit(main())
