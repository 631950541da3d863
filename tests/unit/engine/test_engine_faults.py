"""Faults while KV moves (spill, restore, prefix cache, fork) on real LiteRT: the request that
hit one ends with an error or loses nothing, no session continues without its rows, and the
engine thread serves on.

A fault is one raising call of the runner's `read_rows` / `write_rows` (a MemoryError cannot be
had on demand); everything else is the real engine on the demo model.
"""

from __future__ import annotations

import pytest

from agent.base.errors import RuntimeFailure, SessionLost
from agent.engine.engine import Engine
from agent.engine.types import GenerateRequest, TokenEvent
from tests.unit.engine import test_sessions
from tests.unit.engine.test_engine import _greedy_continue
from tests.unit.engine.test_sessions import GREEDY, MIB, TURNS, push_out, reference, tier, turn

tiered = test_sessions.tiered  # the engine fixture of the tier tests, shared

WAIT_S = 60.0  # a request still running after this: the engine thread is gone
SYSTEM = "".join(f"# rule {i}: be brief\n" for i in range(20))  # more than one prefix block


def run(engine: Engine, request: GenerateRequest) -> list[TokenEvent]:
    """A request's events once it ended; an assertion, not a hang, if it never does."""
    events: list[TokenEvent] = []
    handle = engine.submit(request, events.append)
    handle.consumed(1 << 30)
    assert handle.done.wait(WAIT_S), "the request never ended: the engine thread is gone"
    return events


def ids(events: list[TokenEvent]) -> tuple[int, ...]:
    return tuple(t for e in events for t in e.token_ids)


def fail_next(engine: Engine, name: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The runner's next `name` call raises MemoryError, later ones work. The list returned
    holds `name` once the fault has fired."""
    runner = engine.loaded.runner
    real = getattr(runner, name)
    fired: list[str] = []

    def once(*args: object) -> object:
        if not fired:
            fired.append(name)
            raise MemoryError(f"injected: {name}")
        return real(*args)

    monkeypatch.setattr(runner, name, once)
    return fired


def test_a_failed_spill_fails_the_request_that_needed_the_cache(tiered, monkeypatch) -> None:
    e = tiered(caches=1, host=16 * MIB)
    want = reference(e, 2)
    plain = GenerateRequest("import os", max_tokens=4, sampling=GREEDY)
    expected = ids(run(e, plain))
    sid = e.create_session()
    assert turn(e, sid, TURNS[0]) == want[0]
    fired = fail_next(e, "read_rows", monkeypatch)  # reading sid's rows to spill them
    failed = run(e, plain)
    assert fired
    assert failed[-1].finish_reason == "error" and "MemoryError" in (failed[-1].error or "")
    assert tier(e, sid) == "bound"  # the spill that failed moved nothing
    assert ids(run(e, plain)) == expected  # the engine serves on; this spill works
    assert tier(e, sid) == "host"
    assert turn(e, sid, TURNS[1]) == want[1]  # and the session continues bit for bit
    assert e.stats().requests_failed == 1


@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_failed_restore_loses_that_session_only(tiered, monkeypatch, where) -> None:
    e = tiered(caches=1, **({"host": 16 * MIB} if where == "host" else {"disk": 64 * MIB}))
    want = reference(e, 2)
    a, b = e.create_session(), e.create_session()
    turn(e, a, TURNS[0])
    turn(e, b, TURNS[0])  # a moves down
    push_out(e)  # b moves down
    assert tier(e, a) == tier(e, b) == where
    fired = fail_next(e, "write_rows", monkeypatch)  # writing a's rows back
    failed = run(e, GenerateRequest(TURNS[1], max_tokens=6, sampling=GREEDY, session_id=a))
    assert fired
    assert failed[-1].finish_reason == "error" and "session is lost" in (failed[-1].error or "")
    with pytest.raises(SessionLost, match="could not be restored"):  # never a zeroed cache
        turn(e, a, TURNS[1])
    assert [s.id for s in e.list_sessions()] == [b]
    # b comes back into the only runtime cache: the failed restore gave it back
    assert turn(e, b, TURNS[1]) == want[1]
    assert e.tier_stats().lost == 1 and e.stats().requests_failed == 1


def test_a_failed_prefix_cache_insert_leaves_the_answer_alone(tiered, monkeypatch) -> None:
    e = tiered(caches=2, prefix=8 * MIB)
    request = GenerateRequest(SYSTEM + "def a():", max_tokens=4, sampling=GREEDY)
    fired = fail_next(e, "read_rows", monkeypatch)  # reading the prompt's rows for the cache
    first = run(e, request)
    assert fired
    assert first[-1].finish_reason in ("stop", "length") and first[-1].error is None
    assert e.tier_stats().prefix_entries == 0
    second = run(e, request)  # the engine serves on, and remembers the prefix this time
    third = run(e, request)
    assert ids(first) == ids(second) == ids(third)
    assert third[-1].stats is not None and third[-1].stats.cached_tokens >= 32
    assert e.stats().requests_failed == 0


def test_a_failed_fork_leaves_no_half_made_session(tiered, monkeypatch) -> None:
    e = tiered(caches=2, host=16 * MIB)
    want = reference(e, 2)
    parent = e.create_session()
    turn(e, parent, TURNS[0])
    fired = fail_next(e, "write_rows", monkeypatch)  # writing the parent's rows into the child
    with pytest.raises(MemoryError):
        e.fork_session(parent)
    assert fired and [s.id for s in e.list_sessions()] == [parent]
    run(e, GenerateRequest("import os", max_tokens=2, sampling=GREEDY))
    assert tier(e, parent) == "bound"  # the second cache was given back, nothing was spilled
    child = e.fork_session(parent)
    assert turn(e, child, TURNS[1]) == want[1]
    assert turn(e, parent, TURNS[1]) == want[1]


def test_a_runtime_failure_mid_turn_recomputes_the_session_next_turn(tiered, monkeypatch) -> None:
    """A runtime failure that left the cache damaged (here: zeroed, then raised) ends the turn
    with an error; the session's next turn prefills the whole history again, so its tokens are
    the greedy continuation of the history, computed on a fresh cache."""
    e = tiered(caches=1, host=16 * MIB)
    sid = e.create_session()
    turn(e, sid, TURNS[0])
    runner = e.loaded.runner
    real = runner.decode
    fired: list[str] = []

    def wipe_then_fail(kv, token, pos):  # type: ignore[no-untyped-def]
        if fired:
            return real(kv, token, pos)
        fired.append("decode")
        runner.write_rows(kv, runner.read_rows(kv, 0))  # the cache is left zeroed
        raise RuntimeFailure("injected: decode failed after touching the cache")

    monkeypatch.setattr(runner, "decode", wipe_then_fail)
    failed = run(e, GenerateRequest(TURNS[1], max_tokens=4, sampling=GREEDY, session_id=sid))
    assert fired and failed[-1].finish_reason == "error"
    history = e.session_tokens(sid)
    got = turn(e, sid, TURNS[2])
    assert list(got) == _greedy_continue(e, history + e.tokenizer.encode(TURNS[2]), len(got))
    assert e.session_tokens(sid) == history + e.tokenizer.encode(TURNS[2]) + list(got)
