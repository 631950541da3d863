"""Domain errors → HTTP status and OpenAI's error JSON, ``{"error": {"message", "type",
"param", "code"}}``: one table, looked up along the MRO as `agent.base.errors.GRPC_STATUS` is."""

from __future__ import annotations

from typing import Any, Final

from agent.base.errors import (
    AcceleratorError,
    AgentError,
    BudgetError,
    ConfigError,
    ConstraintFailed,
    ContextOverflow,
    InvalidRequest,
    ModelFormatError,
    ModelTooLarge,
    NotFound,
    Overloaded,
    RuntimeFailure,
    SessionBusy,
    SessionLost,
    Unavailable,
)

RETRY_AFTER_S: Final = 1  # what a 429 / 503 tells the client to wait

# error type → (HTTP status, OpenAI error "type", "code")
HTTP_STATUS: dict[type[AgentError], tuple[int, str, str | None]] = {
    InvalidRequest: (400, "invalid_request_error", None),
    ContextOverflow: (400, "invalid_request_error", "context_length_exceeded"),
    Overloaded: (429, "rate_limit_error", "overloaded"),
    NotFound: (404, "invalid_request_error", "not_found"),
    SessionBusy: (409, "invalid_request_error", "session_busy"),
    Unavailable: (503, "server_error", "unavailable"),
    SessionLost: (410, "invalid_request_error", "session_lost"),
    ConfigError: (500, "server_error", None),
    ModelFormatError: (500, "server_error", None),
    BudgetError: (503, "server_error", None),
    # never fits: the openai SDK retries 429 and 5xx, so a 400 (as context_length_exceeded)
    ModelTooLarge: (400, "invalid_request_error", "model_too_large"),
    AcceleratorError: (503, "server_error", None),
    RuntimeFailure: (500, "server_error", None),
}


class HttpError(InvalidRequest):
    """A request the HTTP layer itself refuses: its status, and the parameter at fault."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def failure_kind(error: str) -> str:
    """The error type of a stream's last event, from the engine's error text: the request's
    own grammar failing it is the client's (as a whole answer's 400 says), the rest ours."""
    return "invalid_request_error" if error.startswith(ConstraintFailed.PREFIX) else "server_error"


def describe(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error JSON, extra headers) for an exception; anything that is not an
    AgentError is a 500 that says no more than that."""
    if isinstance(exc, HttpError):
        return exc.status, error_body(str(exc), exc.kind, exc.param, exc.code), {}
    if not isinstance(exc, AgentError):
        return 500, error_body("internal error", "server_error"), {}
    status, kind, code = 500, "server_error", None
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            status, kind, code = HTTP_STATUS[cls]
            break
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}
    return status, error_body(str(exc), kind, None, code), headers
