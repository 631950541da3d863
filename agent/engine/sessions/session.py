"""A session: one conversation's tokens and turns, where its KV is, and how a new turn is
fitted into the context under the session's policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from agent.base.errors import ContextOverflow
from agent.engine.types import SessionInfo
from agent.runtime.runner import KVCache

log = logging.getLogger("agent.engine.engine")  # moved from engine.py: its lines keep their name


@dataclass(slots=True)
class Session:
    """A conversation: its tokens, its turns, and where its KV is."""

    id: str
    owner: str
    policy: str
    created: float  # unix time
    last_used: float  # unix time
    tokens: list[int] = field(default_factory=list)  # the whole conversation so far
    turns: list[int] = field(default_factory=list)  # where each turn starts in `tokens`
    kv_len: int = 0  # tokens[:kv_len] are in the KV; the rest is fed on the next turn
    busy: bool = False
    tier: str = "empty"
    kv: KVCache | None = None  # while bound
    kv_bytes: int = 0

    def meta(self) -> dict[str, Any]:
        """What a disk file keeps besides the rows (JSON)."""
        return {
            "owner": self.owner,
            "policy": self.policy,
            "created": self.created,
            "last_used": self.last_used,
            "tokens": self.tokens,
            "turns": self.turns,
        }

    def info(self) -> SessionInfo:
        return SessionInfo(
            self.id,
            self.owner,
            self.tier,
            len(self.tokens),
            self.kv_bytes,
            self.policy,
            self.created,
            self.last_used,
        )


def fit_context(
    s: Session, new: list[int], max_tokens: int, ctx: int, explicit: int | None = None
) -> int:
    """Make room for a turn under the session's policy; returns the tokens dropped.

    `error`: a turn that does not fit is refused with both numbers. `truncate`: the first
    turn (the system prompt) and the most recent turns that fit are kept, room is left for
    the answer (up to a quarter of the context), and what follows the first turn is
    prefilled again at its new positions. An `explicit` max_tokens (the request's own) must
    fit beside the turn as it does beside a plain prompt; checked before anything changes."""
    total = len(s.tokens) + len(new)
    room = 1 if explicit is None else explicit  # rows the answer needs past the prompt
    if total + room <= ctx:
        return 0
    if s.policy != "truncate":
        raise ContextOverflow(total, ctx, explicit)
    reserve = min(max_tokens, ctx // 4) if explicit is None else explicit
    head = s.turns[1] if len(s.turns) > 1 else len(s.tokens)  # the end of the first turn
    fits = [t for t in s.turns[1:] if head + len(s.tokens) - t + len(new) + reserve <= ctx]
    keep_from = fits[0] if fits else len(s.tokens)
    if head + len(s.tokens) - keep_from + len(new) + room > ctx:
        raise ContextOverflow(head + len(new), ctx, explicit)
    dropped = keep_from - head
    if dropped > 0:
        kept = s.tokens[keep_from:]
        s.turns = s.turns[:1] + [head + t - keep_from for t in s.turns if t >= keep_from]
        s.tokens = s.tokens[:head] + kept
        s.kv_len = min(s.kv_len, head)
        log.info(
            "session %s: %d tokens of history dropped to fit the context (truncate)",
            s.id,
            dropped,
            extra={"session_id": s.id},
        )
    return dropped
