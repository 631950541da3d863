"""The engine on a real tiny model directory: determinism, stops, limits, cancellation."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.base.errors import (
    ContextOverflow,
    InvalidRequest,
    ModelFormatError,
    NotFound,
    SessionBusy,
)
from agent.engine.engine import Engine
from agent.engine.generation import StopMatcher
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from tests.support.tiny_models import LEGACY

PROMPT = "def main():\n    return 1\n"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, dev_profile_data) -> Engine:
    from agent.profile import parse_profile, profiles_dir

    profile = parse_profile(dev_profile_data, profiles_dir() / "generic-x86_64.toml")
    return Engine.load(profile, tiny_model_dir, quantization="fp32")


def req(**kw) -> GenerateRequest:
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("sampling", SamplingParams(temperature=0.9, top_k=50, seed=11))
    return GenerateRequest(**kw)


def test_same_seed_same_tokens(engine: Engine) -> None:
    a = engine.complete(req())
    b = engine.complete(req())
    c = engine.complete(req(sampling=SamplingParams(temperature=0.9, top_k=50, seed=12)))
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids
    assert a.finish_reason == "length" and len(a.token_ids) == 12


def test_greedy_matches_a_plain_decode_loop(engine: Engine) -> None:
    got = engine.complete(req(sampling=SamplingParams(temperature=0.0), max_tokens=8))
    runner = engine.loaded.runner
    ids = [engine.meta.bos_id, *engine.tokenizer.encode(PROMPT)]
    kv = runner.new_kv()
    for pos, t in enumerate(ids[:-1]):
        runner.decode(kv, t, pos)
    token, pos, want = ids[-1], len(ids) - 1, []
    while len(want) < 8:
        token = int(np.argmax(runner.decode(kv, token, pos)))
        pos += 1
        if token in engine._stop_ids:
            break
        want.append(token)
    assert list(got.token_ids) == want


def test_stream_concatenates_to_the_decoded_text(engine: Engine) -> None:
    c = engine.complete(req(max_tokens=20))
    assert c.text == engine.tokenizer.decode(c.token_ids)
    assert sum(len(e.token_ids) for e in c.events) == len(c.token_ids)
    s = c.stats
    assert s.prompt_tokens == 1 + len(engine.tokenizer.encode(PROMPT))
    assert s.generated_tokens == 20
    assert s.ttft_ms > 0 and s.decode_tok_s > 0 and s.prefill_tok_s > 0
    assert s.accelerator == "xnnpack"


def test_stop_sequence_cuts_the_text(engine: Engine) -> None:
    full = engine.complete(req(max_tokens=30))
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = engine.complete(req(max_tokens=30, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text


def test_cancel_stops_within_one_token(engine: Engine) -> None:
    got: list = []
    handles: list = []

    seen: list[int] = []

    def sink(event) -> None:  # runs on the engine thread, between two steps
        got.append(event)
        if len(got) == 3:  # events batch tokens: count what this one had seen
            seen.append(sum(len(e.token_ids) for e in got))
            handles[0].cancel()

    handles.append(engine.submit(req(max_tokens=50), sink))
    assert handles[0].done.wait(30)
    assert got[-1].finish_reason == "cancelled"
    assert sum(len(e.token_ids) for e in got) == seen[0] < 50


def test_closing_a_stream_frees_the_engine(engine: Engine) -> None:
    stream = engine.generate(req(max_tokens=50))
    next(stream)
    stream.close()
    assert engine.complete(req(max_tokens=2)).finish_reason == "length"
    deadline = time.monotonic() + 60  # a limit: the slot frees as the stream's end is seen
    while engine.stats().active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().active == 0


def test_long_prompt_is_prefilled_in_chunks(engine: Engine) -> None:
    # longer than the largest prefill signature (32), shorter than the context (128)
    long_prompt = "x = 1\n"
    while len(engine.tokenizer.encode(long_prompt)) < 60:
        long_prompt += "x = 1\n"
    ids = engine.encode_prompt(GenerateRequest(prompt=long_prompt))
    assert 32 < len(ids) < engine.info.context_length
    greedy = SamplingParams(temperature=0.0)
    c = engine.complete(req(prompt=long_prompt, sampling=greedy, max_tokens=4))
    runner = engine.loaded.runner
    kv = runner.new_kv()
    for pos, t in enumerate(ids[:-1]):
        runner.decode(kv, t, pos)
    first = int(np.argmax(runner.decode(kv, ids[-1], len(ids) - 1)))
    assert c.token_ids[0] == first


def test_generation_stops_at_the_context_end(engine: Engine) -> None:
    ctx = engine.info.context_length
    prompt = "x = 1\n"
    while len(engine.tokenizer.encode(prompt + "x = 1\n")) < ctx - 10:
        prompt += "x = 1\n"
    n = len(engine.encode_prompt(GenerateRequest(prompt=prompt)))
    # an explicit max_tokens beyond the context is refused; the profile's default runs to its end
    with pytest.raises(ContextOverflow, match=f"max_tokens \\(10000\\) = {n + 10_000} tokens"):
        engine.complete(req(prompt=prompt, max_tokens=10_000))
    assert engine.profile.generation.max_tokens > ctx
    c = engine.complete(req(prompt=prompt, max_tokens=None, sampling=SamplingParams(seed=5)))
    assert c.stats.prompt_tokens == n
    # the last cache row holds the input of the last decode step, whose output (never fed
    # back) is the last generated token: n + generated == ctx + 1
    if c.finish_reason == "length":
        assert n + c.stats.generated_tokens == ctx + 1
    else:  # the random model may emit its eos first
        assert c.finish_reason == "stop" and n + c.stats.generated_tokens <= ctx


@pytest.mark.parametrize(
    ("request_", "error", "fragment"),
    [
        (GenerateRequest(prompt=""), InvalidRequest, "prompt is empty"),
        (GenerateRequest(prompt="x", max_tokens=0), InvalidRequest, "max_tokens = 0"),
        (
            GenerateRequest(prompt="x", sampling=SamplingParams(top_p=2.0)),
            InvalidRequest,
            "top_p = 2.0",
        ),
    ],
)
def test_bad_requests(engine: Engine, request_, error, fragment) -> None:
    with pytest.raises(error, match=fragment):
        engine.complete(request_)


def test_prompt_longer_than_context_names_both_numbers(engine: Engine) -> None:
    prompt = "".join(chr(ord("a") + i % 26) + " " for i in range(400))
    n = 1 + len(engine.tokenizer.encode(prompt))
    with pytest.raises(ContextOverflow) as err:
        engine.complete(req(prompt=prompt))
    assert f"prompt is {n} tokens" in str(err.value)
    assert f"context holds {engine.info.context_length}" in str(err.value)


def test_tampered_model_file_is_refused(tiny_model_dir, tmp_path, dev_profile) -> None:
    import shutil

    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    quant = "int8_weight_only" if LEGACY else "int8"
    f = d / f"model_{quant}.tflite"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="sha256"):
        Engine.load(dev_profile, d, quantization=quant)


def test_profile_picks_int8_for_a_4gib_budget(tiny_model_dir, dev_profile) -> None:
    e = Engine.load(dev_profile, tiny_model_dir)
    # the legacy backend's int8 is the weight-only variant (docs/PROFILES.md)
    assert e.info.quantization == ("int8_weight_only" if LEGACY else "int8")
    assert e.complete(req(max_tokens=3)).finish_reason in ("length", "stop")


@given(st.text(max_size=40), st.lists(st.integers(1, 8), max_size=12))
def test_stop_matcher_is_independent_of_how_text_is_split(text, cuts) -> None:
    stops = ("\n\n", "END", "ab")
    whole, stopped_whole = StopMatcher(stops).feed(text)
    m = StopMatcher(stops)
    out, stopped, i = [], False, 0
    pieces = []
    for c in cuts:
        pieces.append(text[i : i + c])
        i += c
    pieces.append(text[i:])
    for p in pieces:
        t, stopped = m.feed(p)
        out.append(t)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    if not stopped_whole:
        whole += StopMatcher(stops).feed("")[0]  # nothing pending in a fresh matcher
        whole = text
    assert "".join(out) == whole
    assert stopped == stopped_whole


# ----------------------------------------------------------------------------- sessions


def _greedy_continue(engine: Engine, tokens: list[int], n: int) -> list[int]:
    """Reference: decode the whole conversation token by token on a fresh cache."""
    runner = engine.loaded.runner
    kv = runner.new_kv()
    for pos, t in enumerate(tokens[:-1]):
        runner.decode(kv, t, pos)
    token, pos, out = tokens[-1], len(tokens) - 1, []
    while len(out) < n:
        token = int(np.argmax(runner.decode(kv, token, pos)))
        pos += 1
        if token in engine._stop_ids:
            break
        out.append(token)
    return out


def test_a_session_turn_continues_exactly_as_a_full_reprefill(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0.0)
    sid = engine.create_session()
    first = engine.complete(req(prompt="def f(x):", sampling=greedy, max_tokens=6, session_id=sid))
    second = engine.complete(req(prompt="\n\nclass", sampling=greedy, max_tokens=6, session_id=sid))
    history = engine.session_tokens(sid)
    turn1 = [engine.meta.bos_id, *engine.tokenizer.encode("def f(x):")]
    assert history[: len(turn1)] == turn1
    assert list(first.token_ids) == _greedy_continue(engine, turn1, 6)
    before_second = [*turn1, *first.token_ids, *engine.tokenizer.encode("\n\nclass")]
    assert list(second.token_ids) == _greedy_continue(engine, before_second, 6)
    assert history == [*before_second, *second.token_ids]
    # only the new turn went through prefill: its prompt count is the turn, not the history
    assert second.stats.prompt_tokens == len(before_second) - len(turn1) - len(first.token_ids) + 1
    engine.delete_session(sid)
    with pytest.raises(NotFound):
        engine.complete(req(session_id=sid))


def test_interleaved_sessions_match_sessions_run_alone(engine: Engine) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=3)

    def turns(sid: str) -> list[tuple[int, ...]]:
        return [
            engine.complete(
                req(prompt=p, sampling=sampling, max_tokens=5, session_id=sid)
            ).token_ids
            for p in ("x = 1\n", "y = 2\n")
        ]

    alone = turns(engine.create_session())
    a, b = engine.create_session(), engine.create_session()
    got_a, got_b = [], []
    for p in ("x = 1\n", "y = 2\n"):
        got_a.append(
            engine.complete(req(prompt=p, sampling=sampling, max_tokens=5, session_id=a)).token_ids
        )
        got_b.append(
            engine.complete(req(prompt=p, sampling=sampling, max_tokens=5, session_id=b)).token_ids
        )
    assert got_a == alone and got_b == alone


def test_session_busy_and_context_overflow(engine: Engine) -> None:
    sid = engine.create_session()
    held = engine.submit(req(max_tokens=100, session_id=sid), lambda e: None)
    with pytest.raises(SessionBusy):
        engine.submit(req(session_id=sid), lambda e: None)
    held.cancel()
    assert held.done.wait(10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            engine.complete(req(prompt="x", max_tokens=1, session_id=sid))
            break
        except SessionBusy:
            time.sleep(0.01)
    long = "a b c d e f g h " * 20
    with pytest.raises(ContextOverflow, match="context holds 128"):
        for _ in range(10):
            engine.complete(req(prompt=long, max_tokens=1, session_id=sid))
    engine.delete_session(sid)
