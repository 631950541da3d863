"""The exit codes of the `edge-agent` command line: one table for every command.

Scripts branch on these, so a code never changes its meaning (README "Exit codes" lists them):

====  ============  ==========================================================================
code  name          when
====  ============  ==========================================================================
0     OK            the command did what it was asked (a generation ended by stop or length)
1     FAILED        the daemon or the model failed (INTERNAL, UNKNOWN, DATA_LOSS, a stream
                    that ended with an error), or anything else unexpected
2     USAGE         the command line or the request is wrong: a bad flag, file or value, the
                    daemon's INVALID_ARGUMENT / OUT_OF_RANGE, a prompt + max_tokens beyond the
                    context; retrying the same command cannot help
3     UNREACHABLE   no daemon answers on the socket (missing, stale, or not ours to open)
4     DEADLINE      `--timeout` passed before the answer was complete
5     REFUSED       the daemon understood the request and will not do it in its present state:
                    NOT_FOUND (no such session), FAILED_PRECONDITION, PERMISSION_DENIED, ...
6     BUSY          the daemon is up but cannot take it now: the queue or the sessions are full
                    (RESOURCE_EXHAUSTED), a session is busy, it is loading, swapping a model or
                    stopping (UNAVAILABLE), or health is NOT_SERVING; a later retry may pass
7     CANCELLED     the daemon cancelled the request (it was stopping or draining)
130   INTERRUPTED   SIGINT (Ctrl-C); the request was cancelled, what had arrived was printed
====  ============  ==========================================================================

A daemon's failed call carries its error type in the `edge-agent-error` trailer
(`agent.base.errors.ERROR_TRAILER`); it decides where the status code alone would not
(RESOURCE_EXHAUSTED is a full queue or a context overflow).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from agent.base.errors import (
    AgentError,
    ContextOverflow,
    Overloaded,
    RuntimeFailure,
    SessionBusy,
    Unavailable,
)

OK: Final = 0
FAILED: Final = 1
USAGE: Final = 2
UNREACHABLE: Final = 3
DEADLINE: Final = 4
REFUSED: Final = 5
BUSY: Final = 6
CANCELLED: Final = 7
INTERRUPTED: Final = 130

NAMES: Final[Mapping[int, str]] = {
    OK: "ok",
    FAILED: "failed",
    USAGE: "usage",
    UNREACHABLE: "unreachable",
    DEADLINE: "deadline",
    REFUSED: "refused",
    BUSY: "busy",
    CANCELLED: "cancelled",
    INTERRUPTED: "interrupted",
}

# gRPC status code name -> exit code, for a call the daemon (or gRPC itself) failed.
BY_STATUS: Final[Mapping[str, int]] = {
    "INVALID_ARGUMENT": USAGE,
    "OUT_OF_RANGE": USAGE,
    "DEADLINE_EXCEEDED": DEADLINE,
    "CANCELLED": CANCELLED,
    "NOT_FOUND": REFUSED,
    "ALREADY_EXISTS": REFUSED,
    "PERMISSION_DENIED": REFUSED,
    "UNAUTHENTICATED": REFUSED,
    "FAILED_PRECONDITION": REFUSED,
    "UNIMPLEMENTED": REFUSED,
    "RESOURCE_EXHAUSTED": BUSY,
    "UNAVAILABLE": BUSY,
    "ABORTED": BUSY,
    "INTERNAL": FAILED,
    "UNKNOWN": FAILED,
    "DATA_LOSS": FAILED,
}

# Error types whose exit code is not their status code's (looked up along the MRO). Every other
# AgentError raised in this process (a bad profile, model file or value) is USAGE.
BY_ERROR: Final[Mapping[type[AgentError], int]] = {
    ContextOverflow: USAGE,  # RESOURCE_EXHAUSTED on the wire, but no retry makes it fit
    SessionBusy: BUSY,  # FAILED_PRECONDITION on the wire; the turn before it will end
    Overloaded: BUSY,
    Unavailable: BUSY,
    RuntimeFailure: FAILED,
}

_BY_ERROR_NAME: Final[Mapping[str, int]] = {cls.__name__: code for cls, code in BY_ERROR.items()}


def for_error(exc: AgentError) -> int:
    """The exit code for an AgentError raised in this process."""
    for cls in type(exc).__mro__:
        if cls in BY_ERROR:
            return BY_ERROR[cls]
    return USAGE


def for_status(status: str, error_type: str | None = None) -> int:
    """The exit code for a failed call: its gRPC status code name and, when the daemon sent
    one, the error type it named."""
    if error_type is not None and error_type in _BY_ERROR_NAME:
        return _BY_ERROR_NAME[error_type]
    return BY_STATUS.get(status, FAILED)
