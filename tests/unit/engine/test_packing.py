"""Packed decode (`agent.engine.packing`) on a real tiny model with ``decode_batch_2`` and
``decode_batch_4`` signatures: running requests share batched calls, and each request's
tokens are exactly what it gets alone on the same model with packing off."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from agent.constraint.types import Constraint
from agent.engine.engine import Engine, EngineLimits
from agent.engine.sampler import SamplingParams
from agent.engine.scheduler import Scheduler
from agent.engine.types import GenerateRequest, TokenEvent
from tests.support.tiny_models import LEGACY

BATCH = (2, 4)
PROMPTS = (
    "def main():\n    return 1\n",
    "x",
    "class A:\n    def f(self, x):\n        return x + 1\n",  # several prefill chunks
    "import os\n",
    "for i in range(3):\n",
)
GREEDY = SamplingParams(temperature=0.0)

pytestmark = pytest.mark.skipif(LEGACY, reason="batched decode runs on ai-edge-litert only")


def _open(model_dir: Any, data: dict[str, Any], packed: bool) -> Engine:
    from agent.profile import parse_profile, profiles_dir

    profile = parse_profile(data, profiles_dir() / "generic-x86_64.toml")
    limits = EngineLimits(max_active=5, event_tokens=1, batch_decode=packed)
    return Engine.load(profile, model_dir, quantization="fp32", limits=limits)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Any:
    return tiny_model_factory.model_dir(
        quantizations=("fp32",), prefill_lens=(8,), kv_max=64, batch_sizes=BATCH
    )


@pytest.fixture(scope="module")
def engines(model_dir, dev_profile_data) -> Any:
    on, off = _open(model_dir, dev_profile_data, True), _open(model_dir, dev_profile_data, False)
    yield on, off
    on.close()
    off.close()


def _requests() -> list[GenerateRequest]:
    """Greedy, seeded sampling with different seeds, and a constrained one; different prompt
    lengths, so the rows sit at different positions."""
    params = [
        GREEDY,
        SamplingParams(temperature=0.9, top_k=50, seed=1),
        SamplingParams(temperature=1.1, top_p=0.9, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=3),
        GREEDY,
    ]
    reqs = [
        GenerateRequest(p, max_tokens=14 + 3 * i, sampling=s, speculation="off")
        for i, (p, s) in enumerate(zip(PROMPTS, params, strict=True))
    ]
    reqs[3] = GenerateRequest(
        PROMPTS[3],
        max_tokens=16,
        sampling=params[3],
        constraint=Constraint("regex", "(abc |def ){8}[a-z ]+"),
    )
    return reqs


class Run:
    """Requests submitted while the engine thread is held, so they start together."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.events: dict[int, list[TokenEvent]] = {}
        self.done: dict[int, threading.Event] = {}
        self.handles: dict[int, Any] = {}
        self.on_event: Callable[[int, TokenEvent], None] = lambda i, e: None

    def submit(self, i: int, request: GenerateRequest) -> None:
        self.events[i], self.done[i] = [], threading.Event()
        ready = threading.Event()

        def sink(event: TokenEvent) -> None:  # the engine thread
            ready.wait(10)
            self.events[i].append(event)
            self.handles[i].consumed()
            self.on_event(i, event)
            if event.finish_reason is not None:
                self.done[i].set()

        self.handles[i] = self.engine.submit(request, sink)
        ready.set()

    def start(self, requests: list[GenerateRequest]) -> None:
        """Hold the engine thread, submit `requests` (numbered from 0), let it go: they start
        together."""
        self.engine.inject_stall(60)
        _wait(lambda: self.engine.stalled, "the engine thread to stall")
        for i, r in enumerate(requests):
            self.submit(i, r)
        self.engine.end_stall()

    def tokens(self, i: int) -> tuple[list[int], str | None]:
        assert self.done[i].wait(60), f"request {i} did not finish"
        ids = [t for e in self.events[i] for t in e.token_ids]
        return ids, self.events[i][-1].finish_reason


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _alone(engine: Engine, reqs: list[GenerateRequest]) -> list[list[int]]:
    return [list(engine.complete(r).token_ids) for r in reqs]


def _ends(engine: Engine, reqs: list[GenerateRequest]) -> list[tuple[list[int], str | None]]:
    return [(list(c.token_ids), c.finish_reason) for c in map(engine.complete, reqs)]


def _batch_calls(engine: Engine) -> dict[int, int]:
    costs = engine.loaded.runner.costs
    return {b: costs.calls(f"decode_batch_{b}") for b in BATCH}


def test_the_model_packs_and_says_so(engines) -> None:
    on, off = engines
    assert on.info.batch_sizes == BATCH and on.info.batch_problem == ""
    assert off.info.batch_sizes == () and "turned off" in off.info.batch_problem


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_concurrent_requests_get_exactly_their_tokens_alone(engines, n: int) -> None:
    on, off = engines
    reqs = _requests()[:n]
    want = _alone(off, reqs)
    assert _alone(on, reqs) == want  # alone: never packed
    assert n < 4 or len(want[3]) >= 8, want[3]  # the constrained one decodes a while
    for engine in (on, off):
        before, steps = _batch_calls(engine), on.packing.steps
        run = Run(engine)
        run.start(reqs)
        got = [run.tokens(i)[0] for i in range(n)]
        assert got == want, engine.packing.problem
        calls = {b: _batch_calls(engine)[b] - before[b] for b in BATCH}
        if engine is off:
            assert calls == {2: 0, 4: 0}
            continue
        assert on.packing.steps > steps and calls[4 if n >= 4 else 2] > 0, calls


def test_a_request_arriving_midway_and_one_cancelled(engines) -> None:
    """Three requests decode packed; at request 0's fourth token the engine is held and a
    fourth request submitted; request 1 is cancelled at its sixth token. The cancelled one
    ends at once with a prefix of its tokens alone; every other gets its tokens alone."""
    on, off = engines
    reqs = _requests()
    reqs[1] = GenerateRequest(PROMPTS[1], max_tokens=40, sampling=reqs[1].sampling)
    want = _ends(off, reqs[:4])
    run = Run(on)
    late = threading.Event()

    def on_event(i: int, event: TokenEvent) -> None:  # the engine thread, between steps
        n = sum(len(e.token_ids) for e in run.events[i])
        if i == 0 and n == 4 and not late.is_set():
            late.set()
            on.inject_stall(60)
        if i == 1 and n == 6:
            run.handles[1].cancel()

    run.on_event = on_event
    before = on.packing.steps
    run.start(reqs[:3])
    assert late.wait(30)
    _wait(lambda: on.stalled, "the held engine thread")
    rows_before = on.packing.packed_rows
    run.submit(3, reqs[3])
    on.end_stall()
    for i in (0, 2, 3):
        assert run.tokens(i) == want[i], i
    ids, reason = run.tokens(1)
    assert reason == "cancelled" and ids == want[1][0][:6]  # not one token more
    assert on.packing.steps > before and on.packing.packed_rows > rows_before


def test_session_turns_packed_continue_as_alone(engines) -> None:
    """Three sessions take two turns each, every turn of the three submitted together (packed,
    each continuing its own KV); each turn's tokens are those of the session run alone."""
    on, off = engines
    prompts = [("x = 1\n", "y = 2\n"), ("def f(a, b):\n", "z"), ("import os", "a = [1, 2]\n")]
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=5)

    def req(prompt: str, sid: str) -> GenerateRequest:
        return GenerateRequest(prompt, max_tokens=10, sampling=sampling, session_id=sid)

    want = []
    for turns in prompts:
        sid = off.create_session()
        want.append([list(off.complete(req(p, sid)).token_ids) for p in turns])
    sids = [on.create_session() for _ in prompts]
    got: list[list[list[int]]] = [[], [], []]
    steps = on.packing.steps
    for t in range(2):
        run = Run(on)
        run.start([req(prompts[i][t], sids[i]) for i in range(3)])
        for i in range(3):
            got[i].append(run.tokens(i)[0])
    assert got == want and on.packing.steps > steps


def test_a_failed_packed_call_fails_its_requests_and_the_engine_goes_on(
    engines, monkeypatch
) -> None:
    on, _ = engines
    from tests.unit.engine.test_engine_faults import fail_next

    fired = fail_next(on, "decode_batch", monkeypatch)
    reqs = _requests()[:3]
    run = Run(on)
    run.start(reqs)
    ends = [run.tokens(i)[1] for i in range(3)]
    assert fired and ends.count("error") >= 2  # every request in the failed call
    errors = [run.events[i][-1].error for i in range(3) if ends[i] == "error"]
    assert all(e is not None and "injected: decode_batch" in e for e in errors)
    run = Run(on)
    run.start(reqs)
    assert [run.tokens(i)[0] for i in range(3)] == _alone(on, reqs)


def test_rows_crossing_kv_windows(model_dir, make_profile, tmp_path, monkeypatch) -> None:
    """KV windows 16 and 32 added at load (their batch signatures cloned): requests at
    different positions move up through the windows while packed, at different steps (so a
    call's rows can sit in different windows); each request's tokens are still those it gets
    alone."""
    from agent.model.tflite import layout as kv_layout

    monkeypatch.setattr(kv_layout, "SMALLEST_WINDOW", 16)
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    limits = EngineLimits(max_active=4, event_tokens=1)
    engine = Engine.load(profile, model_dir, quantization="fp32", limits=limits)
    try:
        runner = engine.loaded.runner
        assert [w.length for w in runner.layout.all_windows()] == [16, 32, 64]
        assert engine.info.batch_sizes == BATCH
        params = [GREEDY, *(SamplingParams(temperature=0.9, seed=k) for k in (7, 8, 9))]
        reqs = [
            GenerateRequest(p, max_tokens=36, sampling=s, speculation="off")
            for p, s in zip(PROMPTS[:4], params, strict=True)
        ]
        want = _ends(engine, reqs)
        assert max(len(t) for t, _ in want) > 20  # some cross window 32
        run = Run(engine)
        run.start(reqs)
        assert [run.tokens(i) for i in range(4)] == want
        small = sum(runner.costs.calls(f"kv{w}_decode_batch_{b}") for w in (16, 32) for b in BATCH)
        assert small > 0 and engine.packing.steps > 0
    finally:
        engine.close()


def test_a_model_without_batch_signatures_serves_unpacked(tiny_model_dir, dev_profile_data):
    engine = _open(tiny_model_dir, dev_profile_data, True)
    try:
        assert engine.info.batch_sizes == () and engine.packing.rows == 1
        assert engine.info.batch_problem == "the file has no batch signatures"
        reqs = _requests()[:3]
        run = Run(engine)
        run.start(reqs)
        assert [run.tokens(i)[0] for i in range(3)] == _alone(engine, reqs)
        assert engine.packing.steps == 0
    finally:
        engine.close()


def test_follow_takes_the_next_turns_that_join() -> None:
    """The scheduler's part, pure policy: the requests after the current one in round-robin
    order join until one does not; one whose consumer lags is passed over; the turn moves past
    those that joined, so a packed step is a turn for each of them."""
    s: Scheduler[str] = Scheduler(8, 8)
    for x in "abcdef":
        s.submit(x)
    s.admit()
    everyone: Callable[[str], bool] = lambda x: True  # noqa: E731
    assert s.next(everyone) == "a"
    assert s.follow(everyone, lambda x: x != "d", limit=3) == ["b", "c"]
    assert s.next(everyone) == "d"  # its turn comes next, as before
    assert s.follow(lambda x: x != "e", everyone, limit=2) == ["f", "a"]  # e lags: passed over
    assert s.next(everyone) == "b"
    assert s.follow(everyone, everyone, limit=10) == ["c", "d", "e", "f", "a"]  # never itself
    assert s.next(everyone) == "b"
