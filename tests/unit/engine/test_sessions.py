"""Sessions across the KV tiers on real LiteRT: bound → host → disk and back, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.base.errors import ContextOverflow, InvalidRequest, NotFound, SessionLost
from agent.engine.engine import Engine, EngineLimits
from agent.engine.loading import estimate_memory
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.model.directory import demo_model_dir
from agent.model.tflite.file import read_model_file
from agent.model.tflite.layout import discover_layout

GREEDY = SamplingParams(0.0)
TURNS = ["def f(x):", "\n    return", "\n\nclass A:"]
MIB = 1 << 20


def turn(engine: Engine, sid: str, prompt: str, n: int = 6, owner: str = "") -> tuple[int, ...]:
    r = GenerateRequest(prompt, max_tokens=n, sampling=GREEDY, session_id=sid, owner=owner)
    return engine.complete(r).token_ids


def tier(engine: Engine, sid: str) -> str:
    return next(s.tier for s in engine.list_sessions() if s.id == sid)


@pytest.fixture(params=["compiled", "interpreter"])
def tiered(make_profile, tmp_path, request):
    """`tiered(caches=1, host=..., disk=...)`: an engine on the demo model whose budget holds
    exactly `caches` runtime KV caches beside the host tier and prefix cache budgets, with a
    state directory for the disk tier; on each execution path (the Interpreter path keeps its
    caches in host arrays, which a spill must copy, not view)."""
    engines: list[Engine] = []
    demo = demo_model_dir()
    base = make_profile()
    one = estimate_memory(base, demo, "int8")
    kv = discover_layout(read_model_file(demo / "model_int8.tflite")).kv.bytes_per_session

    def make(
        caches: int = 1, host: int = 0, disk: int = 0, prefix: int = 0, state: Path | None = None
    ) -> Engine:
        profile = make_profile(
            runtime={"max_num_bytes": one + (caches - 1) * kv + host + prefix},
            kv={"host_max_bytes": host, "disk_max_bytes": disk, "prefix_max_bytes": prefix},
        )
        e = Engine.load(
            profile,
            demo,
            quantization="int8",
            prefer_interpreter=request.param == "interpreter",
            limits=EngineLimits(max_active=1, max_sessions=32),
            state_dir=state or tmp_path / "state",
        )
        assert e.memory.sessions == caches
        engines.append(e)
        return e

    make.kv_bytes = kv  # type: ignore[attr-defined]
    yield make
    for e in engines:
        e.close()


def reference(engine: Engine, n_turns: int = 3) -> list[tuple[int, ...]]:
    sid = engine.create_session()
    out = [turn(engine, sid, p) for p in TURNS[:n_turns]]
    engine.delete_session(sid)
    return out


def push_out(engine: Engine) -> None:
    """Use the only runtime cache for another session, so idle bound sessions move down."""
    other = engine.create_session()
    turn(engine, other, "import os", 2)
    engine.delete_session(other)


def test_host_tier_spill_and_restore_continue_bit_for_bit(tiered) -> None:
    e = tiered(caches=1, host=16 * MIB)
    want = reference(e)
    sid = e.create_session()
    assert turn(e, sid, TURNS[0]) == want[0]
    assert tier(e, sid) == "bound"
    push_out(e)
    assert tier(e, sid) == "host"
    st = e.tier_stats()
    assert st.host_sessions == 1 and 0 < st.host_bytes <= st.host_budget and st.spills >= 1
    assert turn(e, sid, TURNS[1]) == want[1]
    assert tier(e, sid) == "bound" and e.tier_stats().restores_host == 1
    assert turn(e, sid, TURNS[2]) == want[2]


def test_disk_tier_spill_restore_and_restart(tiered, tmp_path) -> None:
    e = tiered(caches=1, disk=64 * MIB)
    want = reference(e)
    sid = e.create_session(owner="app")
    assert turn(e, sid, TURNS[0], owner="app") == want[0]
    push_out(e)
    assert tier(e, sid) == "disk"
    files = list((tmp_path / "state" / "sessions").glob("*.kv"))
    assert len(files) == 1
    assert turn(e, sid, TURNS[1], owner="app") == want[1]
    assert e.tier_stats().restores_disk == 1
    e.close()  # a graceful stop saves every session to disk
    again = tiered(caches=1, disk=64 * MIB)
    (info,) = again.list_sessions()
    assert (info.id, info.tier, info.owner) == (sid, "disk", "app")
    with pytest.raises(NotFound):
        turn(again, sid, TURNS[2], owner="someone else")
    assert turn(again, sid, TURNS[2], owner="app") == want[2]


def test_a_changed_model_invalidates_saved_sessions(tiered, tmp_path) -> None:
    e = tiered(caches=1, disk=64 * MIB)
    sid = e.create_session()
    turn(e, sid, TURNS[0])
    e.close()
    from agent.kv.disk import DiskTier

    # the same directory opened for another model's sha256: the file is deleted, not loaded
    other = DiskTier(tmp_path / "state", "0" * 64, 64 * MIB)
    assert other.keys() == [] and not list((tmp_path / "state" / "sessions").glob("*.kv"))


def test_a_corrupted_disk_file_loses_that_session_only(tiered, tmp_path) -> None:
    e = tiered(caches=1, disk=64 * MIB)
    want = reference(e, 2)
    a, b = e.create_session(), e.create_session()
    turn(e, a, TURNS[0])
    turn(e, b, TURNS[0])  # a goes to disk
    push_out(e)  # b goes to disk
    assert tier(e, a) == tier(e, b) == "disk"
    path = tmp_path / "state" / "sessions" / f"{a}.kv"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SessionLost, match="lost"):
        turn(e, a, TURNS[1])
    with pytest.raises(SessionLost):  # and it stays reported lost, never continued
        turn(e, a, TURNS[1])
    assert turn(e, b, TURNS[1]) == want[1]
    assert e.tier_stats().lost == 1


def test_unwritable_state_directory_degrades_to_host(tiered, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    e = tiered(caches=1, host=16 * MIB, disk=64 * MIB, state=blocker / "state")
    want = reference(e, 2)
    sid = e.create_session()
    turn(e, sid, TURNS[0])
    push_out(e)
    assert tier(e, sid) == "host"
    assert turn(e, sid, TURNS[1]) == want[1]
    assert e.tier_stats().disk_budget == 64 * MIB


def test_host_budget_overflow_moves_the_oldest_to_disk(tiered) -> None:
    e = tiered(caches=1, host=24 * 1024, disk=64 * MIB)  # one short session's rows fit
    sids = [e.create_session() for _ in range(3)]
    for sid in sids:
        turn(e, sid, TURNS[0])
    push_out(e)
    tiers = [tier(e, s) for s in sids]
    assert tiers.count("disk") >= 1 and "bound" not in tiers
    st = e.tier_stats()
    assert st.host_bytes <= st.host_budget


def test_fork_shares_the_prefix_and_leaves_the_parent_alone(tiered) -> None:
    e = tiered(caches=2, host=16 * MIB)
    want = reference(e)
    parent = e.create_session()
    turn(e, parent, TURNS[0])
    child = e.fork_session(parent)
    assert e.session_tokens(child) == e.session_tokens(parent)
    assert turn(e, child, TURNS[1]) == want[1]
    assert turn(e, parent, TURNS[1]) == want[1]  # unaffected by the child's turn
    assert turn(e, parent, TURNS[2]) == want[2]
    with pytest.raises(NotFound):
        e.fork_session(parent, owner="another app")


def test_owners_do_not_see_each_other(tiered) -> None:
    e = tiered(caches=2)
    mine = e.create_session(owner="a")
    assert [s.id for s in e.list_sessions("a")] == [mine]
    assert e.list_sessions("b") == []
    for call in (lambda: turn(e, mine, "x", owner="b"), lambda: e.delete_session(mine, "b")):
        with pytest.raises(NotFound):
            call()
    with pytest.raises(InvalidRequest):
        e.create_session(policy="forget")


def test_truncate_policy_keeps_the_first_turn_and_recent_turns(tiered) -> None:
    e = tiered(caches=2)
    ctx = e.info.context_length
    filler = "x = 1\n" * (ctx // 12)
    strict, loose = e.create_session(), e.create_session(policy="truncate")
    for sid in (strict, loose):
        turn(e, sid, "# system prompt\n", 2)
    overflowed = False
    for _ in range(6):
        try:
            turn(e, strict, filler, 4)
        except ContextOverflow as exc:
            assert str(ctx) in str(exc)
            overflowed = True
            break
    assert overflowed
    first = e.session_tokens(loose)
    dropped = 0
    for _ in range(6):
        r = e.complete(GenerateRequest(filler, max_tokens=4, sampling=GREEDY, session_id=loose))
        dropped += r.stats.truncated_tokens
        tokens = e.session_tokens(loose)
        assert len(tokens) < ctx and tokens[: len(first)] == first
    assert dropped > 0
    assert e.tier_stats().resume_misses >= 1


def test_prefix_cache_reuses_a_shared_system_prompt(tiered) -> None:
    e = tiered(caches=2, prefix=8 * MIB)
    system = "".join(f"# rule {i}: be brief\n" for i in range(20))
    first = e.complete(GenerateRequest(system + "def a():", max_tokens=4, sampling=GREEDY))
    second = e.complete(GenerateRequest(system + "def b():", max_tokens=4, sampling=GREEDY))
    assert first.stats.cached_tokens == 0
    # the first's free cache holds more of it than whole blocks: it is reused instead (the
    # prefix cache's own hit, when that cache is gone: tests/unit/engine/test_prompt_reuse.py)
    assert second.stats.cached_tokens >= 32
    st = e.tier_stats()
    assert st.prefix_entries >= 1 and 0 < st.prefix_bytes <= 8 * MIB
    off = tiered(caches=2)
    plain = off.complete(GenerateRequest(system + "def b():", max_tokens=4, sampling=GREEDY))
    assert second.token_ids == plain.token_ids


def test_state_files_are_private(tiered, tmp_path) -> None:
    e = tiered(caches=1, disk=64 * MIB)
    sid = e.create_session()
    turn(e, sid, TURNS[0])
    push_out(e)
    (path,) = (tmp_path / "state" / "sessions").glob("*.kv")
    assert os.stat(path).st_mode & 0o077 == 0
