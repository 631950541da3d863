"""A stateless client's conversation reuses the KV rows its last turn left in a free cache.

Every reply is checked against a reference outside the engine's caches: a plain greedy loop
on a second engine's runner that prefills the whole prompt from row 0 in a new KV cache. Each
free cache's rows are also compared with the rows that plain prefill writes for the tokens the
cache claims to hold, so a reused row that is not the row a fresh prefill writes fails here
even where greedy decoding would not notice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from agent.chat.types import ChatMessage
from agent.engine.engine import Engine, EngineLimits
from agent.engine.loading import estimate_memory
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.model.directory import demo_model_dir

GREEDY = SamplingParams(0.0)
MIB = 1 << 20
REPLY = 12
LINES = [
    "def parse(path):",
    "now make it return a list of rows",
    "skip the empty lines",
    "and strip each field",
    "raise ValueError on a short row",
    "add a docstring",
    "make the separator a parameter",
    "use a generator instead",
    "add type hints",
    "write a test for it",
]


@pytest.fixture(scope="module", params=["compiled", "interpreter"])
def engines(
    tmp_path_factory: pytest.TempPathFactory,
    dev_profile_data: dict[str, object],
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Engine, Engine]]:
    """The engine under test (free-cache reuse and the prefix cache off, so that what a request
    reuses is exactly what this test computes), and a reference engine whose runner the test
    drives directly (its engine thread never runs a request); on each execution path (the
    Interpreter's caches are host arrays)."""
    from agent.profile import parse_profile
    from tests.conftest import _merge

    tmp = tmp_path_factory.mktemp("reuse")
    data = _merge(dev_profile_data, {"kv": {"prefix_max_bytes": 0}})
    profile = parse_profile(data, tmp / f"{data['name']}.toml")
    made = [
        Engine.load(
            profile,
            demo_model_dir(),
            quantization="int8",
            prefer_interpreter=request.param == "interpreter",
            limits=EngineLimits(max_active=2, max_sessions=8),
            state_dir=tmp / f"state{i}",
        )
        for i in range(2)
    ]
    yield made[0], made[1]
    for e in made:
        e.close()


def plain(ref: Engine, ids: list[int], n: int = REPLY) -> list[int]:
    """Greedy tokens for prompt `ids`: prefill all but the last from row 0 of a new cache."""
    r = ref.loaded.runner
    kv = r.new_kv()
    r.reserve(kv, len(ids) + n, 0)
    r.prefill(kv, ids[:-1], 0)
    out: list[int] = []
    token, pos = ids[-1], len(ids) - 1
    for _ in range(n):
        logits = r.decode(kv, token, pos)
        pos += 1
        token = int(np.argmax(logits[: ref.tokenizer.vocab_size]))
        if token in ref._stop_ids:
            break
        out.append(token)
    return out


def free_caches(e: Engine) -> list[tuple[object, list[int]]]:
    """The engine's free caches and the ids each claims its rows hold (the engine is idle)."""
    with e._cv:
        return [(kv, [int(t) for t in held]) for kv, held, _ in e._pool._free]


def check_rows(e: Engine, ref: Engine) -> None:
    """Every row a free cache claims to hold is the row a fresh prefill writes for it."""
    r = ref.loaded.runner
    for kv, held in free_caches(e):
        if not held:
            continue
        got = e.loaded.runner.read_rows(kv, len(held))  # type: ignore[arg-type]
        fresh = r.new_kv()
        r.reserve(fresh, len(held), 0)
        r.prefill(fresh, held, 0)
        want = r.read_rows(fresh, len(held))
        for name, rows in want.items():
            scale = max(1.0, float(np.max(np.abs(rows))))
            err = float(np.max(np.abs(got[name] - rows)))
            assert err <= 1e-3 * scale, f"{name}: row differs by {err:.3g} from a fresh prefill"


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def chat(*messages: tuple[str, str], n: int = REPLY) -> GenerateRequest:
    return GenerateRequest(
        "",
        max_tokens=n,
        sampling=GREEDY,
        messages=tuple(ChatMessage(role, text) for role, text in messages),
    )


def best_reuse(e: Engine, ids: list[int]) -> int:
    """What the pool's longest free match gives a prompt (its last token never reused)."""
    return max((lcp(held, ids[:-1]) for _, held in free_caches(e)), default=0)


def converse(
    e: Engine, ref: Engine, name: str, history: list[tuple[str, str]], line: str
) -> tuple[int, int]:
    """One stateless turn (the whole conversation resent); returns (cached, prompt) tokens."""
    history.append(("user", f"# {name}\n{line}" if not history else line))
    request = chat(*history)
    ids = e.encode_prompt(request)
    expect = best_reuse(e, ids)
    done = e.complete(request)
    assert done.finish_reason in ("stop", "length")
    assert list(done.token_ids) == plain(ref, ids), f"{name}: turn {len(history) // 2 + 1}"
    if len(history) > 1:  # its own last turn's cache is the longest match
        assert done.stats.cached_tokens == expect
    else:  # a few shared tokens (BOS, "# "): a spare cache rather than another's
        assert done.stats.cached_tokens in (0, expect)
    assert done.stats.prompt_tokens == len(ids)
    check_rows(e, ref)
    history.append(("assistant", done.text))
    return done.stats.cached_tokens, len(ids)


def test_ten_stateless_turns_reuse_the_last_turn_and_match_a_fresh_prefill(engines) -> None:
    e, ref = engines
    history: list[tuple[str, str]] = []
    cached, prev = [], 0
    for line in LINES:
        got, prompt = converse(e, ref, "ten turns", history, line)
        cached.append(got)
        if prev:  # at least the last prompt's rows, but never the prompt's last token
            assert prev - 1 <= got < prompt
        prev = prompt
    assert cached[0] == 0 and cached == sorted(cached) and cached[-1] > cached[1]


def test_two_interleaved_conversations_each_keep_reusing(engines) -> None:
    e, ref = engines
    a: list[tuple[str, str]] = []
    b: list[tuple[str, str]] = []
    last = {"a": 0, "b": 0}
    for i, line in enumerate(LINES[:5]):
        for name, history in (("a", a), ("b", b)):
            got, prompt = converse(e, ref, f"conversation {name}", history, line)
            if i:
                assert got >= last[name] - 1
            last[name] = prompt


def test_a_prompt_that_diverges_early_reuses_only_the_common_part(engines) -> None:
    e, ref = engines
    system = "".join(f"# rule {i}: be brief\n" for i in range(6))
    first = chat(("user", system + "def a():"))
    one = e.complete(first)
    assert one.stats.cached_tokens == 0 or one.stats.cached_tokens == best_reuse(e, [])
    ids = e.encode_prompt(first)
    held = next(h for _, h in free_caches(e) if h[: len(ids)] == ids)
    # the same rules, another question: the rules' rows are reused, not the old question's
    second = chat(("user", system + "def bb(x, y):"))
    ids2 = e.encode_prompt(second)
    common = lcp(held, ids2[:-1])
    assert 0 < common < len(ids) - 1
    assert best_reuse(e, ids2) == common
    two = e.complete(second)
    assert two.stats.cached_tokens == common
    assert list(two.token_ids) == plain(ref, ids2)
    check_rows(e, ref)


def test_a_cancelled_request_leaves_only_its_written_rows(engines) -> None:
    e, ref = engines
    request = chat(("user", "# cancelled\ndef parse(path):"), n=200)
    ids = e.encode_prompt(request)
    stream = e.generate(request)
    for _, event in zip(range(3), stream, strict=False):
        assert event.finish_reason is None
    stream.close()  # cancels it
    deadline = time.monotonic() + 60  # a limit: the cache comes back after the last step
    while time.monotonic() < deadline:
        if any(h[: len(ids)] == ids for _, h in free_caches(e)) and not e.stats().active:
            break
        time.sleep(0.01)
    held = next(h for _, h in free_caches(e) if h[: len(ids)] == ids)
    assert len(ids) - 1 <= len(held) < len(ids) + 200
    check_rows(e, ref)  # exactly the rows written, none past them
    again = chat(("user", "# cancelled\ndef parse(path):"))
    done = e.complete(again)
    assert done.stats.cached_tokens == len(ids) - 1
    assert list(done.token_ids) == plain(ref, ids)


def test_a_request_that_failed_in_the_runtime_leaves_nothing_to_reuse(
    engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    e, ref = engines
    request = chat(("user", "# failed\ndef parse(path):"))
    ids = e.encode_prompt(request)
    runner = e.loaded.runner
    real = runner.decode
    calls: list[int] = []

    def fails_third(*args: object) -> object:  # a step that may have half written its row
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected: decode")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "decode", fails_third)
    failed = e.complete(request)
    monkeypatch.undo()
    assert failed.finish_reason == "error" and len(calls) == 3
    # its cache went back holding nothing: none holds this prompt's rows
    assert all(lcp(held, ids) < len(ids) - 1 for _, held in free_caches(e))
    done = e.complete(request)
    assert done.finish_reason in ("stop", "length")
    assert done.stats.cached_tokens < len(ids) - 1
    assert list(done.token_ids) == plain(ref, ids)
    check_rows(e, ref)


def test_the_prefix_cache_serves_a_shared_system_prompt_once_its_free_cache_is_gone(
    make_profile, tmp_path, engines
) -> None:
    """One runtime cache: a session's turn takes it (the free cache's rows are overwritten), so
    the next prompt with the same rules starts from the prefix cache's whole blocks."""
    _, ref = engines
    demo = demo_model_dir()
    base = make_profile()
    one = estimate_memory(base, demo, "int8")
    profile = make_profile(
        runtime={"max_num_bytes": one + 8 * MIB + 16 * MIB},
        kv={"host_max_bytes": 16 * MIB, "disk_max_bytes": 0, "prefix_max_bytes": 8 * MIB},
    )
    e = Engine.load(
        profile,
        demo,
        quantization="int8",
        limits=EngineLimits(max_active=1, max_sessions=8),
        state_dir=tmp_path / "state",
    )
    try:
        assert e.memory.sessions == 1
        system = "".join(f"# rule {i}: be brief\n" for i in range(20))
        first = chat(("user", system + "def a():"))
        assert e.complete(first).stats.cached_tokens == 0
        sid = e.create_session()
        e.complete(GenerateRequest("import os", max_tokens=4, sampling=GREEDY, session_id=sid))
        second = chat(("user", system + "def b():"))
        ids = e.encode_prompt(second)
        done = e.complete(second)
        st = e.tier_stats()
        assert st.prefix_hits == 1 and st.prefix_entries >= 1
        assert done.stats.cached_tokens >= 32 and done.stats.cached_tokens % 32 == 0
        assert list(done.token_ids) == plain(ref, ids)
        check_rows(e, ref)
    finally:
        e.close()
