"""The client's exceptions: every failed call raises an `EdgeAgentError` subclass carrying the
daemon's message, its gRPC status name (`code`) and, where the daemon names one, its error type
(`error_type`, from the ``edge-agent-error`` trailer, e.g. "ContextOverflow")."""

from __future__ import annotations

from typing import Any

import grpc

# the trailing-metadata key under which the daemon names the error type (agent/base/errors.py)
ERROR_TRAILER = "edge-agent-error"


class EdgeAgentError(Exception):
    """A call to the daemon failed; `str()` is the daemon's message."""

    def __init__(self, message: str, code: str = "UNKNOWN", error_type: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.error_type = error_type


class InvalidArgument(EdgeAgentError):
    """The request is malformed or out of range (INVALID_ARGUMENT)."""


class ContextOverflow(InvalidArgument):
    """The prompt plus `max_tokens` does not fit the model's context (RESOURCE_EXHAUSTED)."""


class Overloaded(EdgeAgentError):
    """The daemon's queue is full; try again later (RESOURCE_EXHAUSTED)."""


class NotFound(EdgeAgentError):
    """No such session (or it belongs to another client key) (NOT_FOUND)."""


class FailedPrecondition(EdgeAgentError):
    """The daemon cannot do this in its present state (FAILED_PRECONDITION)."""


class SessionBusy(FailedPrecondition):
    """The session already has a request running; one turn at a time."""


class SessionLost(EdgeAgentError):
    """The session's saved KV was unusable; the session no longer exists (DATA_LOSS)."""


class Unavailable(EdgeAgentError):
    """The daemon is not reachable or not taking requests (loading, stopping) (UNAVAILABLE)."""


class DeadlineExceeded(EdgeAgentError):
    """The call's timeout passed (DEADLINE_EXCEEDED)."""


class Cancelled(EdgeAgentError):
    """The call was cancelled (CANCELLED)."""


class Internal(EdgeAgentError):
    """The daemon failed (INTERNAL, or any status without a class of its own)."""


# the daemon's error type (trailer) first, then its status code
_BY_TYPE: dict[str, type[EdgeAgentError]] = {
    "ContextOverflow": ContextOverflow,
    "Overloaded": Overloaded,
    "SessionBusy": SessionBusy,
    "SessionLost": SessionLost,
}
_BY_CODE: dict[str, type[EdgeAgentError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "OUT_OF_RANGE": InvalidArgument,
    "RESOURCE_EXHAUSTED": Overloaded,
    "NOT_FOUND": NotFound,
    "FAILED_PRECONDITION": FailedPrecondition,
    "DATA_LOSS": SessionLost,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "CANCELLED": Cancelled,
}


def _error_type(metadata: Any) -> str:
    for name, value in metadata or ():
        if name == ERROR_TRAILER:
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return ""


def from_rpc_error(exc: grpc.RpcError) -> EdgeAgentError:
    """The client exception for a failed gRPC call (sync or grpc.aio)."""
    code_of = getattr(exc, "code", None)
    status = code_of() if callable(code_of) else None
    code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
    details_of = getattr(exc, "details", None)
    message = (details_of() if callable(details_of) else None) or str(exc)
    trailers_of = getattr(exc, "trailing_metadata", None)
    error_type = _error_type(trailers_of() if callable(trailers_of) else None)
    cls = _BY_TYPE.get(error_type) or _BY_CODE.get(code, Internal)
    return cls(message, code, error_type)
