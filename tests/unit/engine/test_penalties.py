"""Logit bias and repetition penalties (`agent.engine.penalties`): the formulas against a
reference written here, their order (before the grammar's mask: no bias lets a forbidden token
through), speculation on and off giving the same tokens (a scripted fake over many cases, then
a real tiny model with verify signatures), the greedy tokens of a real model against a numpy
re-implementation fed with the runner's raw logits, and both APIs on a real daemon: the fields
change the output, and bad values are 400 / INVALID_ARGUMENT naming the field and its range.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.base.errors import InvalidRequest
from agent.engine.penalties import Penalties
from agent.engine.sampler import Sampler, SamplingParams
from tests.support.daemon_harness import Daemon
from tests.support.paths import ROOT
from tests.unit.engine.test_speculation import VERIFY, NoRepeat, open_engine, run_fake, same

# ---------------------------------------------------------------------- the reference


def reference_logits(
    raw: np.ndarray,
    params: SamplingParams,
    context: Sequence[int],
    generated: Sequence[int],
) -> np.ndarray:
    """docs/API.md's definition, one token at a time in float32: bias, then the repetition
    penalty over the distinct tokens of the last `repeat_last_n` of context + generated, then
    presence and frequency over the generated tokens only."""
    out = raw.astype(np.float32).copy()
    for t, b in params.logit_bias:
        out[t] = out[t] + np.float32(b)
    n = params.repeat_last_n
    seen = [*context, *generated]
    window = [] if n == 0 else seen if n < 0 else seen[-n:]
    p = np.float32(params.repetition_penalty)
    for t in set(window):
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    for t, c in Counter(generated).items():
        out[t] = out[t] - (
            np.float32(params.frequency_penalty) * np.float32(c)
            + np.float32(params.presence_penalty)
        )
    return out


# ---------------------------------------------------------------------- pure sampler


def test_bias_bans_and_forces() -> None:
    logits = np.array([0.0, 3.0, 2.5, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams())(logits) == 1
    assert Sampler(SamplingParams(logit_bias=((1, -100.0),)))(logits) == 2
    forced = Sampler(SamplingParams(temperature=1.0, seed=1, logit_bias=((3, 100.0),)))
    assert {forced(logits) for _ in range(50)} == {3}
    # additive, as OpenAI's: a small bias only shifts
    assert Sampler(SamplingParams(logit_bias=((2, 0.6),)))(logits) == 2
    assert Sampler(SamplingParams(logit_bias=((2, 0.4),)))(logits) == 1


def test_the_runners_array_is_never_written() -> None:
    logits = np.array([0.0, 3.0, 2.5, -1.0], dtype=np.float32)
    before = logits.copy()
    s = Sampler(SamplingParams(logit_bias=((1, -100.0),), frequency_penalty=2.0))
    s(logits)
    s(logits)
    assert np.array_equal(logits, before)


def test_penalties_examples() -> None:
    raw = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    # presence and frequency: the generated counts only (token 0 twice, token 1 once)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    pen = Penalties(p, context=[2, 2, 2])
    for t in (0, 1, 0):
        pen.accept(t)
    assert pen.apply(raw).tolist() == [2.0 - 0.5 - 0.5, -2.0 - 0.5 - 0.25, 1.0, 0.5]
    # repetition: positive divided, negative multiplied, once per distinct token in the window
    p = SamplingParams(repetition_penalty=2.0, repeat_last_n=3)
    pen = Penalties(p, context=[3, 0, 1, 1])  # the window: 0, 1, 1
    assert pen.apply(raw).tolist() == [1.0, -4.0, 1.0, 0.5]
    pen.accept(2)  # the window slides: 1, 1, 2
    assert pen.apply(raw).tolist() == [2.0, -4.0, 0.5, 0.5]
    assert Penalties(SamplingParams(repetition_penalty=2.0, repeat_last_n=-1), [3, 0]).apply(
        raw
    ).tolist() == [1.0, -2.0, 1.0, 0.25]
    # off: nothing to do, nothing made
    assert Penalties.of(SamplingParams(repetition_penalty=2.0, repeat_last_n=0)) is None
    assert Penalties.of(SamplingParams()) is None


params_strategy = st.builds(
    SamplingParams,
    logit_bias=st.dictionaries(st.integers(0, 11), st.floats(-100, 100), max_size=4).map(
        lambda d: tuple(sorted(d.items()))
    ),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.7, 2.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8, 3.0]),
    repeat_last_n=st.sampled_from([0, 1, 3, 64, -1]),
)


@settings(max_examples=200, deadline=None)
@given(
    params=params_strategy,
    context=st.lists(st.integers(0, 11), max_size=10),
    steps=st.lists(
        st.lists(st.floats(-8, 8, width=32), min_size=12, max_size=12), min_size=1, max_size=12
    ),
)
def test_greedy_follows_the_reference(
    params: SamplingParams, context: list[int], steps: list[list[float]]
) -> None:
    """Every position: the sampler's greedy token is the argmax of the reference's logits,
    the adjusted logits equal it exactly, and the counts advance on the chosen tokens."""
    sampler = Sampler(params, context)
    pen = Penalties(params, context)
    generated: list[int] = []
    for row in steps:
        raw = np.array(row, dtype=np.float32)
        want = reference_logits(raw, params, context, generated)
        assert np.array_equal(pen.apply(raw), want)
        token = sampler(raw)
        assert token == int(np.argmax(want))
        pen.accept(token)
        generated.append(token)


def test_bias_never_lets_a_forbidden_token_through() -> None:
    """The grammar's mask comes after the bias: +100 on the token it forbids still loses to
    any allowed token, greedy and sampled."""
    logits = np.array([0.0, 5.0, 4.0, -3.0], dtype=np.float32)
    for temperature in (0.0, 1.0):
        s = Sampler(
            SamplingParams(
                temperature=temperature,
                seed=2,
                constraint=NoRepeat(),  # a token may not follow itself
                logit_bias=((3, 100.0),),
            )
        )
        out = [s(logits) for _ in range(40)]
        assert all(a != b for a, b in itertools.pairwise(out))
        assert out.count(3) == 20  # 3 whenever the grammar allows it, never twice in a row


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (
            SamplingParams(logit_bias=((12, 1.0),)),
            "logit_bias: token id 12 is out of range [0, 12)",
        ),
        (SamplingParams(logit_bias=((-1, 1.0),)), "token id -1 is out of range"),
        (
            SamplingParams(logit_bias=((1, 100.5),)),
            "logit_bias[1] = 100.5 is out of range [-100, 100]",
        ),
        (SamplingParams(logit_bias=((1, float("nan")),)), "logit_bias[1] = nan"),
        (SamplingParams(logit_bias=((1, 1.0), (1, 2.0))), "token id 1 is given twice"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty = 2.5 is out of range [-2, 2]"),
        (SamplingParams(frequency_penalty=-3.0), "frequency_penalty = -3.0 is out of range"),
        (SamplingParams(frequency_penalty=float("inf")), "frequency_penalty = inf"),
        (
            SamplingParams(repetition_penalty=0.0),
            "repetition_penalty = 0.0 is out of range (0, 10]",
        ),
        (SamplingParams(repetition_penalty=11.0), "repetition_penalty = 11.0"),
        (SamplingParams(repeat_last_n=-2), "repeat_last_n = -2 is out of range [-1,"),
    ],
)
def test_out_of_range_is_refused_by_name(params: SamplingParams, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        params.validate(12)
    assert fragment in str(info.value)


def test_in_range_passes() -> None:
    SamplingParams(
        logit_bias=((0, -100.0), (11, 100.0)),
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=10.0,
        repeat_last_n=-1,
    ).validate(12)


# ---------------------------------------------------------------------- speculation, fake


PENALIZED = (
    SamplingParams(frequency_penalty=0.6, presence_penalty=0.3),
    SamplingParams(repetition_penalty=1.8, repeat_last_n=4),
    SamplingParams(logit_bias=((2, 1.5), (5, -100.0)), frequency_penalty=-0.4),
)


def test_fake_penalties_change_the_output_and_drafts_still_hold() -> None:
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = run_fake(prompt, speculate=False)
    for params in PENALIZED:
        off = run_fake(prompt, speculate=False, sampling=params)
        on = run_fake(prompt, speculate=True, sampling=params)
        same(off, on)
        assert off.tokens != plain.tokens
        assert on.drafted > 0
    # a negative frequency penalty rewards repeating: loops the drafts catch
    looped = run_fake(prompt, speculate=True, sampling=PENALIZED[2])
    assert looped.accepted > 0


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=20),
    seed=st.integers(0, 3),
    max_tokens=st.integers(1, 50),
    stop_id=st.one_of(st.none(), st.integers(0, 5)),
    temperature=st.sampled_from([0.0, 0.8]),
    presence=st.sampled_from([0.0, 0.7, -1.5]),
    frequency=st.sampled_from([0.0, 0.4, -1.0]),
    repetition=st.sampled_from([1.0, 1.5, 0.7]),
    last_n=st.sampled_from([0, 2, 64, -1]),
    bias=st.dictionaries(
        st.integers(0, 7), st.sampled_from([-100.0, -1.0, 2.0, 100.0]), max_size=2
    ),
    lengths=st.sampled_from([(4, 8), (2,), (3, 5, 8)]),
)
def test_fake_identical_to_plain_decoding_with_penalties(  # type: ignore[no-untyped-def]
    prompt,
    seed,
    max_tokens,
    stop_id,
    temperature,
    presence,
    frequency,
    repetition,
    last_n,
    bias,
    lengths,
) -> None:
    """Each verify row sees the drafts accepted before it in the penalties' counts: the same
    tokens, text, ending and KV rows as plain decoding, greedy and seeded."""
    sampling = SamplingParams(
        temperature=temperature,
        seed=seed + 11,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        repeat_last_n=last_n,
        logit_bias=tuple(sorted(bias.items())),
    )
    kw = {
        "seed": seed,
        "context": 64,
        "max_tokens": max_tokens,
        "stop_ids": frozenset() if stop_id is None else frozenset({stop_id}),
        "sampling": sampling,
        "lengths": lengths,
    }
    same(run_fake(prompt, speculate=False, **kw), run_fake(prompt, speculate=True, **kw))


# ---------------------------------------------------------------------- a real model


@pytest.fixture
def always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculate whenever a draft exists (see tests/unit/engine/test_speculation.py)."""
    import agent.engine.speculation as speculation

    monkeypatch.setattr(speculation, "MARGIN", 0.0)


@pytest.fixture(scope="module")
def verify_dir(tiny_model_factory: Any) -> Path:
    return tiny_model_factory.model_dir(prefill_lens=(8,), kv_max=64, verify_lens=VERIFY)


@pytest.fixture(scope="module")
def engine(verify_dir: Path, dev_profile_data: dict[str, Any]) -> Iterator[Any]:
    e = open_engine(verify_dir, dev_profile_data)
    yield e
    e.close()


PROMPTS = ("abc abc abc abc abc abc abc abc", "self def return self def return self", "The user is")


def reference_greedy(engine: Any, prompt: str, params: SamplingParams, n: int) -> list[int]:
    """The greedy tokens from the runner's raw logits and `reference_logits`, without the
    engine's sampler or generation loop."""
    from agent.engine.types import GenerateRequest

    ids = engine.encode_prompt(GenerateRequest(prompt))
    runner = engine.loaded.runner
    vocab = engine.tokenizer.vocab_size
    kv = runner.new_kv()
    runner.reserve(kv, len(ids) + n, 0)
    runner.prefill(kv, ids[:-1], 0)
    token, pos, out = ids[-1], len(ids) - 1, []
    for _ in range(n):
        raw = np.array(runner.decode(kv, token, pos)[:vocab], dtype=np.float32)
        pos += 1
        token = int(np.argmax(reference_logits(raw, params, ids, out)))
        if token in engine._stop_ids:
            break
        out.append(token)
    return out


def complete(engine: Any, prompt: str, params: SamplingParams, mode: str, n: int = 24) -> Any:
    from agent.engine.types import GenerateRequest

    return engine.complete(GenerateRequest(prompt, max_tokens=n, sampling=params, speculation=mode))


REAL = (
    SamplingParams(frequency_penalty=1.0, presence_penalty=0.5),
    SamplingParams(repetition_penalty=1.5, repeat_last_n=16),
    SamplingParams(repetition_penalty=1.3, repeat_last_n=-1, presence_penalty=-0.5),
    SamplingParams(frequency_penalty=-0.5, logit_bias=((7, 3.0), (40, -100.0))),
    # small enough that the tiny model still loops: many drafts hold, and the counts decide
    SamplingParams(frequency_penalty=0.05),
    SamplingParams(frequency_penalty=-0.2),
)


def test_real_greedy_equals_the_reference_and_speculation(engine: Any, always: None) -> None:
    """On a real model: greedy with penalties is the numpy reference's sequence from the raw
    logits, with speculation off and on; the penalties change the output; drafts were checked
    and some held (so rows after the first were sampled with accepted drafts counted)."""
    changed = accepted = calls = 0
    for prompt in PROMPTS:
        plain = complete(engine, prompt, SamplingParams(), "off")
        for params in REAL:
            want = reference_greedy(engine, prompt, params, 24)
            off = complete(engine, prompt, params, "off")
            on = complete(engine, prompt, params, "ngram")
            assert list(off.token_ids) == want, (prompt, params)
            assert on.token_ids == off.token_ids and on.text == off.text
            assert on.finish_reason == off.finish_reason
            changed += off.token_ids != plain.token_ids
            accepted += on.stats.accepted_tokens
            calls += on.stats.verify_calls
    assert changed >= len(PROMPTS) * len(REAL) - 2  # the fields do something
    assert calls > 0 and accepted > 0, (calls, accepted)


def test_real_seeded_sampling_identical_with_speculation(engine: Any, always: None) -> None:
    drafted = 0
    for seed in (1, 2):
        for params in REAL:
            p = SamplingParams(
                temperature=0.8,
                top_k=40,
                seed=seed,
                logit_bias=params.logit_bias,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty,
                repeat_last_n=params.repeat_last_n,
            )
            off = complete(engine, PROMPTS[0], p, "off")
            on = complete(engine, PROMPTS[0], p, "ngram")
            assert on.token_ids == off.token_ids and on.text == off.text
            drafted += on.stats.drafted_tokens
    assert drafted > 0


def test_real_constrained_bias_stays_in_the_grammar(engine: Any, always: None) -> None:
    """+100 on a token the regex never allows changes nothing; -100 on the grammar's own greedy
    choice changes the answer, which still matches; speculation on and off agree."""
    import re

    from agent.constraint.types import Constraint
    from agent.engine.types import GenerateRequest

    pattern = "(abc |def )+"
    constraint = Constraint("regex", pattern)

    def run(params: SamplingParams, mode: str = "off") -> Any:
        return engine.complete(
            GenerateRequest(
                PROMPTS[0], max_tokens=12, sampling=params, constraint=constraint, speculation=mode
            )
        )

    def valid(c: Any) -> bool:
        """The whole language, or (cut by max_tokens) a prefix of a sentence in it."""
        if re.fullmatch(pattern, c.text):
            return True
        cut = len(c.text) - len(c.text) % 4
        return (
            c.finish_reason == "length"
            and re.fullmatch("(abc |def )*", c.text[:cut]) is not None
            and any(w.startswith(c.text[cut:]) for w in ("abc ", "def "))
        )

    base = run(SamplingParams())
    assert valid(base), base.text
    outside = engine.tokenizer.encode("Z")[-1]
    biased = run(SamplingParams(logit_bias=((outside, 100.0),)))
    assert biased.token_ids == base.token_ids
    first = base.token_ids[0]
    banned = SamplingParams(logit_bias=((first, -100.0),), frequency_penalty=0.5)
    off, on = run(banned), run(banned, "ngram")
    assert on.token_ids == off.token_ids
    assert off.token_ids[0] != first
    assert valid(off), off.text


def test_session_turn_counts_its_conversation(engine: Any) -> None:
    """repetition_penalty's window covers a session's earlier turns: a turn gives what the
    same conversation sent whole gives."""
    from agent.engine.types import GenerateRequest

    params = SamplingParams(repetition_penalty=1.6, repeat_last_n=-1)
    sid = engine.create_session()
    first = engine.complete(
        GenerateRequest("abc abc", max_tokens=6, sampling=params, session_id=sid)
    )
    turn = engine.complete(GenerateRequest(" def", max_tokens=8, sampling=params, session_id=sid))
    tokens = engine.session_tokens(sid)
    whole_prompt = tokens[: len(tokens) - len(turn.token_ids)]
    assert first.token_ids and turn.token_ids
    # the same conversation as one stateless request, from its token ids
    vocab = engine.tokenizer.vocab_size
    runner = engine.loaded.runner
    kv = runner.new_kv()
    runner.reserve(kv, len(whole_prompt) + 8, 0)
    runner.prefill(kv, whole_prompt[:-1], 0)
    token, pos, out = whole_prompt[-1], len(whole_prompt) - 1, []
    for _ in range(len(turn.token_ids)):
        raw = np.array(runner.decode(kv, token, pos)[:vocab], dtype=np.float32)
        pos += 1
        token = int(np.argmax(reference_logits(raw, params, whole_prompt, out)))
        out.append(token)
    assert out == list(turn.token_ids)
    engine.delete_session(sid)


# ---------------------------------------------------------------------- both APIs, a daemon

CONFIG = "[watchdog]\ntick_s = 0.2\n"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("penalties"), tiny_model_dir, CONFIG)
    yield d
    assert d.stop() == 0, d.read_log()


def post(d: Daemon, body: dict[str, Any]) -> httpx.Response:
    sock = d.socket.with_name("agent-http.sock")
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as c:
        return c.post("http://localhost/v1/completions", json={"prompt": "def f(x):", **body})


def grpc_tokens(d: Daemon, **sampling: Any) -> list[int]:
    from agent.pb.edge_agent.v1 import agent_pb2 as pb

    req = pb.GenerateRequest(
        prompt="def f(x):", max_tokens=8, sampling=pb.Sampling(temperature=0.0, **sampling)
    )
    return d.client().generate(req).tokens


def test_http_and_grpc_fields_change_the_output(daemon: Daemon) -> None:
    plain = grpc_tokens(daemon)
    assert len(plain) == 8
    banned = grpc_tokens(daemon, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    forced = grpc_tokens(daemon, logit_bias={plain[3]: 100.0})
    assert forced == [plain[3]] * 8
    penalized = grpc_tokens(daemon, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(penalized)) == 8  # every repeat costs more than the tiny model's margins
    assert grpc_tokens(daemon, repetition_penalty=10.0, repeat_last_n=-1) != plain
    # HTTP: the same fields (OpenAI's string keys), the same tokens as gRPC
    text = {
        name: post(daemon, {"max_tokens": 8, "temperature": 0, **body}).json()["choices"][0]["text"]
        for name, body in (
            ("plain", {}),
            ("banned", {"logit_bias": {str(plain[0]): -100}}),
            ("penalized", {"frequency_penalty": 2, "presence_penalty": 2.0}),
            ("repeat", {"repeat_penalty": 10, "repeat_last_n": -1}),
        )
    }
    assert text["plain"] != text["banned"] and text["plain"] != text["penalized"]
    assert text["plain"] != text["repeat"]
    from agent.pb.edge_agent.v1 import agent_pb2 as pb

    req = pb.GenerateRequest(
        prompt="def f(x):",
        max_tokens=8,
        sampling=pb.Sampling(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
    )
    assert daemon.client().generate(req).text == text["penalized"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"logit_bias": {"99999": 1}}, "token id 99999 is out of range [0, 256)"),
        ({"logit_bias": {"5": 101}}, "logit_bias[5] = 101.0 is out of range [-100, 100]"),
        ({"logit_bias": {"five": 1}}, 'logit_bias key "five" is not a token id'),
        ({"logit_bias": {"-3": 1}}, 'logit_bias key "-3" is not a token id'),
        ({"logit_bias": {"5": "x"}}, "logit_bias[5] must be a number in [-100, 100]"),
        ({"logit_bias": [1, 2]}, "logit_bias must be an object"),
        ({"presence_penalty": 2.5}, "presence_penalty = 2.5 is out of range [-2, 2]"),
        ({"frequency_penalty": "high"}, "frequency_penalty must be a number"),
        ({"frequency_penalty": -2.01}, "frequency_penalty = -2.01 is out of range [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty = 0.0 is out of range (0, 10]"),
        ({"repetition_penalty": 1.1, "repeat_penalty": 1.2}, "disagree"),
        ({"repeat_last_n": -5}, "repeat_last_n = -5 is out of range [-1,"),
    ],
)
def test_http_bad_values_are_400_naming_the_field(
    daemon: Daemon, body: dict[str, Any], fragment: str
) -> None:
    r = post(daemon, {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.text
    assert post(daemon, {"max_tokens": 2}).status_code == 200  # still serving


@pytest.mark.parametrize(
    ("sampling", "fragment"),
    [
        ({"logit_bias": {256: 1.0}}, "token id 256 is out of range [0, 256)"),
        ({"logit_bias": {3: -250.0}}, "logit_bias[3] = -250.0 is out of range [-100, 100]"),
        ({"presence_penalty": float("nan")}, "presence_penalty = nan is out of range"),
        ({"frequency_penalty": 9.0}, "frequency_penalty = 9.0 is out of range [-2, 2]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty = -1.0 is out of range (0, 10]"),
        ({"repeat_last_n": -7}, "repeat_last_n = -7 is out of range"),
    ],
)
def test_grpc_bad_values_are_invalid_argument(
    daemon: Daemon, sampling: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        grpc_tokens(daemon, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details(), err.value.details()
    assert len(grpc_tokens(daemon)) == 8  # still serving


# ---------------------------------------------------------------------- the command line


def test_client_flags_reach_the_grpc_request() -> None:
    """`edge-agent client generate|chat` puts the penalty flags in `Sampling`; absent, the
    fields stay unset (the daemon's defaults: off)."""
    import argparse

    from agent.api.grpc.client import build_request
    from agent.cli.client import add_client_parser
    from agent.cli.common import penalty_fields

    parser = argparse.ArgumentParser()
    add_client_parser(parser.add_subparsers())
    flags = ["--logit-bias", "5=-100", "--logit-bias", "7=2.5", "--presence-penalty", "0.5"]
    flags += ["--frequency-penalty", "-1", "--repeat-penalty", "1.2", "--repeat-last-n", "-1"]
    for argv in (["client", "generate", "x"], ["client", "chat", "x"]):
        base = dict(max_tokens=None, temperature=None, top_k=None, top_p=None, seed=None, stop=[])
        plain = build_request("x", None, **base, **penalty_fields(parser.parse_args(argv)))  # type: ignore[arg-type]
        assert plain.sampling == type(plain.sampling)()
        req = build_request("x", None, **base, **penalty_fields(parser.parse_args([*argv, *flags])))  # type: ignore[arg-type]
        s = req.sampling
        assert dict(s.logit_bias) == {5: -100.0, 7: 2.5}
        assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.0)
        assert s.repetition_penalty == pytest.approx(1.2) and s.repeat_last_n == -1
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*argv, "--logit-bias", "five"])
        assert exit_.value.code == 2


def test_cli_generate_takes_the_flags(verify_dir: Path, tmp_path: Path) -> None:
    """In-process `edge-agent generate`: +100 forces the token; an out-of-range value is the
    engine's refusal, one line and exit 2 (a usage error), never a traceback."""
    import json
    import os
    import subprocess
    import sys

    from agent.profile import profiles_dir

    def generate(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-m", "agent", "generate", PROMPTS[2], "--json"]
        args += ["--profile", str(profiles_dir() / "generic-x86_64.toml")]
        args += ["--model", str(verify_dir), "--quantization", "fp32", "--temperature", "0"]
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        return subprocess.run(
            [*args, "--max-tokens", "6", *extra], capture_output=True, text=True, env=env
        )

    r = generate("--logit-bias", "42=100")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == [42] * 6
    bad = generate("--presence-penalty", "7")
    assert bad.returncode != 0 and "presence_penalty = 7.0 is out of range [-2, 2]" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_python_client_sends_them(tmp_path: Path) -> None:
    """`edge_agent_client`'s generate options become the same `Sampling` fields (checked in a
    Python that imports only the client, as its own distribution test runs it)."""
    import shutil
    import subprocess
    import sys

    from agent._protogen import PROTO_DIR, generate

    repo = ROOT
    shutil.copytree(repo / "client" / "edge_agent_client", tmp_path / "edge_agent_client")
    generate(PROTO_DIR, tmp_path, "edge_agent_client.pb")
    code = (
        "from edge_agent_client import _wire\n"
        "r = _wire.generate_request('x', max_tokens=None, temperature=None, top_p=None,"
        " top_k=None, seed=None, stop=(), session_id=None, json_schema=None,"
        " json_object=False, regex=None, grammar=None, logit_bias={5: -100.0},"
        " presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.5,"
        " repeat_last_n=-1)\n"
        "s = r.sampling\n"
        "print(dict(s.logit_bias), s.presence_penalty, s.frequency_penalty,"
        " s.repetition_penalty, s.repeat_last_n)\n"
        "import inspect, edge_agent_client as c\n"
        "for cls in (c.Client, c.AsyncClient):\n"
        "    assert 'repeat_last_n' in inspect.signature(cls.generate).parameters, cls\n"
    )
    r = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{Path(grpc.__file__).parent.parent}"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["{5:", "-100.0}", "0.5", "-1.0", "1.5", "-1"]
