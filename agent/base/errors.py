"""The one exception hierarchy of edge-agent.

Every error the agent raises on purpose is an ``AgentError``. Foreign errors (LiteRT,
SentencePiece, OS) are converted at the boundary that meets them (``raise X(...) from exc``),
so callers above that boundary only ever see these types.
"""

from __future__ import annotations

MAX_VALUE_CHARS = 200  # of a bad value's repr in a ConfigError's message


class AgentError(Exception):
    """Base of every error edge-agent raises on purpose."""


class ConfigError(AgentError):
    """A profile or configuration value is wrong.

    Messages name the file, the key, the bad value and what is allowed.
    """

    def __init__(self, source: str, key: str, value: object, allowed: str) -> None:
        self.source = source
        self.key = key
        self.value = value
        self.allowed = allowed
        shown = repr(value)
        if len(shown) > MAX_VALUE_CHARS:  # one line, even for a huge value
            shown = f"{shown[: MAX_VALUE_CHARS - 20]}... ({len(shown):,} characters)"
        super().__init__(f"{source}: {key} = {shown} is not valid; allowed: {allowed}")


class ProfileNotFound(AgentError):
    """No profile of that name or path exists."""


class ModelFormatError(AgentError):
    """A model file or model directory does not have the expected shape."""


class BudgetError(AgentError):
    """Something does not fit the profile's memory budget; the message carries the numbers."""


class ModelTooLarge(BudgetError):
    """A model that cannot load even with every other unpinned model unloaded: no retry helps
    (RESOURCE_EXHAUSTED; HTTP 400 `model_too_large`, as a too-long prompt's is a 400)."""


class AcceleratorError(AgentError):
    """No accelerator in the profile's chain could be brought up."""


class InvalidRequest(AgentError):
    """A generation or tokenize request is malformed or out of range."""


class ContextOverflow(InvalidRequest):
    """A prompt (plus the `max_tokens` it asks for) does not fit the model's context."""

    def __init__(
        self, prompt_tokens: int, context_length: int, max_tokens: int | None = None
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.max_tokens = max_tokens
        if max_tokens is None or prompt_tokens >= context_length:  # the prompt alone overflows
            text = (
                f"prompt is {prompt_tokens} tokens but the model's context holds {context_length}"
            )
        else:
            text = (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{prompt_tokens + max_tokens} tokens is beyond the model's context of "
                f"{context_length}"
            )
        super().__init__(text)


class ConstraintFailed(InvalidRequest):
    """A request's constraint could not go on while it generated (the grammar hit one of the
    constraint library's limits): the request's fault, not the daemon's; the message is ours."""

    PREFIX = "constraint: "  # how its message, and so a failed request's final error, starts


class RuntimeFailure(AgentError):
    """LiteRT failed while running a signature."""


class NonFiniteLogits(RuntimeFailure):
    """The model produced NaN or infinite logits: no token can be chosen from them."""


class Overloaded(AgentError):
    """The request queue is full; try again later."""


class QuotaExceeded(Overloaded):
    """A client is over one of its own quotas (sessions, session bytes, waiting requests); the
    message names the quota, its value and what the client holds. Other clients are served."""

    def __init__(self, quota: str, value: int, held: str, remedy: str) -> None:
        self.quota = quota
        self.value = value
        super().__init__(
            f"client over its quota: it holds {held} and quotas.{quota} = {value} per client "
            f"key; {remedy}"
        )


class BudgetBusy(Overloaded):
    """A model cannot load now: the byte budget is held by models with requests running;
    it may once they are idle (RESOURCE_EXHAUSTED; HTTP 429 with Retry-After)."""


class NotFound(AgentError):
    """A named thing (a session) does not exist."""


class SessionBusy(AgentError):
    """A session already has a request running; one turn at a time."""


class Unavailable(AgentError):
    """The agent cannot take requests right now (loading, swapping a model, stopping)."""


class HostError(AgentError):
    """Something on the host the daemon was pointed at cannot be used as it is: a socket path
    that is not a socket or is too long, a state directory that is a file or cannot be
    written, a directory whose parent is missing, a port that cannot be bound. The daemon
    changed nothing there; the message names the path and what it is."""


class AlreadyRunning(AgentError):
    """Another daemon answers on the socket or holds the state directory's lock; the message
    names its pid."""


class SessionLost(AgentError):
    """A session's saved KV cannot be used (corrupt, truncated, or from another model).

    The bad copy has been deleted; the session does not exist any more.
    """

    def __init__(self, session: str, why: str) -> None:
        self.session = session
        self.why = why
        super().__init__(f"session {session}: {why}; the session is lost")


class UpdateConflict(AgentError):
    """An update command that its update's state does not allow (a commit of an update that
    rolled back, a decision for an update that does not wait for one)."""


# The trailing-metadata key under which the daemon names the error type of a failed call
# (e.g. "ContextOverflow"), for clients to tell apart errors that share a status code.
ERROR_TRAILER = "edge-agent-error"

# The one table from error type to gRPC status code name (looked up along the MRO, so a
# subclass maps like its parent unless listed itself). Anything else is INTERNAL.
GRPC_STATUS: dict[type[AgentError], str] = {
    InvalidRequest: "INVALID_ARGUMENT",
    ContextOverflow: "RESOURCE_EXHAUSTED",
    Overloaded: "RESOURCE_EXHAUSTED",
    NotFound: "NOT_FOUND",
    SessionBusy: "FAILED_PRECONDITION",
    UpdateConflict: "FAILED_PRECONDITION",
    Unavailable: "UNAVAILABLE",
    SessionLost: "DATA_LOSS",
    ConfigError: "FAILED_PRECONDITION",
    ModelFormatError: "FAILED_PRECONDITION",
    BudgetError: "RESOURCE_EXHAUSTED",
    AcceleratorError: "UNAVAILABLE",
    RuntimeFailure: "INTERNAL",
}


def grpc_status_name(exc: BaseException) -> str:
    """The gRPC status code name for an exception (INTERNAL for anything unexpected)."""
    for cls in type(exc).__mro__:
        if cls in GRPC_STATUS:
            return GRPC_STATUS[cls]
    return "INTERNAL"
