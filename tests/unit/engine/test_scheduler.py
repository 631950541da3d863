"""Scheduling: the pure policy, then fairness and limits on the real engine thread."""

from __future__ import annotations

import threading
import time

import pytest

from agent.base.errors import Overloaded, Unavailable
from agent.engine.engine import Engine, EngineLimits
from agent.engine.sampler import SamplingParams
from agent.engine.scheduler import Scheduler
from agent.engine.types import GenerateRequest


def test_round_robin_with_fifo_admission() -> None:
    s: Scheduler[str] = Scheduler(max_running=2, queue_capacity=3)
    for x in "abc":
        s.submit(x)
    assert s.admit() == ["a", "b"]
    order = [s.next(lambda _: True) for _ in range(5)]
    assert order == ["a", "b", "a", "b", "a"]
    s.finish("a")
    assert s.admit() == ["c"]
    assert [s.next(lambda _: True) for _ in range(4)] == ["b", "c", "b", "c"]
    assert s.next(lambda x: x == "c") == "c"
    assert s.next(lambda _: False) is None


def test_finish_keeps_the_turn_order() -> None:
    s: Scheduler[int] = Scheduler(max_running=4, queue_capacity=4)
    for i in range(4):
        s.submit(i)
    s.admit()
    assert s.next(lambda _: True) == 0
    assert s.next(lambda _: True) == 1
    s.finish(0)  # before the cursor: 2 is still next
    assert s.next(lambda _: True) == 2
    s.finish(3)  # after the cursor, at the end: wraps to 1
    assert s.next(lambda _: True) == 1


def test_full_queue_is_refused_with_the_numbers() -> None:
    s: Scheduler[int] = Scheduler(max_running=1, queue_capacity=2)
    s.submit(1)
    s.submit(2)
    with pytest.raises(Overloaded, match=r"queue is full \(2 waiting, 0 running\)"):
        s.submit(3)
    assert s.drop_waiting(lambda x: x != 1) == [1]
    s.submit(3)


# ----------------------------------------------------------------------------- real engine


@pytest.fixture
def engine_factory(tiny_model_dir, make_profile):
    made: list[Engine] = []

    def make(limits: EngineLimits, **profile_over) -> Engine:
        e = Engine.load(
            make_profile(**profile_over), tiny_model_dir, quantization="fp32", limits=limits
        )
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _req(prompt: str = "def f():", n: int = 20, seed: int = 1) -> GenerateRequest:
    return GenerateRequest(prompt, max_tokens=n, sampling=SamplingParams(0.9, 40, 1.0, seed))


def test_concurrent_requests_take_turns_token_by_token(engine_factory) -> None:
    # an event per token: the turns show in the order of the events
    engine = engine_factory(EngineLimits(max_active=3, queue_capacity=4, event_tokens=1))
    order: list[str] = []
    lock = threading.Lock()
    handles = []
    a_runs, all_in = threading.Event(), threading.Event()

    for name in "abc":

        def sink(event, name=name) -> None:
            with lock:
                order.append(name.upper() if event.finish_reason else name)
            if name == "a":  # a's first event holds the engine thread until b and c are in
                a_runs.set()
                assert all_in.wait(60)

        handles.append(engine.submit(_req(n=30, seed=ord(name)), sink))
        if name == "a":
            assert a_runs.wait(60)
    all_in.set()
    for h in handles:
        assert h.done.wait(60)
    # while all three run (from the last one's first token up to the first finish), every 3
    # consecutive turns are 3 requests
    first_done = min(i for i, n in enumerate(order) if n.isupper())
    window = order[max(order.index(n) for n in "abc") : first_done]
    assert len(window) >= 6, order
    for i in range(len(window) - 2):
        assert len(set(window[i : i + 3])) == 3, order


def test_long_prompt_prefill_interleaves_with_decode(engine_factory, tiny_model_dir) -> None:
    engine = engine_factory(
        EngineLimits(max_active=2, event_tokens=1), generation={"prefill_chunk": 16}
    )
    long_prompt = "x = 1\n"
    while len(engine.tokenizer.encode(long_prompt)) < 100:
        long_prompt += "y = x + 2\n"
    events: list[tuple[str, float]] = []
    lock = threading.Lock()

    def sink_for(name: str):
        def sink(event) -> None:
            with lock:
                events.append((name, time.perf_counter()))

        return sink

    a_runs, b_in = threading.Event(), threading.Event()
    sink_a = sink_for("a")

    def first_a_waits_for_b(event) -> None:  # a's first event holds the engine thread
        sink_a(event)
        a_runs.set()
        assert b_in.wait(60)

    a = engine.submit(_req(n=60), first_a_waits_for_b)
    assert a_runs.wait(60)  # a decodes: b arrives with a's 59 other tokens still to come
    b = engine.submit(_req(long_prompt, n=2), sink_for("b"))
    b_in.set()
    assert a.done.wait(60) and b.done.wait(60)
    names = [n for n, _ in events]
    first_b = names.index("b")
    after_submit = names[names.index("a") : first_b]
    # ~100 prompt tokens in chunks of 16 are >= 6 prefill steps, each followed by a turn of a
    assert after_submit.count("a") >= 6


def test_queue_full_is_refused_and_counted(engine_factory) -> None:
    engine = engine_factory(EngineLimits(max_active=1, queue_capacity=1, max_pending_events=2))
    held = []
    # a consumer that never reads: the running request pauses after 2 events, keeps its slot
    held.append(engine.submit(_req(n=100), lambda e: None))
    deadline = time.monotonic() + 60
    while engine.stats().active < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().active == 1
    held.append(engine.submit(_req(n=5), lambda e: None))  # waits in the queue
    with pytest.raises(Overloaded, match="queue is full"):
        engine.submit(_req(n=5), lambda e: None)
    s = engine.stats()
    assert (s.active, s.queue_depth, s.requests_rejected) == (1, 1, 1)
    for h in held:
        h.cancel()
    for h in held:
        assert h.done.wait(10)
    assert engine.stats().requests_cancelled == 2


def test_a_slow_consumer_does_not_stall_others(engine_factory) -> None:
    engine = engine_factory(EngineLimits(max_active=2, max_pending_events=2))
    stuck = engine.submit(_req(n=100), lambda e: None)  # never consumed
    done = engine.complete(_req(n=30))
    assert done.finish_reason == "length" and len(done.token_ids) == 30
    stuck.cancel()
    assert stuck.done.wait(10)


def test_deadline_ends_the_request(engine_factory) -> None:
    engine = engine_factory(EngineLimits(max_active=1, max_pending_events=1))
    got = []
    h = engine.submit(_req(n=100), got.append, timeout=0.2)  # never consumed: it stalls
    assert h.done.wait(10)
    assert got[-1].finish_reason == "cancelled" and got[-1].error == "deadline exceeded"


def test_stop_drains_then_refuses(engine_factory) -> None:
    engine = engine_factory(EngineLimits(max_active=2))
    got: list = []
    h = engine.submit(_req(n=20), got.append)
    assert engine.stop(drain_timeout=30) is True
    assert h.done.is_set() and got[-1].finish_reason == "length"
    with pytest.raises(Unavailable):
        engine.submit(_req(), got.append)


@pytest.mark.parametrize(
    ("strategy", "preallocate", "expected"),
    [("kSameAsRequested", False, 3), ("kNextPowerOfTwo", False, 4), ("kSameAsRequested", True, 12)],
)
def test_kv_pool_grows_as_the_profile_says(engine_factory, strategy, preallocate, expected) -> None:
    engine = engine_factory(
        EngineLimits(max_active=4, max_pending_events=1, max_sessions=8),
        runtime={"arena_extend_strategy": strategy},
        kv={"preallocate": preallocate},
    )
    assert engine.kv_pool_size() == (12 if preallocate else 0)
    held = [engine.submit(_req(n=100, seed=i), lambda e: None) for i in range(3)]
    deadline = time.monotonic() + 60
    while engine.stats().active < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.kv_pool_size() == expected
    for h in held:
        h.cancel()
    for h in held:
        assert h.done.wait(10)
