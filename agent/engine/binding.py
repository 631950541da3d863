"""A request's KV cache: bound when it is admitted (a session's own, or a free one that may
start from the shared-prefix cache), and a finished prompt's rows offered to that cache."""

from __future__ import annotations

from agent.engine.request import Prepared
from agent.engine.sessions import SessionStore
from agent.kv.prefix import PrefixCache
from agent.kv.snapshot import KVSnapshot
from agent.runtime.runner import Runner

PREFIX_BLOCK = 32  # tokens per block of the shared-prefix cache


def bind(p: Prepared, store: SessionStore, prefix: PrefixCache | None, runner: Runner) -> int:
    """Give an admitted request its KV cache; returns the first row it writes. A session
    brings its own (restored if it was spilled); a fresh prompt may start from a cached
    prefix."""
    if p.session is not None:
        p.kv = store.bind(p.session)
        if p.session.kv_len:
            return p.session.kv_len
    else:
        p.kv = store.take_kv()
    if prefix is not None and len(p.ids) > PREFIX_BLOCK:
        hit = prefix.lookup(p.ids[:-1])
        if hit is not None:
            runner.write_rows(p.kv, hit.arrays)
            p.cached = len(hit.tokens)
    return p.cached


def remember_prefix(
    p: Prepared, start: int, prefix: PrefixCache | None, runner: Runner, model_sha256: str
) -> None:
    """Offer the prompt's whole blocks to the prefix cache (rows that hold prompt only)."""
    if prefix is None or start != 0 or p.kv is None:
        return
    n = (len(p.ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
    if n <= p.cached:
        return
    rows = runner.read_rows(p.kv, n)
    prefix.insert(p.ids[:n], KVSnapshot(model_sha256, tuple(p.ids[:n]), rows))
