"""Tokens batched into events: the handle's rule on a fake clock, then the engine on a real
tiny model, batched against an event per token."""

from __future__ import annotations

import threading

import pytest

from agent.engine.engine import Engine, EngineLimits
from agent.engine.request import RequestHandle
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest, TokenEvent

PROMPT = "def main():\n    return 1\n"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def handle(tokens: int, interval: float, clock: Clock) -> tuple[RequestHandle, list[TokenEvent]]:
    got: list[TokenEvent] = []
    h = RequestHandle(
        "r", got.append, 1 << 30, event_tokens=tokens, event_interval_s=interval, clock=clock
    )
    return h, got


def test_the_first_token_goes_out_at_once_then_tokens_wait_for_the_batch() -> None:
    clock = Clock()
    h, got = handle(3, 1.0, clock)
    assert h.emit(TokenEvent("a", (1,))) is True  # the first: at once
    assert [e.token_ids for e in got] == [(1,)]
    assert h.emit(TokenEvent("b", (2,))) is False
    assert h.emit(TokenEvent("", (3,))) is False  # half a character: ids, no text
    assert h.emit(TokenEvent("cd", (4,))) is True  # the third waiting token: out together
    assert got[1] == TokenEvent("bcd", (2, 3, 4))
    assert h.emit(TokenEvent("e", (5,))) is False
    final = TokenEvent("f", (6,), finish_reason="length", error=None)
    assert h.emit(final) is True  # the end: at once, the held tokens first
    assert got[2].text == "ef" and got[2].token_ids == (5, 6)
    assert got[2].finish_reason == "length" and h.done.is_set()
    assert "".join(e.text for e in got) == "abcdef"
    assert [t for e in got for t in e.token_ids] == [1, 2, 3, 4, 5, 6]


def test_the_interval_sends_fewer_tokens_and_a_slow_model_sends_every_one() -> None:
    clock = Clock()
    h, got = handle(16, 0.010, clock)
    h.emit(TokenEvent("a", (1,)))
    clock.now = 0.004
    assert h.emit(TokenEvent("b", (2,))) is False
    clock.now = 0.011  # 11 ms after the last event went out
    assert h.emit(TokenEvent("c", (3,))) is True
    assert got[-1] == TokenEvent("bc", (2, 3))
    for i in range(4, 8):  # a token every 20 ms: each goes out on its own
        clock.now += 0.020
        assert h.emit(TokenEvent(str(i), (i,))) is True
        assert got[-1] == TokenEvent(str(i), (i,))


def test_an_end_with_nothing_held_and_one_token_per_event_pass_through_as_they_are() -> None:
    clock = Clock()
    h, got = handle(1, 1.0, clock)
    events = [TokenEvent("a", (1,)), TokenEvent("b", (2,)), TokenEvent("", finish_reason="stop")]
    for e in events:
        assert h.emit(e) is True
    assert all(a is b for a, b in zip(got, events, strict=True))
    h, got = handle(8, 1.0, clock)
    h.emit(events[0])
    end = TokenEvent("", finish_reason="cancelled", error="deadline exceeded")
    h.emit(end)
    assert got[-1] is end


# ----------------------------------------------------------------------------- the RPC's pipe


def test_the_stream_pipe_waits_for_its_interval_only_while_few_events_wait() -> None:
    """agent.api.bridge.EventPipe as gRPC sets it up, with an interval of an hour: the first
    event, `flush_at` waiting events and the last event go out at once (a pipe that waited for
    the interval would hang here until the 60 s limit); fewer wait for the interval."""
    import asyncio

    from agent.api.bridge import EventPipe

    def ev(i: int, end: str | None = None) -> TokenEvent:
        return TokenEvent(str(i), (i,), finish_reason=end)

    async def main() -> None:
        pipe = EventPipe(
            asyncio.get_running_loop(), interval_s=3600.0, flush_at=4, first_alone=True
        )
        pipe.put(ev(1))
        pipe.put(ev(2))  # the first message is the first event alone
        assert await asyncio.wait_for(pipe.take(), 60) == [ev(1)]
        pipe.put(ev(3))
        pipe.put(ev(4))  # 3 waiting: they wait for the interval
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pipe.take(), 0.05)
        pipe.put(ev(5))  # the 4th waiting: out at once
        assert await asyncio.wait_for(pipe.take(), 60) == [ev(2), ev(3), ev(4), ev(5)]
        pipe.put(ev(6))
        pipe.put(ev(7, "length"))  # the end: at once, with what waited
        assert await asyncio.wait_for(pipe.take(), 60) == [ev(6), ev(7, "length")]

    asyncio.run(main())


def test_the_http_pipe_takes_what_has_arrived_up_to_the_end_and_merges_it() -> None:
    """agent.api.bridge.EventPipe as HTTP sets it up (no interval, the first event not alone):
    everything waiting goes out at once, never past a request's end; merge_events joins the
    text and ids and keeps the last event's end, stats and error."""
    import asyncio

    from agent.api.bridge import EventPipe, merge_events

    first, second = TokenEvent("a", (1,)), TokenEvent("b", (2,))
    end = TokenEvent("c", (3,), finish_reason="cancelled", error="deadline exceeded")

    async def main() -> None:
        pipe: EventPipe[TokenEvent] = EventPipe(asyncio.get_running_loop())
        pipe.put(first)
        pipe.put(second)
        assert await asyncio.wait_for(pipe.take(), 60) == [first, second]
        pipe.put(end)
        pipe.put(first)  # never in the same batch as an end before it
        assert await asyncio.wait_for(pipe.take(), 60) == [end]

    asyncio.run(main())
    assert merge_events([first]) is first
    assert merge_events([first, second, end]) == TokenEvent(
        "abc", (1, 2, 3), finish_reason="cancelled", error="deadline exceeded"
    )


# ----------------------------------------------------------------------------- real engine


@pytest.fixture(scope="module")
def engines(tiny_model_dir, dev_profile_data):
    """The same model twice: an event per token, and 4 tokens per event with an interval no
    test reaches (so the batches fall at fixed tokens)."""
    from agent.profile import parse_profile, profiles_dir

    profile = parse_profile(dev_profile_data, profiles_dir() / "generic-x86_64.toml")
    one = Engine.load(
        profile, tiny_model_dir, quantization="fp32", limits=EngineLimits(event_tokens=1)
    )
    batched = Engine.load(
        profile,
        tiny_model_dir,
        quantization="fp32",
        limits=EngineLimits(event_tokens=4, event_interval_s=60.0),
    )
    yield one, batched
    one.close()
    batched.close()


def req(**kw) -> GenerateRequest:
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("max_tokens", 40)
    kw.setdefault("sampling", SamplingParams(0.0))
    return GenerateRequest(**kw)


PROMPTS = (PROMPT, "x = 1\n", "import os\n", "class A:\n", "# a\n", "for i in x:\n")


def long_request(engine: Engine, sampling: SamplingParams, **kw) -> GenerateRequest:
    """A request whose answer runs to at least 20 tokens (the tiny model's weights are
    random: some prompts end at once)."""
    for prompt in PROMPTS:
        r = req(prompt=prompt, sampling=sampling, **kw)
        if len(engine.complete(r).token_ids) >= 20:
            return r
    pytest.fail("no prompt runs to 20 tokens on this model")


@pytest.mark.parametrize(
    "sampling", [SamplingParams(0.0), SamplingParams(0.9, 50, 0.95, seed=5)], ids=["greedy", "seed"]
)
def test_batched_events_carry_every_token_in_order_with_the_same_text(engines, sampling) -> None:
    one, batched = engines
    r = long_request(one, sampling)
    a = one.complete(r)
    b = batched.complete(r)
    assert a.finish_reason == b.finish_reason
    assert len(a.events) in (len(a.token_ids), len(a.token_ids) + 1)  # one token each
    assert b.token_ids == a.token_ids and b.text == a.text
    sizes = [len(e.token_ids) for e in b.events]
    assert sizes[0] == 1  # the first token is not held back
    assert sizes[1:-1] == [4] * (len(sizes) - 2)  # then 4 at a time
    assert sizes[-1] <= 4 and sum(sizes) == len(a.token_ids) >= 20
    assert b.events[-1].stats is not None
    assert b.events[-1].stats.generated_tokens == len(a.token_ids)
    streamed = list(batched.generate(r))
    assert [t for e in streamed for t in e.token_ids] == list(a.token_ids)
    assert "".join(e.text for e in streamed) == a.text


def test_the_first_event_reaches_the_consumer_before_the_second_token(engines) -> None:
    _, batched = engines
    got: list[TokenEvent] = []
    first = threading.Event()
    handles: list = []

    def sink(event: TokenEvent) -> None:  # on the engine thread, between two steps
        if not got:
            gen = next(p.generation for p in batched._sched.running if p.handle is handles[0])
            got.append(event)
            assert gen is not None and len(gen.generated) == 1
            first.set()
            return
        got.append(event)

    handles.append(batched.submit(req(max_tokens=20), sink))
    assert handles[0].done.wait(30) and first.is_set()
    assert got[0].token_ids and len(got[0].token_ids) == 1 and got[0].finish_reason is None


def test_a_stop_string_across_a_batch_boundary_ends_as_without_batches(engines) -> None:
    one, batched = engines
    r = long_request(one, SamplingParams(0.0), max_tokens=60)
    plain = one.complete(r)
    deltas = [e.text for e in plain.events]
    # batches end after tokens 1, 5, 9, ...: a stop string made of the last character before
    # such a boundary and the first after it, found first there
    stop = None
    for k in range(5, len(deltas) - 1, 4):
        if deltas[k - 1] and deltas[k]:
            cand = deltas[k - 1][-1] + deltas[k][0]
            before = "".join(deltas[:k])
            if plain.text.find(cand) == len(before) - 1:
                stop = cand
                break
    if stop is None:
        pytest.fail(f"no stop string across a boundary in {deltas!r}: pick another prompt")
    a = one.complete(req(prompt=r.prompt, max_tokens=60, stop=(stop,)))
    b = batched.complete(req(prompt=r.prompt, max_tokens=60, stop=(stop,)))
    assert a.finish_reason == b.finish_reason == "stop"
    assert b.text == a.text == plain.text[: plain.text.find(stop)]
    assert b.token_ids == a.token_ids == plain.token_ids[: len(a.token_ids)]


def test_a_request_submitted_while_another_decodes_alone_starts_at_once(engines) -> None:
    """The loop decodes a lone request until an event goes out, then looks for others: a
    request submitted meanwhile does not wait for the first one's end. The long request's
    consumer holds the engine thread at its first event until the short one is in, so the
    short one always arrives with 19 or more of the long one's tokens still to come; then
    the round-robin ends the 3-token one first (a loop that ran the long one to its end would
    not)."""
    _, batched = engines
    ends: list[str] = []
    started, submitted = threading.Event(), threading.Event()

    def hold_first(event: TokenEvent) -> None:  # on the engine thread
        if not started.is_set():
            started.set()
            assert submitted.wait(60)
        if event.finish_reason:
            ends.append("long")

    long = batched.submit(long_request(batched, SamplingParams(0.0), max_tokens=100), hold_first)
    long.consumed(1 << 30)
    assert started.wait(60)
    got: list[TokenEvent] = []

    def short_sink(event: TokenEvent) -> None:  # on the engine thread too: ends in order
        got.append(event)
        if event.finish_reason:
            ends.append("short")

    short = batched.submit(req(max_tokens=3), short_sink)
    short.consumed(1 << 30)
    submitted.set()
    assert short.done.wait(60)
    assert got[-1].finish_reason == "length"
    assert long.done.wait(60)
    assert ends == ["short", "long"]
