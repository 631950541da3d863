"""Speculative decoding: the prompt-lookup drafter, the policy, and the speculative step.

The drafter and the policy are pure and tested here directly (the policy with scripted costs).
The speculative step is tested first against a scripted fake runner (a deterministic "model"
whose verify rows are what decode one by one gives, and whose KV rows past the accepted ones
are junk until overwritten), over many random cases; then end to end on real tiny models with
verify signatures: output identical with speculation on and off.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.base.errors import InvalidRequest, NonFiniteLogits
from agent.engine.drafts import PromptLookup
from agent.engine.generation import Generation
from agent.engine.sampler import Sampler, SamplingParams
from agent.engine.speculation import (
    MARGIN,
    PROBE_BUDGET,
    PROBE_MAX,
    PROBE_MIN,
    Acceptance,
    Speculator,
    break_even,
    expected_tokens,
    speculation_mode,
)
from agent.engine.types import TokenEvent

# ---------------------------------------------------------------------- drafter


def reference_draft(tokens: Sequence[int], k: int, lo: int = 1, hi: int = 3) -> tuple[int, tuple]:
    """By rescanning: the longest suffix (hi..lo tokens) with an earlier occurrence that is
    followed by a token; its most recent such occurrence; the k tokens after it, reading on
    through the draft itself when the continuation reaches the end."""
    last = len(tokens)
    for n in range(min(hi, last), lo - 1, -1):
        suffix = list(tokens[last - n :])
        for end in range(last - 2, n - 2, -1):  # the occurrence's last token, a successor after
            if list(tokens[end - n + 1 : end + 1]) == suffix:
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[end + 1 + j])
                return n, tuple(seq[last:])
    return 0, ()


@given(
    st.lists(st.integers(0, 4), max_size=60),
    st.integers(1, 8),
    st.integers(1, 3),
)
def test_lookup_matches_a_rescan(tokens: list[int], k: int, lo: int) -> None:
    built = PromptLookup(tokens, min_ngram=lo)
    grown = PromptLookup(min_ngram=lo)
    for i, t in enumerate(tokens):
        grown.append(t)
        assert grown.draft(k) == reference_draft(tokens[: i + 1], k, lo)
    assert built.draft(k) == reference_draft(tokens, k, lo)


def test_lookup_examples() -> None:
    assert PromptLookup([1, 2, 3, 4, 9, 1, 2]).draft(3) == (2, (3, 4, 9))
    # the most recent occurrence wins, and the longest match before shorter ones
    assert PromptLookup([5, 1, 2, 7, 1, 2, 8, 0, 2]).draft(2) == (1, (8, 0))
    assert PromptLookup([1, 2, 7, 3, 2, 8, 1, 2]).draft(1) == (2, (7,))
    # a repeating pattern is extrapolated through the draft
    assert PromptLookup([1, 2, 1, 2, 1]).draft(5) == (3, (2, 1, 2, 1, 2))
    assert PromptLookup([4, 4]).draft(4) == (1, (4, 4, 4, 4))
    # nothing to go on
    assert PromptLookup([1, 2, 3]).draft(4) == (0, ())
    assert PromptLookup().draft(4) == (0, ())
    assert PromptLookup([1, 2, 1]).draft(0) == (0, ())
    assert PromptLookup([1, 2, 3, 1], min_ngram=2).draft(3) == (0, ())
    with pytest.raises(ValueError):
        PromptLookup(min_ngram=0)


# ---------------------------------------------------------------------- policy


@dataclass
class ScriptedCosts:
    """Measured seconds per call as the runner would report them (None: unmeasured)."""

    decode: float | None = 1.0
    verify: dict[int, float | None] = field(default_factory=lambda: {4: 1.2, 8: 1.5})

    def decode_s(self, kv: object) -> float | None:
        return self.decode

    def verify_s(self, kv: object, n: int) -> float | None:
        return next((c for length, c in sorted(self.verify.items()) if length >= n), None)


REPEAT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 4  # every suffix has a long continuation


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens(1.0, 7) == 8.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert break_even(1.75, 2) == pytest.approx(0.5)
    assert break_even(0.9, 3) == 0.0 and break_even(4.5, 3) is None
    assert expected_tokens(break_even(3.8, 3) or 0.0, 3) == pytest.approx(3.8)


def test_high_acceptance_uses_the_longest_draft() -> None:
    spec = Speculator(ScriptedCosts(), (4, 8), REPEAT)
    lengths = []
    for _ in range(20):
        drafts = spec.propose(None, [], 100)
        lengths.append(len(drafts))
        spec.record(len(drafts), len(drafts), len(drafts))
    # at the prior (1 in 2) E(3) / 1.2 beats E(7) / 1.5; once drafts hold, 7 is best
    assert lengths[0] == 3 and lengths[5:] == [7] * 15
    assert (spec.drafted, spec.accepted, spec.verify_calls) == (sum(lengths),) * 2 + (20,)


def test_budget_caps_the_draft() -> None:
    spec = Speculator(ScriptedCosts(), (4, 8), REPEAT)
    assert len(spec.propose(None, [], 2)) == 2
    assert spec.propose(None, [], 0) == ()
    assert Speculator(ScriptedCosts(), (), REPEAT).propose(None, [], 100) == ()


def test_unmeasured_decode_never_speculates_and_unmeasured_verify_is_tried() -> None:
    assert Speculator(ScriptedCosts(decode=None), (4, 8), REPEAT).propose(None, [], 9) == ()
    costs = ScriptedCosts(verify={4: None, 8: None})
    assert len(Speculator(costs, (4, 8), REPEAT).propose(None, [], 9)) == 7


def test_verify_that_cannot_pay_is_never_used() -> None:
    # verify_4 costing 4.5 decode steps, verify_8 9: not even 4 or 8 held drafts pay for them
    spec = Speculator(ScriptedCosts(verify={4: 4.5, 8: 9.0}), (4, 8), REPEAT)
    assert [spec.propose(None, [], 100) for _ in range(500)] == [()] * 500


def test_a_short_draft_that_cannot_pay_does_not_stop_longer_ones() -> None:
    # verify_8 costs 3 decode steps: a 2-token draft cannot pay for it, a 7-token one can
    spec = Speculator(ScriptedCosts(verify={8: 3.0}), (8,), [])
    spec._orders[1].accepted = spec._orders[1].checked = 50.0  # 2-token matches: all held
    generated = [5, 6, 9, 5, 6]  # "5 6" occurred once, followed by 9, 5, 6 (then repeating)
    assert spec.propose(None, generated, 2) == ()  # at most 2 drafts: cannot pay
    assert spec.propose(None, generated, 100) == (9, 5, 6, 9, 5, 6, 9)


def test_probes_wait_by_their_cost() -> None:
    # verify_4 costs 2 decode steps: it pays only above ~70% acceptance (the prior is 50%); the
    # probes come after 8 steps, then at most one per (2 - 1) / PROBE_BUDGET steps
    spec = Speculator(ScriptedCosts(verify={4: 2.0, 8: 3.5}), (4, 8), REPEAT)
    proposals = []
    for _ in range(300):
        d = spec.propose(None, [], 100)
        proposals.append(d)
        if d:
            spec.record(len(d), 1, 0)
    probes = [i for i, d in enumerate(proposals) if d]
    # the first decline (step 0) waits PROBE_MIN steps (a draft right after a prompt often
    # fails where the text quotes it later); failed probes then wait as PROBE_BUDGET asks
    cost_wait = math.ceil((2.0 - 1.0) / PROBE_BUDGET)
    assert probes[0] == 1 + PROBE_MIN and all(len(proposals[i]) == 3 for i in probes)
    waits = [max(min(PROBE_MIN * 2 ** (i + 1), PROBE_MAX), cost_wait) for i in range(4)]
    assert waits == [50, 50, 64, 64]
    assert [b - a - 1 for a, b in itertools.pairwise(probes)] == waits, probes


@pytest.mark.parametrize("verify", [{4: 1.2, 8: 1.5}, {4: 2.0, 8: 3.5}, {4: 3.0, 8: 7.0}])
def test_short_requests_on_open_ended_text_stay_within_five_percent(verify) -> None:  # type: ignore[no-untyped-def]
    """Every request starts from the prior: many short ones (40 tokens) whose drafts all fail
    cost at most 5% more than plain decoding."""
    costs = ScriptedCosts(verify=verify)
    spent = emitted = 0.0
    for _ in range(100):
        s, e = simulate(Speculator(costs, (4, 8), REPEAT), costs, 40, lambda step, k: 0)
        spent, emitted = spent + s, emitted + e
    assert spent / (emitted * (costs.decode or 0.0)) <= 1.05


def simulate(spec: Speculator, costs: ScriptedCosts, steps: int, hold) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Run `steps` decode steps through the policy with scripted acceptance `hold(step, k)`;
    returns (seconds spent, tokens emitted) under the scripted costs."""
    spent, emitted = 0.0, 0
    for step in range(steps):
        drafts = spec.propose(None, [], 100)
        if not drafts:
            spent += costs.decode or 0.0
            emitted += 1
            continue
        a = hold(step, len(drafts))
        spec.record(len(drafts), min(a + 1, len(drafts)), a)
        spent += costs.verify_s(None, len(drafts) + 1) or 0.0
        emitted += a + 1
    return spent, emitted


def test_failing_drafts_back_off_to_within_five_percent() -> None:
    costs = ScriptedCosts()
    spec = Speculator(costs, (4, 8), REPEAT)
    spent, emitted = simulate(spec, costs, 2000, lambda step, k: 0)
    plain = emitted * (costs.decode or 0.0)
    assert spent / plain <= 1.05
    assert spec.verify_calls > 0  # it did try, and it keeps probing
    late = Speculator(costs, (4, 8), REPEAT)
    simulate(late, costs, 1000, lambda step, k: 0)
    calls = late.verify_calls
    simulate(late, costs, 1000, lambda step, k: 0)
    assert 0 < late.verify_calls - calls <= 1000 // PROBE_MAX + 1


def test_turns_back_on_when_drafts_start_holding() -> None:
    costs = ScriptedCosts()
    spec = Speculator(costs, (4, 8), REPEAT)
    simulate(spec, costs, 500, lambda step, k: 0)
    before = spec.verify_calls
    spent, emitted = simulate(spec, costs, 500, lambda step, k: k)
    assert spec.verify_calls - before > 300  # back on within a probe interval or two
    assert emitted / spent > 3.0 * MARGIN  # and much faster than plain decoding


def test_acceptance_is_tracked_per_match_length() -> None:
    # failing unigram matches do not stop trigram matches, which keep their own estimate
    spec = Speculator(ScriptedCosts(), (4, 8), [])
    spec._orders[0].checked = 50.0  # unigram drafts: 0 of 50 held
    generated = [7, 8, 7]  # only "7" occurred before
    assert spec.propose(None, generated, 100) == ()
    spec._wait = 0  # past the back-off that decline started
    generated += [1, 2, 3, 1, 2, 3]
    assert spec.propose(None, generated, 100) == (1, 2, 3)  # its prior: verify_4 is best


def test_a_new_request_starts_from_what_earlier_ones_saw() -> None:
    costs = ScriptedCosts()
    shared = Acceptance()
    for _ in range(20):  # open-ended requests: every draft fails
        simulate(Speculator(costs, (4, 8), REPEAT, shared), costs, 40, lambda step, k: 0)
    assert Speculator(costs, (4, 8), REPEAT, shared).propose(None, [], 100) == ()
    for _ in range(20):  # requests that quote their input: every draft holds
        simulate(Speculator(costs, (4, 8), REPEAT, shared), costs, 40, lambda step, k: k)
    assert len(Speculator(costs, (4, 8), REPEAT, shared).propose(None, [], 100)) == 7


def test_a_missing_verify_signature_backs_off() -> None:
    spec = Speculator(ScriptedCosts(), (4, 8), REPEAT)
    assert spec.propose(None, [], 100)
    spec.missed()  # e.g. a KV window without verify signatures
    assert [spec.propose(None, [], 100) for _ in range(PROBE_MAX)] == [()] * PROBE_MAX
    assert spec.propose(None, [], 100)


def test_speculation_mode() -> None:
    assert speculation_mode(None, "ngram") == "ngram"
    assert speculation_mode("off", "ngram") == "off"
    with pytest.raises(InvalidRequest, match="not available"):
        speculation_mode("draft", "ngram")
    with pytest.raises(InvalidRequest, match="'off', 'ngram'"):
        speculation_mode("eagle", "off")


def test_profile_key(make_profile, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agent.base.errors import ConfigError

    assert make_profile().generation.speculation == "ngram"
    assert make_profile(generation={"speculation": "off"}).generation.speculation == "off"
    for bad, says in (("draft", "not available"), ("fast", "one of 'off', 'ngram'"), (1, "one")):
        with pytest.raises(ConfigError, match=says) as info:
            make_profile(generation={"speculation": bad})
        assert "generation.speculation" in str(info.value)


# ---------------------------------------------------------------------- the step, on a fake


JUNK = -1  # what a padded verify call leaves in the rows past its tokens


class ToyModel:
    """A deterministic next-token table over the last two rows (and the position's parity),
    so greedy text falls into loops that drafts catch, and junk or misplaced rows change it."""

    def __init__(self, vocab: int, seed: int, nan_at: int | None = None) -> None:
        self.vocab, self.seed, self.nan_at = vocab, seed, nan_at

    def logits(self, rows: Sequence[int], pos: int) -> np.ndarray:
        assert all(r != JUNK for r in rows[: pos + 1]), "read a row the request never wrote"
        if pos == self.nan_at:
            return np.full(self.vocab, np.nan, dtype=np.float32)
        key = f"{self.seed}:{rows[max(0, pos - 1)]}:{rows[pos]}:{pos % 2}".encode()
        h = np.frombuffer(hashlib.sha256(key).digest(), dtype=np.uint8)
        return (h[: self.vocab].astype(np.float32) / 32.0).copy()


class FakeRunner:
    """A scripted runner over `ToyModel`: decode and verify rows as one-by-one decoding gives
    them, verify padded to the signature's length with junk rows, None past the context."""

    def __init__(
        self, model: ToyModel, context: int, lengths: tuple[int, ...] = (4, 8), extra: int = 3
    ) -> None:
        from types import SimpleNamespace

        self.model = model
        # the model's embedding is padded: rows past the tokenizer's vocabulary exist
        self.layout = SimpleNamespace(context_length=context, vocab_size=model.vocab + extra)
        self.accelerator = "fake"
        self.verify_lengths = lengths
        self.costs = ScriptedCosts()
        self.rows: list[int] = [JUNK] * context
        self.verify_calls = 0

    def _row(self, pos: int) -> np.ndarray:
        pad = np.full(self.layout.vocab_size - self.model.vocab, 99.0, dtype=np.float32)
        return np.concatenate([self.model.logits(self.rows, pos), pad])

    def reserve(self, kv: object, rows: int, keep: int) -> None:
        pass

    def prefill(self, kv: object, tokens: Sequence[int], start: int) -> None:
        self.rows[start : start + len(tokens)] = tokens

    def decode(self, kv: object, token: int, pos: int) -> np.ndarray:
        self.rows[pos] = token
        return self._row(pos)

    def verify(self, kv: object, tokens: Sequence[int], pos: int) -> np.ndarray | None:
        n = next((n for n in self.verify_lengths if n >= len(tokens)), None)
        if n is None or pos + n > self.layout.context_length:
            return None
        self.verify_calls += 1
        self.rows[pos : pos + n] = [*tokens, *[JUNK] * (n - len(tokens))]
        return np.stack([self._row(pos + i) for i in range(len(tokens))])


class Letters:
    """A detokenizer: token t is one letter."""

    def push(self, t: int) -> str:
        return chr(ord("a") + t)

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(map(self.push, ids))

    def flush(self) -> str:
        return ""


@dataclass
class Run:
    tokens: list[int]
    text: str
    finish: str
    kv_rows: int
    error: str | None
    drafted: int
    accepted: int
    events: int


def run_fake(  # type: ignore[no-untyped-def]
    prompt: Sequence[int],
    *,
    speculate: bool,
    vocab: int = 8,
    seed: int = 0,
    context: int = 64,
    max_tokens: int = 40,
    stop: Sequence[str] = (),
    stop_ids: frozenset[int] = frozenset(),
    sampling: SamplingParams | None = None,
    nan_at: int | None = None,
    lengths: tuple[int, ...] = (4, 8),
) -> Run:
    runner = FakeRunner(ToyModel(vocab, seed, nan_at), context, lengths)
    spec = Speculator(runner.costs, runner.verify_lengths, prompt) if speculate else None
    gen = Generation(
        runner,  # type: ignore[arg-type]
        object(),  # type: ignore[arg-type]
        Letters(),
        prompt,
        start_pos=0,
        max_tokens=max_tokens,
        sampler=Sampler(sampling or SamplingParams()),
        stop=stop,
        stop_ids=stop_ids,
        prefill_chunk=16,
        vocab=vocab,
        speculator=spec,
    )
    events: list[TokenEvent] = []
    while not gen.done:
        try:
            events += gen.step()
        except NonFiniteLogits as exc:
            events.append(gen.fail(str(exc)))
    last = events[-1]
    assert last.stats is not None and last.finish_reason is not None
    assert [t for e in events for t in e.token_ids] == gen.generated
    return Run(
        gen.generated,
        "".join(e.text for e in events),
        last.finish_reason,
        gen.kv_rows,
        last.error,
        last.stats.drafted_tokens,
        last.stats.accepted_tokens,
        len(events),
    )


def same(a: Run, b: Run) -> None:
    """The same output and ending; the same KV rows held unless it failed (a failed request's
    rows are never reused: agent.engine.binding)."""
    assert (a.tokens, a.text, a.finish, a.error) == (b.tokens, b.text, b.finish, b.error)
    if a.finish != "error":
        assert a.kv_rows == b.kv_rows


def test_fake_greedy_identical_and_drafts_accepted() -> None:
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = run_fake(prompt, speculate=False)
    spec = run_fake(prompt, speculate=True)
    same(plain, spec)
    assert plain.drafted == 0 and spec.drafted > 0 and spec.accepted > 0
    assert spec.events < plain.events  # several tokens per verify call


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=20),
    seed=st.integers(0, 3),
    context=st.integers(24, 60),
    max_tokens=st.integers(1, 50),
    stop_id=st.one_of(st.none(), st.integers(0, 5)),
    stop=st.one_of(st.none(), st.text("abcdef", min_size=1, max_size=3)),
    temperature=st.sampled_from([0.0, 0.8]),
    top_p=st.sampled_from([1.0, 0.7]),
    nan_at=st.one_of(st.none(), st.integers(20, 40)),
    lengths=st.sampled_from([(4, 8), (2,), (3, 5, 8)]),
)
def test_fake_identical_to_plain_decoding(  # type: ignore[no-untyped-def]
    prompt, seed, context, max_tokens, stop_id, stop, temperature, top_p, nan_at, lengths
) -> None:
    """Stops (ids and strings), max_tokens, the context end and non-finite logits inside a
    block, sampling with a seed: the same tokens, text, ending and KV rows as plain decoding."""
    if len(prompt) >= context:
        prompt = prompt[: context - 1]
    kw = {
        "seed": seed,
        "context": context,
        "max_tokens": max_tokens,
        "stop_ids": frozenset() if stop_id is None else frozenset({stop_id}),
        "stop": () if stop is None else (stop,),
        "sampling": SamplingParams(temperature=temperature, top_p=top_p, seed=seed + 7),
        "nan_at": nan_at,
        "lengths": lengths,
    }
    same(run_fake(prompt, speculate=False, **kw), run_fake(prompt, speculate=True, **kw))


class NoRepeat:
    """A toy grammar: a token may not follow itself (the mask forbids the last one)."""

    def start(self):  # type: ignore[no-untyped-def]
        return NoRepeatState()


class NoRepeatState:
    def __init__(self) -> None:
        self.last: int | None = None
        self.seen: list[int] = []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        if self.last is not None:
            out[self.last] = -np.inf
        return out

    def advance(self, token: int) -> None:
        assert token != self.last
        self.last = token
        self.seen.append(token)


def test_fake_constrained_identical() -> None:
    prompt = [1, 1, 2, 1, 1, 2, 1, 1]
    for temperature in (0.0, 0.9):
        params = SamplingParams(temperature=temperature, seed=3, constraint=NoRepeat())
        plain = run_fake(prompt, speculate=False, sampling=params)
        spec = run_fake(prompt, speculate=True, sampling=params)
        same(plain, spec)
        assert spec.drafted > 0
        assert all(a != b for a, b in zip(spec.tokens, spec.tokens[1:], strict=False))


def test_fake_stop_inside_a_block() -> None:
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    full = run_fake(prompt, speculate=True)
    assert full.accepted > 0
    for cut in (3, 7, 12):
        s = full.text[cut : cut + 2]
        plain = run_fake(prompt, speculate=False, stop=(s,))
        spec = run_fake(prompt, speculate=True, stop=(s,))
        same(plain, spec)
        assert spec.finish == "stop" and spec.text == full.text[: full.text.find(s)]
        stop_id = full.tokens[cut]
        same(
            run_fake(prompt, speculate=False, stop_ids=frozenset({stop_id})),
            run_fake(prompt, speculate=True, stop_ids=frozenset({stop_id})),
        )
    for n in (1, 2, 5, 9):
        spec = run_fake(prompt, speculate=True, max_tokens=n)
        same(run_fake(prompt, speculate=False, max_tokens=n), spec)
        assert spec.finish == "length" and spec.tokens == full.tokens[:n]


# ---------------------------------------------------------------------- end to end, real models

VERIFY = (4, 8)
# input-grounded prompts (the answer can copy them) and one that is not
PROMPTS = (
    "def main():\n    return 1\ndef main():\n",
    "self def return self def return self",
    "The user is",
    "abc abc abc abc abc abc abc abc",
)


@pytest.fixture
def always(monkeypatch):  # type: ignore[no-untyped-def]
    """Speculate whenever a draft exists (the measured costs of a tiny model may say no): the
    identity tests then exercise the speculative step on every draft."""
    import agent.engine.speculation as speculation

    monkeypatch.setattr(speculation, "MARGIN", 0.0)


def open_engine(model_dir, dev_profile_data, quantization="fp32", **kw):  # type: ignore[no-untyped-def]
    from agent.engine.engine import Engine
    from agent.profile import parse_profile, profiles_dir

    profile = parse_profile(dev_profile_data, profiles_dir() / "generic-x86_64.toml")
    return Engine.load(profile, model_dir, quantization=quantization, **kw)


def pair(engine, **kw):  # type: ignore[no-untyped-def]
    """The same request with speculation off and on: (plain, speculative) completions."""
    from agent.engine.types import GenerateRequest

    kw.setdefault("max_tokens", None)  # to a stop id or the end of the 64-row context
    kw.setdefault("sampling", SamplingParams())
    off = engine.complete(GenerateRequest(speculation="off", **kw))
    on = engine.complete(GenerateRequest(speculation="ngram", **kw))
    assert off.stats.drafted_tokens == 0
    return off, on


def identical(off, on) -> None:  # type: ignore[no-untyped-def]
    assert on.token_ids == off.token_ids
    assert on.text == off.text
    assert on.finish_reason == off.finish_reason


@pytest.fixture(scope="module")
def verify_dir(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_factory.model_dir(prefill_lens=(8,), kv_max=64, verify_lens=VERIFY)


@pytest.mark.parametrize(
    ("quantization", "interpreter"), [("fp32", False), ("int8", False), ("fp32", True)]
)
def test_greedy_identical_on_a_real_model(  # type: ignore[no-untyped-def]
    verify_dir, dev_profile_data, quantization, interpreter, always
) -> None:
    engine = open_engine(verify_dir, dev_profile_data, quantization, prefer_interpreter=interpreter)
    try:
        assert engine.info.execution_path == ("interpreter" if interpreter else "compiled")
        assert engine.loaded.runner.verify_lengths == VERIFY
        accepted = calls = 0
        for prompt in PROMPTS:
            off, on = pair(engine, prompt=prompt)
            identical(off, on)
            calls += on.stats.verify_calls > 0
            accepted += on.stats.accepted_tokens
            assert on.stats.accepted_tokens <= on.stats.drafted_tokens
        assert calls >= len(PROMPTS) - 1  # (one of them may end at its first token)
        assert accepted > 0  # drafts held somewhere: the test cannot pass on rejections only
        totals = engine.stats()
        assert totals.drafted_tokens > 0 and totals.accepted_tokens == accepted
    finally:
        engine.close()


def test_sampling_stops_and_limits_identical(verify_dir, dev_profile_data, always) -> None:  # type: ignore[no-untyped-def]
    engine = open_engine(verify_dir, dev_profile_data)
    try:
        drafted = 0
        for seed in (1, 2, 3):
            for sampling in (
                SamplingParams(temperature=0.8, seed=seed),
                SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=seed),
            ):
                for prompt in (PROMPTS[0], PROMPTS[3]):
                    off, on = pair(engine, prompt=prompt, sampling=sampling)
                    identical(off, on)
                    drafted += on.stats.drafted_tokens
        assert drafted > 0
        full = pair(engine, prompt=PROMPTS[1], max_tokens=30)[1]
        assert full.stats.accepted_tokens > 0 and len(full.text) > 12
        for cut in (2, 5, 9):
            stop = full.text[cut : cut + 3]
            off, on = pair(engine, prompt=PROMPTS[1], max_tokens=30, stop=(stop,))
            identical(off, on)
            assert on.finish_reason == "stop" and on.text == full.text[: full.text.find(stop)]
        for n in (1, 2, 3, 6, 11):
            off, on = pair(engine, prompt=PROMPTS[1], max_tokens=n)
            identical(off, on)
            assert on.token_ids == full.token_ids[:n] and on.finish_reason == "length"
    finally:
        engine.close()


def test_context_end_inside_a_block(verify_dir, dev_profile_data, always) -> None:  # type: ignore[no-untyped-def]
    engine = open_engine(verify_dir, dev_profile_data)
    try:
        # no max_tokens: generation runs to the end of the 64-row context
        off, on = pair(engine, prompt=PROMPTS[3], max_tokens=None)
        identical(off, on)
        assert on.finish_reason == "length" and on.stats.verify_calls > 0
    finally:
        engine.close()


def test_kv_windows_identical(tiny_model_factory, dev_profile_data, always) -> None:  # type: ignore[no-untyped-def]
    d = tiny_model_factory.model_dir(
        quantizations=("fp32",),
        prefill_lens=(8,),
        kv_max=64,
        verify_lens=VERIFY,
        decode_windows=(16, 32),
    )
    engine = open_engine(d, dev_profile_data)
    try:
        assert engine.loaded.runner.verify_lengths == VERIFY
        drafted = 0
        for prompt in PROMPTS:
            off, on = pair(engine, prompt=prompt, max_tokens=None)  # through every window
            identical(off, on)
            drafted += on.stats.drafted_tokens
        assert drafted > 0
    finally:
        engine.close()


def test_session_turns_identical(verify_dir, dev_profile_data, always) -> None:  # type: ignore[no-untyped-def]
    """A conversation continued over turns: each turn's answer, and the session's tokens
    (what the next turn and a spill keep), are those of plain decoding."""
    from agent.engine.types import GenerateRequest

    engine = open_engine(verify_dir, dev_profile_data)
    try:
        sids = {mode: engine.create_session() for mode in ("off", "ngram")}
        drafted = 0
        for turn in ("abc abc abc", " self def return", " abc abc"):
            got = {
                mode: engine.complete(
                    GenerateRequest(
                        turn,
                        max_tokens=8,
                        sampling=SamplingParams(),
                        session_id=sid,
                        speculation=mode,
                    )
                )
                for mode, sid in sids.items()
            }
            identical(got["off"], got["ngram"])
            drafted += got["ngram"].stats.drafted_tokens
            assert engine.session_tokens(sids["off"]) == engine.session_tokens(sids["ngram"])
            # the rows the session keeps are the accepted tokens' own, bit for bit
            held = {mode: engine._store.get(sid, "") for mode, sid in sids.items()}
            assert held["off"].kv_len == held["ngram"].kv_len > 0
            rows = {
                mode: engine.loaded.runner.read_rows(s.kv, s.kv_len)
                for mode, s in held.items()
                if s.kv is not None
            }
            assert len(rows) == 2
            for name, want in rows["off"].items():
                assert np.array_equal(rows["ngram"][name], want), name
        assert drafted > 0
        # a fork of the speculative conversation goes on as a fork of the plain one
        forks = {mode: engine.fork_session(sid) for mode, sid in sids.items()}
        after = [
            engine.complete(
                GenerateRequest(
                    " abc", max_tokens=6, sampling=SamplingParams(), session_id=f, speculation=m
                )
            )
            for m, f in forks.items()
        ]
        identical(after[0], after[1])
    finally:
        engine.close()


def test_constrained_identical(verify_dir, dev_profile_data, always) -> None:  # type: ignore[no-untyped-def]
    from agent.constraint.types import Constraint

    engine = open_engine(verify_dir, dev_profile_data)
    try:
        constraint = Constraint("regex", "(abc )+(def )+")
        for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=5)):
            off, on = pair(
                engine, prompt=PROMPTS[3], constraint=constraint, sampling=sampling, max_tokens=30
            )
            identical(off, on)
            assert on.stats.drafted_tokens > 0  # "abc " repeats: drafts every step
    finally:
        engine.close()


def test_off_and_draft_and_no_verify_signatures(  # type: ignore[no-untyped-def]
    verify_dir, tiny_model_dir, dev_profile_data
) -> None:
    from agent.engine.types import GenerateRequest

    engine = open_engine(verify_dir, dev_profile_data)
    try:
        with pytest.raises(InvalidRequest, match="not available"):
            engine.complete(GenerateRequest(PROMPTS[0], speculation="draft"))
        with pytest.raises(InvalidRequest, match="allowed"):
            engine.complete(GenerateRequest(PROMPTS[0], speculation="on"))
    finally:
        engine.close()
    plain = open_engine(tiny_model_dir, dev_profile_data)
    try:
        assert plain.loaded.runner.verify_lengths == ()
        c = plain.complete(
            GenerateRequest(
                PROMPTS[0], max_tokens=20, sampling=SamplingParams(), speculation="ngram"
            )
        )  # greedy: whether the first token is the EOS is not left to a draw
        assert c.stats.drafted_tokens == c.stats.verify_calls == 0 and c.token_ids
    finally:
        plain.close()


# ---------------------------------------------------------------------- the API surfaces


def test_cli_generate_speculation_and_json_stats(verify_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import os
    import subprocess
    import sys

    from agent.profile import profiles_dir

    def generate(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-m", "agent", "generate", PROMPTS[3], "--json"]
        args += ["--profile", str(profiles_dir() / "generic-x86_64.toml")]
        args += ["--model", str(verify_dir), "--quantization", "fp32", "--temperature", "0"]
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        return subprocess.run(
            [*args, "--max-tokens", "24", *extra], capture_output=True, text=True, env=env
        )

    runs = {mode: generate("--speculation", mode) for mode in ("off", "ngram")}
    docs = {}
    for mode, r in runs.items():
        assert r.returncode == 0, r.stderr
        docs[mode] = json.loads(r.stdout)
    assert docs["off"]["tokens"] == docs["ngram"]["tokens"]
    off, on = docs["off"]["stats"], docs["ngram"]["stats"]
    assert off["drafted_tokens"] == off["verify_calls"] == 0 and off["acceptance"] == 0
    # a fresh process: decode is measured first, then an unmeasured verify signature is tried
    assert on["drafted_tokens"] > 0 and on["verify_calls"] > 0
    assert on["acceptance"] == round(on["accepted_tokens"] / on["drafted_tokens"], 3)
    bad = generate("--speculation", "draft")
    assert bad.returncode == 2 and "not available" in bad.stderr


def test_grpc_conversions() -> None:
    from types import SimpleNamespace

    from agent.api.grpc.convert import to_request, to_response
    from agent.engine.types import RequestStats
    from agent.pb.edge_agent.v1 import agent_pb2 as pb
    from agent.profile.schema import GenerationDefaults

    engine = SimpleNamespace(profile=SimpleNamespace(generation=GenerationDefaults(8, 0, 0, 1, 64)))
    msg = pb.GenerateRequest(prompt="x", speculation="off")
    assert to_request(msg, engine, 100).speculation == "off"  # type: ignore[arg-type]
    assert to_request(pb.GenerateRequest(prompt="x"), engine, 100).speculation is None  # type: ignore[arg-type]
    stats = RequestStats(
        3, 9, 1.0, 1.0, 1.0, 1.0, 1.0, "x", drafted_tokens=12, accepted_tokens=5, verify_calls=4
    )
    r = to_response(TokenEvent("", finish_reason="stop", stats=stats), "r1")
    assert (r.stats.drafted_tokens, r.stats.accepted_tokens, r.stats.verify_calls) == (12, 5, 4)


def test_http_conversions() -> None:
    from types import SimpleNamespace

    from agent.api.http.convert import completion_request
    from agent.api.http.errors import HttpError
    from agent.api.http.replies import usage
    from agent.engine.types import RequestStats
    from agent.profile.schema import GenerationDefaults

    engine = SimpleNamespace(profile=SimpleNamespace(generation=GenerationDefaults(8, 0, 0, 1, 64)))
    got = completion_request({"prompt": "x", "speculation": "ngram"}, engine, 100)  # type: ignore[arg-type]
    assert got.request.speculation == "ngram"
    assert completion_request({"prompt": "x"}, engine, 100).request.speculation is None  # type: ignore[arg-type]
    with pytest.raises(HttpError) as info:
        completion_request({"prompt": "x", "speculation": 1}, engine, 100)  # type: ignore[arg-type]
    assert info.value.param == "speculation"
    stats = RequestStats(3, 9, 1.0, 1.0, 1.0, 1.0, 1.0, "x", drafted_tokens=12, accepted_tokens=5)
    assert usage(stats)["completion_tokens_details"] == {
        "accepted_prediction_tokens": 5,
        "rejected_prediction_tokens": 7,
    }


# ---------------------------------------------------------------------- every family

try:
    from tests.support.families import VERIFY_COMBOS, VerifyFamilyFactory
except ImportError:  # the matrix without verify variants (an older checkout)
    VERIFY_COMBOS, VerifyFamilyFactory = (), None  # type: ignore[assignment]


@pytest.fixture(scope="module")
def verify_families(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tests.support import families

    return VerifyFamilyFactory(families.cache_root() or tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("combo", VERIFY_COMBOS, ids=lambda c: c.family)
def test_every_family_identical(verify_families, combo, dev_profile_data, always) -> None:  # type: ignore[no-untyped-def]
    """Greedy and seeded sampling, speculation on and off, on each family's verify file: the
    same tokens (a verify call's first row is always sampled, so even a rejected draft tests
    the verify logits against decode's)."""
    d = verify_families.model_dir(combo, ("fp32",))
    engine = open_engine(d, dev_profile_data)
    try:
        assert engine.loaded.runner.verify_lengths, "the load check refused speculation"
        calls = 0
        for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=4)):
            for prompt in (PROMPTS[1], PROMPTS[3]):
                off, on = pair(engine, prompt=prompt, max_tokens=24, sampling=sampling)
                identical(off, on)
                calls += on.stats.verify_calls
        assert calls > 0
    finally:
        engine.close()


def test_client_commands_pass_speculation_to_the_daemon() -> None:
    """`edge-agent client generate|chat --speculation MODE` puts it in the gRPC request; absent,
    the field stays empty (the daemon's profile decides)."""
    import argparse

    from agent.api.grpc.client import build_request
    from agent.cli.client import add_client_parser

    parser = argparse.ArgumentParser()
    add_client_parser(parser.add_subparsers())
    for argv in (["client", "generate", "x"], ["client", "chat", "x"]):
        assert parser.parse_args(argv).speculation is None
        args = parser.parse_args([*argv, "--speculation", "off"])
        req = build_request(
            "x", None, max_tokens=None, temperature=None, top_k=None, top_p=None, seed=None,
            stop=[], speculation=args.speculation,
        )  # fmt: skip
        assert req.speculation == "off"
    req = build_request(
        "x", None, max_tokens=None, temperature=None, top_k=None, top_p=None, seed=None, stop=[]
    )
    assert req.speculation == ""
