"""Frozen values that cross the engine boundary: requests, token events, stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.engine.sampler import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation. `max_tokens` / sampling fall back to the profile's defaults when None."""

    prompt: str
    max_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: tuple[str, ...] = ()
    add_bos: bool = True
    session_id: str | None = None  # continue this session's conversation


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
