"""What the client returns: frozen dataclasses, one per API message (never protobuf messages).

Field names are the protobuf fields' names (docs/API.md describes them); repeated fields are
tuples, enums are strings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS: Mapping[int, FinishReason] = {
    1: "stop",
    2: "length",
    3: "cancelled",
    4: "error",
}


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message: role "system" | "user" | "assistant", and its text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Stats:
    """How a request went; sent with its last chunk."""

    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    accelerator: str
    queue_ms: float
    cached_tokens: int  # prompt tokens whose KV was reused (session, shared prefix)
    truncated_tokens: int  # history a "truncate" session dropped to fit this turn
    drafted_tokens: int  # speculative decoding: drafts checked by verify calls
    accepted_tokens: int  # the drafts that held (acceptance = accepted / drafted)
    verify_calls: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed piece of a generation: the new text (never half a character), its token
    ids; `finish_reason` and `stats` on the last chunk only."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stats: Stats | None
    error: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation. `finish_reason` is "cancelled" when the caller cancelled it."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stats: Stats | None
    error: str
    request_id: str


@dataclass(frozen=True, slots=True)
class KVTiers:
    """Sessions and bytes per KV tier, and how often each served a turn."""

    bound_sessions: int
    bound_bytes: int
    host_sessions: int
    host_bytes: int
    host_budget: int
    disk_sessions: int
    disk_bytes: int
    disk_budget: int
    spills: int
    restores_host: int
    restores_disk: int
    lost: int
    resume_hits: int
    resume_misses: int
    prefix_hits: int
    prefix_misses: int
    prefix_bytes: int
    prefix_entries: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    version: str
    sha256: str
    quantization: str
    vocab_size: int
    context_length: int
    signatures: tuple[str, ...]
    accelerator: str
    execution_path: str
    kv_layout: str
    fallbacks: tuple[str, ...]
    kv: KVTiers
    kv_bytes_per_session: int
    kv_caches: int
    prepared: str
    batch_sizes: tuple[int, ...]  # packed decode's rows per call; () when it does not pack
    batch_problem: str  # why it does not ("" when it does)


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p95: float


@dataclass(frozen=True, slots=True)
class ProbeFigures:
    """A model's latest quality probe on this device; compare figures only under one probe_id."""

    probe_id: str
    nll_per_token: float  # mean negative log-likelihood (nats/token) of the probe text
    nll_tokens: int
    canary_agreement: float  # share (0..1) of canary answer tokens equal to the base's
    canary_tokens: int
    measured_unix: float
    runs: int
    cpu_s: float  # CPU seconds the last probe took


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """How one model serves on this device since its activation (kept across restarts), and
    its latest quality probe (None until probed)."""

    sha256: str
    version: str
    name: str
    quantization: str
    activated_unix: float
    requests: int  # requests that ran to an end (finished, failed or cancelled)
    errors: Mapping[str, int]  # "nonfinite" | "constraint" | "timeout" | "internal"
    cancelled: int
    ttft_ms: Percentiles
    decode_tok_s: Percentiles
    prefill_tok_s: Percentiles
    samples: int  # requests behind the percentiles (the most recent, bounded)
    restarts: int
    crashes: int
    peak_rss_bytes: int
    probe: ProbeFigures | None


@dataclass(frozen=True, slots=True)
class NamedModel:
    """One of the daemon's named models (`[models]`): loaded or not, its share of the budget."""

    name: str
    version: str
    quantization: str
    context_length: int
    default: bool
    loaded: bool
    pinned: bool
    keep_alive_s: float  # in force now; negative: forever
    planned_bytes: int  # what its engine holds of the budget; 0 when unloaded
    estimate_bytes: int
    loads: int
    unloads: int
    evictions: int
    last_load_s: float
    active: int


@dataclass(frozen=True, slots=True)
class Status:
    profile: str
    version: str
    uptime_s: float
    rss_bytes: int
    budget_bytes: int
    planned_bytes: int
    queue_depth: int
    queue_capacity: int
    active_requests: int
    max_active: int
    active_sessions: int
    requests_total: int
    requests_failed: int
    requests_rejected: int
    tokens_generated: int
    ttft_ms: Percentiles
    decode_tok_s: Percentiles
    state: str  # "serving" | "reloading" | "stopping"
    model: str
    kv: KVTiers
    nonfinite_logits: int
    drafted_tokens: int  # speculative decoding, over every finished request
    accepted_tokens: int
    # whether the agent knows its wall clock is right (update validity windows wait for it)
    clock_synchronized: bool
    clock_source: str  # "timesyncd", "kernel", "trusted" or "" while unsynchronized
    # the serving model's figures and the model's before it; None when not known
    run: ModelFigures | None
    previous: ModelFigures | None
    models: tuple[NamedModel, ...]  # every named model, the default first


@dataclass(frozen=True, slots=True)
class SessionInfo:
    id: str
    tier: str  # "empty" | "bound" | "host" | "disk"
    tokens: int
    kv_bytes: int
    policy: str  # "error" | "truncate"
    created_unix: float
    last_used_unix: float


T = TypeVar("T")


def plain(cls: type[T], message: Any, **given: Any) -> T:
    """`cls` from a protobuf message: every field not `given` is the message's field of the same
    name; repeated fields become tuples."""
    values = dict(given)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in values:
            value = getattr(message, f.name)
            values[f.name] = value if isinstance(value, str | int | float) else tuple(value)
    return cls(**values)


def kv_tiers(message: Any) -> KVTiers:
    return plain(KVTiers, message)


def stats(message: Any) -> Stats:
    return plain(Stats, message)


def model_info(message: Any) -> ModelInfo:
    return plain(ModelInfo, message, kv=kv_tiers(message.kv))


def model_figures(message: Any) -> ModelFigures:
    return plain(
        ModelFigures,
        message,
        errors=dict(message.errors),
        ttft_ms=plain(Percentiles, message.ttft_ms),
        decode_tok_s=plain(Percentiles, message.decode_tok_s),
        prefill_tok_s=plain(Percentiles, message.prefill_tok_s),
        probe=plain(ProbeFigures, message.probe) if message.HasField("probe") else None,
    )


def status(message: Any) -> Status:
    return plain(
        Status,
        message,
        ttft_ms=plain(Percentiles, message.ttft_ms),
        decode_tok_s=plain(Percentiles, message.decode_tok_s),
        kv=kv_tiers(message.kv),
        run=model_figures(message.run) if message.HasField("run") else None,
        previous=model_figures(message.previous) if message.HasField("previous") else None,
        models=tuple(plain(NamedModel, m) for m in message.models),
    )


def session_info(message: Any) -> SessionInfo:
    return plain(SessionInfo, message)


def chunk(message: Any) -> Chunk:
    reason = FINISH_REASONS.get(message.finish_reason)
    return Chunk(
        text=message.text,
        token_ids=tuple(message.token_ids),
        finish_reason=reason,
        stats=stats(message.stats) if message.HasField("stats") else None,
        error=message.error,
        request_id=message.request_id,
    )
