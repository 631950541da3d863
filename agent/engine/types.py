"""Frozen values that cross the engine boundary: requests, token events, stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.chat.types import ChatMessage, Tool
from agent.constraint.types import Constraint

if TYPE_CHECKING:  # only a field's type: the sampler itself needs numpy
    from agent.engine.sampler import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "error")
SESSION_POLICIES = ("error", "truncate")  # what a turn that overflows the context does
TIERS = ("empty", "bound", "host", "disk")  # where a session's KV lives ("empty": none yet)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What one engine runs and holds at once, and what one client key may hold of it."""

    max_active: int = 4  # requests holding a KV slot at once (also bounded by the budget)
    queue_capacity: int = 16  # requests waiting for a slot
    max_pending_events: int = 64  # events a slow consumer may leave unread before a pause
    max_sessions: int = 64  # live sessions in all tiers; also caps the bound ones
    # A stream's tokens per event: the first token and the end go out at once, the tokens in
    # between together once this many wait or the interval has passed (RequestHandle). 1: an
    # event per token (each event costs more than a fast model's token).
    event_tokens: int = 16
    event_interval_s: float = 0.010
    # per client key (agent.engine.quotas); None: half of the shared bound it divides
    sessions_per_client: int | None = None
    session_bytes_per_client: int | None = None  # host + disk tier bytes of its sessions
    waiting_per_client: int | None = None
    # a paused request whose consumer has read nothing for this long is cancelled: a client
    # that stops reading must not hold a running slot (and so other clients) forever
    consumer_stall_s: float = 60.0
    # pack running requests' decode steps into the model's batch signatures (agent.engine.packing)
    batch_decode: bool = True


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation. `max_tokens` / sampling fall back to the profile's defaults when None.

    A chat sets `messages` (and leaves `prompt` empty): the engine renders them through the
    model's chat template (`agent.chat.template`); with `session_id`, only the new turn's.
    """

    prompt: str
    max_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: tuple[str, ...] = ()
    add_bos: bool = True
    session_id: str | None = None  # continue this session's conversation
    owner: str = ""  # the caller's identity; a session answers only to the one that made it
    messages: tuple[ChatMessage, ...] = ()  # a chat instead of a prompt
    constraint: Constraint | None = None  # structured output: only what it allows
    tools: tuple[Tool, ...] = ()  # functions the chat template shows the model
    tool_choice: str = "auto"  # one of TOOL_CHOICES (agent.chat.toolcalls)
    tool_name: str = ""  # the function a tool_choice "function" must call
    speculation: str | None = None  # "off" | "ngram" (SPECULATION_MODES); None: the profile's


@dataclass(frozen=True, slots=True)
class RequestStats:
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_ms: float
    decode_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    accelerator: str
    queue_ms: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV was reused (session resume, prefix cache)
    truncated_tokens: int = 0  # history dropped by a session's truncate policy for this turn
    # speculative decoding (agent.engine.speculation): drafts checked by verify calls, and
    # how many of them the sampler accepted
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_calls: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted over drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A streamed piece of output: new text and the ids that produced it.

    The last event of a request has `finish_reason` and `stats` set (and may carry text).
    """

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation, collected from its events."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: RequestStats
    events: tuple[TokenEvent, ...] = field(default=(), repr=False)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """One session as `list` shows it."""

    id: str
    owner: str
    tier: str  # one of TIERS
    tokens: int
    kv_bytes: int  # what its KV takes in its tier
    policy: str  # one of SESSION_POLICIES
    created: float  # unix time
    last_used: float  # unix time


@dataclass(frozen=True, slots=True)
class TierStats:
    """Sessions and bytes per KV tier, and how often each tier served a turn."""

    bound_sessions: int
    bound_bytes: int
    host_sessions: int
    host_bytes: int
    host_budget: int
    disk_sessions: int
    disk_bytes: int
    disk_budget: int
    spills: int  # bound -> host or disk
    restores_host: int
    restores_disk: int
    lost: int  # sessions dropped: evicted past every tier, or a bad saved file
    resume_hits: int  # continued turns that found their KV (any tier)
    resume_misses: int  # continued turns that had to prefill their history again
    prefix_hits: int
    prefix_misses: int
    prefix_bytes: int
    prefix_entries: int
