"""A request's KV cache: bound when it is admitted (a session's own, or a free one that may
already hold the start of its prompt, or start from the shared-prefix cache), and what a
finished request leaves behind: the prompt's whole blocks offered to the prefix cache, and the
ids of the rows its cache holds for the next request that shares them."""

from __future__ import annotations

from collections.abc import Sequence

from agent.engine.request import Prepared
from agent.engine.sessions.store import SessionStore
from agent.kv.prefix import PrefixCache
from agent.kv.snapshot import KVSnapshot
from agent.runtime.runner import Runner

PREFIX_BLOCK = 32  # tokens per block of the shared-prefix cache
REUSABLE = ("stop", "length", "cancelled")  # ends whose rows below kv_rows are all written


def bind(p: Prepared, store: SessionStore, prefix: PrefixCache | None, runner: Runner) -> int:
    """Give an admitted request its KV cache; returns the first row it writes. A session
    brings its own (restored if it was spilled); a fresh prompt takes the free cache that
    holds the longest start of it, or starts from a cached prefix when that is longer. The
    last prompt token is never reused: its logits are needed."""
    reused = 0
    if p.session is not None:
        p.kv = store.bind(p.session)
        if p.session.kv_len:
            return p.session.kv_len
    else:
        p.kv, reused = store.take_kv_for(p.ids[:-1])
    whole = (len(p.ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
    if prefix is not None and whole > reused:
        hit = prefix.lookup(p.ids[:-1])
        if hit is not None and len(hit.tokens) > reused:
            runner.write_rows(p.kv, hit.arrays)
            reused = len(hit.tokens)
    p.cached = reused
    return reused


def held_tokens(p: Prepared, generated: Sequence[int], rows: int, finish: str) -> list[int]:
    """The ids whose rows a finished request without a session leaves in its cache: row i
    holds token i of prompt + reply for i < `rows` (the last reply token is never fed back
    unless the request ended on a stop id). Empty after a runtime failure: a step or a KV
    window move may have left any row half written."""
    if finish not in REUSABLE:
        return []
    return (list(p.ids) + list(generated))[:rows]


def remember_prefix(
    p: Prepared, start: int, prefix: PrefixCache | None, runner: Runner, model_sha256: str
) -> None:
    """Offer the prompt's whole blocks to the prefix cache (rows that hold prompt only)."""
    if prefix is None or start != 0 or p.kv is None:
        return
    n = (len(p.ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
    if n == 0 or prefix.holds(p.ids[:n]):
        return
    rows = runner.read_rows(p.kv, n)
    prefix.insert(p.ids[:n], KVSnapshot(model_sha256, tuple(p.ids[:n]), rows))


def history(p: Prepared) -> list[int]:
    """The conversation the model sees before the first generated token: a session's rows
    in the KV and what this turn feeds (drafts come from it; a repetition penalty's window)."""
    return (p.session.tokens[: p.session.kv_len] if p.session is not None else []) + p.ids
