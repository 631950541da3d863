"""Structured output by constrained decoding (agent/constraint/compiler.py), on the tiny real
models with both tokenizer kinds: SentencePiece (``▁`` spaces) and a byte-level BPE
tokenizer.json (``Ġ``). What comes out is checked by references outside our code: the
`jsonschema` library, `json`, Python's `re.fullmatch`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from agent.base.errors import InvalidRequest, RuntimeFailure
from agent.constraint.compiler import ENTRY_MIN_BYTES, MISSING_EXTRA, ConstraintCompiler
from agent.constraint.types import Constraint
from agent.engine.engine import Engine
from agent.engine.sampler import Sampler, SamplingParams
from agent.engine.types import GenerateRequest
from agent.tokenizer.base import Tokenizer
from agent.tokenizer.load import load_tokenizer
from tests.support.paths import ROOT
from tests.unit.chat.test_chat import BOOM, make_chat_dir
from tests.unit.chat.test_chat import source as template_source

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["user", "admin"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
SAMPLINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.8, top_k=20, seed=2),
    SamplingParams(temperature=1.2, top_p=0.9, seed=3),
]


@pytest.fixture(scope="module")
def profile(dev_profile_data):
    from agent.profile import parse_profile, profiles_dir

    return parse_profile(dev_profile_data, profiles_dir() / "generic-x86_64.toml")


@pytest.fixture(scope="module")
def sp(tiny_model_dir, profile) -> Engine:
    """The tiny model with its SentencePiece tokenizer (``▁`` spaces, no ``{``/``}`` piece)."""
    e = Engine.load(profile, tiny_model_dir, quantization="fp32")
    yield e
    e.close()


@pytest.fixture(scope="module")
def bpe(tiny_model_dir, profile, tmp_path_factory) -> Engine:
    """The same weights with a byte-level BPE tokenizer.json (every printable ASCII byte)."""
    d = make_chat_dir(
        tiny_model_dir, tmp_path_factory.mktemp("bpe") / "model", BOOM + template_source("chatml")
    )
    e = Engine.load(profile, d, quantization="fp32")
    yield e
    e.close()


GREEDY = SamplingParams(temperature=0.0)


def run(engine: Engine, constraint: Constraint | None, **kw):
    """A request on "The user is"; sampling defaults to seeded (the profile's temperature 0.8
    unseeded would make a test's outcome, and the free KV caches the next test finds, vary
    from run to run)."""
    kw.setdefault("max_tokens", 100)
    kw.setdefault("sampling", SamplingParams(temperature=0.8, seed=7))
    return engine.complete(GenerateRequest("The user is", constraint=constraint, **kw))


# What each vocabulary can spell: the tiny SentencePiece model has no ``{``, ``[`` or byte
# fallback (so no JSON object or array at all), but it has ``"`` and letters.
SCHEMAS = {
    "bpe": PERSON,
    "sp": {"anyOf": [{"type": "string", "maxLength": 12}, {"enum": ["self", "def", "return"]}]},
}


@pytest.mark.parametrize("kind", ["sp", "bpe"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: f"t{s.temperature}")
def test_json_schema_output_validates_with_jsonschema(kind: str, sampling, request) -> None:
    engine = request.getfixturevalue(kind)
    schema = SCHEMAS[kind]
    c = run(engine, Constraint("json_schema", json.dumps(schema)), sampling=sampling)
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), schema)
    assert c.text == engine.tokenizer.decode(c.token_ids)


def test_json_object_is_a_json_object(bpe: Engine) -> None:
    schema = {"type": "object", "maxProperties": 1}  # a random model may not close `{` soon
    for sampling in SAMPLINGS[:2]:
        c = run(bpe, Constraint("json_object"), sampling=sampling, max_tokens=110)
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:  # never claimed valid: and then what it has is a prefix of a JSON object
            assert c.finish_reason == "length" and c.text.lstrip().startswith("{")
    c = run(bpe, Constraint("json_schema", json.dumps(schema)), sampling=GREEDY, max_tokens=110)
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text


@pytest.mark.parametrize(
    ("constraint", "missing"),
    [
        (Constraint("json_object"), "needs '{' next"),
        (Constraint("json_schema", json.dumps(PERSON)), "needs '{' next"),
        (Constraint("json_schema", '{"type": "array", "maxItems": 2}'), "needs '[' next"),
        (Constraint("regex", r"ab\{c"), "needs '{' next"),
    ],
)
def test_a_grammar_the_vocabulary_cannot_spell_is_refused_naming_the_bytes(
    sp: Engine, constraint: Constraint, missing: str
) -> None:
    """The bug: a ``{`` that no token spells was tokenized as nothing, llguidance took the
    forced ``{`` as written and allowed the tokens after it (``"``), and the matcher then
    refused them: every JSON request on this model ended in an error with empty text. Now it
    is refused before queueing, naming what is missing, and the engine keeps serving."""
    before = sp.stats().requests_total
    with pytest.raises(InvalidRequest, match="cannot be written by this model") as err:
        sp.submit(GenerateRequest("x", constraint=constraint), lambda e: None)
    assert missing in str(err.value) and "no byte fallback" in str(err.value)
    assert sp.stats().requests_total == before and sp.stats().queue_depth == 0
    c = run(sp, Constraint("regex", "(yes|no)"))
    assert c.finish_reason == "stop" and c.text in ("yes", "no")


def test_the_unknown_piece_is_never_grammar_text(sp: Engine) -> None:
    """SentencePiece's ``<unk>`` renders as `` ⁇ `` but stands for text the vocabulary lacks:
    a grammar allowing any character must not take it for those three characters."""
    unk = sp.tokenizer.unk_id
    assert unk is not None and sp.tokenizer.token_bytes(unk) == " \u2047 ".encode()
    for constraint in (Constraint("regex", r"(.|\n){1,40}"), Constraint("grammar", "start: /.+/")):
        grammar = sp._intake.constraints().compile(constraint)
        state = grammar.start()
        assert np.isneginf(state.mask(np.zeros(sp.tokenizer.vocab_size, np.float32))[unk])
        for sampling in SAMPLINGS:
            c = run(sp, constraint, sampling=sampling, max_tokens=30)
            assert c.finish_reason in ("stop", "length") and unk not in c.token_ids, c.text
            assert re.fullmatch(r"(.|\n)+", c.text), c.text


def test_a_token_the_mask_forbade_is_an_error_never_applied(sp: Engine) -> None:
    grammar = sp._intake.constraints().compile(Constraint("regex", "(yes|no)"))
    state = grammar.start()
    masked = state.mask(np.zeros(sp.tokenizer.vocab_size, np.float32))
    forbidden = int(np.flatnonzero(np.isneginf(masked))[0])
    with pytest.raises(RuntimeFailure, match=f"token {forbidden} was not allowed by the mask"):
        state.advance(forbidden)
    with pytest.raises(RuntimeFailure, match="logits of shape"):
        grammar.start().mask(np.zeros(sp.tokenizer.vocab_size + 8, np.float32))


@pytest.mark.parametrize("kind", ["sp", "bpe"])
@pytest.mark.parametrize(
    "pattern",
    [
        r"(def|self|return)( [a-z]{1,6}){1,3}",
        r"[0-2]{3}:[a-f]{2,4}",
        r"(yes|no)",
    ],
)
def test_regex_output_fullmatches(kind: str, pattern: str, request) -> None:
    engine = request.getfixturevalue(kind)
    for sampling in SAMPLINGS:
        c = run(engine, Constraint("regex", pattern), sampling=sampling)
        assert c.finish_reason == "stop", c.text
        assert re.fullmatch(pattern, c.text), c.text


def test_sentencepiece_model_emits_the_space_a_regex_needs_and_ends(sp: Engine) -> None:
    """LiteRT-LM #3510: under LLGuidance a SentencePiece model could never emit a space, so
    a regex that needs one never ended. Here the space comes from a ``▁`` piece."""
    space_pieces = {
        i for i in range(sp.tokenizer.vocab_size) if b" " in sp.tokenizer.token_bytes(i)
    }
    assert space_pieces and sp.tokenizer.token_id(" ") is None  # spaces exist only as ▁
    for pattern in (r"[a-z]+ [a-z]+", r"[a-z]{1,8} [a-z]{1,8}"):
        for sampling in SAMPLINGS:
            c = run(sp, Constraint("regex", pattern), sampling=sampling, max_tokens=60)
            if pattern.endswith("+") and c.finish_reason == "length":
                assert re.fullmatch(r"[a-z]+ [a-z]*", c.text), c.text  # still on its way
                continue
            assert c.finish_reason == "stop", c.text
            assert re.fullmatch(pattern, c.text) and " " in c.text, c.text
            assert space_pieces & set(c.token_ids)


def test_a_lark_grammar(sp: Engine, bpe: Engine) -> None:
    grammar = 'start: word (" " word)*\nword: "def" | "self" | "return"'
    words = ("def", "self", "return")
    for engine in (sp, bpe):
        for sampling in SAMPLINGS:
            c = run(engine, Constraint("grammar", grammar), sampling=sampling, max_tokens=40)
            if c.finish_reason == "stop":
                assert re.fullmatch(r"(def|self|return)( (def|self|return))*", c.text), c.text
                continue
            # cut at the length: every word but the last whole, the last one begun
            assert c.finish_reason == "length" and len(c.token_ids) == 40, c.text
            *whole, last = c.text.split(" ")
            assert all(w in words for w in whole), c.text
            assert any(w.startswith(last) for w in words), c.text


def test_max_tokens_before_the_json_closes_is_length(bpe: Engine) -> None:
    c = run(bpe, Constraint("json_schema", json.dumps(PERSON)), max_tokens=5)
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


@pytest.mark.parametrize(
    ("constraint", "why"),
    [
        (Constraint("json_schema", "{not json"), "json_schema is not JSON"),
        (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
        (Constraint("json_schema", '{"type": "frobnicate"}'), "json_schema is not supported"),
        (Constraint("json_schema", '{"type": "string", "pattern": "(?<=a)b"}'), "not supported"),
        (Constraint("regex", "[a-"), "regex is not supported.*unclosed character class"),
        (Constraint("regex", ""), "regex is empty"),
        (Constraint("grammar", "start: undefined_rule"), "grammar is not supported"),
        (Constraint("xml", "<a/>"), "constraint kind 'xml' is not one of"),
    ],
)
def test_a_bad_constraint_is_refused_before_queueing_and_the_next_request_works(
    bpe: Engine, constraint: Constraint, why: str
) -> None:
    before = bpe.stats().requests_total
    with pytest.raises(InvalidRequest, match=why):
        bpe.submit(GenerateRequest("x", constraint=constraint), lambda e: None)
    assert bpe.stats().requests_total == before and bpe.stats().queue_depth == 0
    c = run(bpe, Constraint("regex", "(yes|no)"))
    assert c.finish_reason == "stop" and c.text in ("yes", "no")


def plain_greedy(engine: Engine, prompt: str, n: int) -> list[int]:
    """Greedy decoding straight on the runner: no sampler, no engine."""
    runner = engine.loaded.runner
    bos = engine.meta.bos_id
    ids = ([bos] if bos is not None and engine.meta.add_bos else []) + engine.tokenizer.encode(
        prompt
    )
    kv = runner.new_kv()
    for pos, t in enumerate(ids[:-1]):
        runner.decode(kv, t, pos)
    token, pos, out = ids[-1], len(ids) - 1, []
    while len(out) < n:
        logits = runner.decode(kv, token, pos)[: engine.tokenizer.vocab_size]
        token = int(np.argmax(logits))
        pos += 1
        if token in engine._stop_ids:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("kind", ["sp", "bpe"])
def test_unconstrained_greedy_output_is_unchanged(kind: str, request) -> None:
    engine = request.getfixturevalue(kind)
    run(engine, Constraint("regex", "(yes|no)"))  # a constrained request first: nothing leaks
    c = run(engine, None, max_tokens=16, sampling=SamplingParams(temperature=0.0))
    assert list(c.token_ids) == plain_greedy(engine, "The user is", 16)


def test_constrained_greedy_takes_the_best_allowed_token(sp: Engine) -> None:
    """Where the grammar allows every token the model would pick, nothing changes."""
    free = plain_greedy(sp, "The user is", 12)
    text = sp.tokenizer.decode(free)
    c = run(sp, Constraint("regex", re.escape(text) + ".*"), sampling=GREEDY, max_tokens=12)
    assert list(c.token_ids) == free


def test_compilation_is_cached_in_a_bounded_lru(sp: Engine) -> None:
    """The cache is bounded in bytes (each entry's measured size), not in entries."""
    compiler = ConstraintCompiler(sp.tokenizer, sp.meta.stop_ids, cache_max_bytes=1 << 20)
    c = Constraint("regex", "(cached|lru)")
    first = compiler.compile(c)
    hits = compiler.hits
    assert compiler.compile(Constraint("regex", "(cached|lru)")) is first
    assert compiler.hits == hits + 1
    for i in range(40):
        compiler.compile(Constraint("regex", f"x{{{i + 1}}}"))
        assert compiler.cache_bytes <= compiler.cache_max_bytes
        assert compiler.cache_bytes == sum(size for _, size in compiler._cache.values())
    assert all(size >= ENTRY_MIN_BYTES for _, size in compiler._cache.values())
    assert len(compiler._cache) < 40  # 40 entries of at least 64 KiB do not fit in 1 MiB
    assert compiler.compile(c) is not first  # the oldest went out


def test_token_bytes_are_what_decoding_gives(sp: Engine, bpe: Engine) -> None:
    for engine in (sp, bpe):
        tok = engine.tokenizer
        for i in range(tok.vocab_size):
            b = tok.token_bytes(i)
            if i in tok.special_ids:
                assert b == b""
                continue
            try:
                text = b.decode("utf-8")
            except UnicodeDecodeError:
                continue  # part of a character: checked in the streams' tests
            # two tokens: a leading space of the first is the stream's to drop, not the second's
            assert tok.decode([i, i]).endswith(text), (i, b)
    assert any(bpe.tokenizer.token_text(i).startswith("Ġ") for i in range(bpe.tokenizer.vocab_size))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """The three ways a vocabulary spells bytes: byte-level BPE (``Ġ``), Metaspace BPE with
    ``<0xNN>`` byte fallback (Llama 2 / Gemma tokenizer.json), and a SentencePiece model with
    byte fallback."""
    import io

    import sentencepiece as spm

    from tests.unit.tokenizer.test_tokenizer import CORPUS, _byte_level, _metaspace_byte_fallback

    root = tmp_path_factory.mktemp("toks")
    out: dict[str, Tokenizer] = {}
    for name, text in (
        ("bytelevel", _byte_level(600, CORPUS, None)),
        ("metaspace", _metaspace_byte_fallback(CORPUS)),
    ):
        (root / name).mkdir()
        (root / name / "tokenizer.json").write_text(text, encoding="utf-8")
        out[name] = load_tokenizer(root / name / "tokenizer.json")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=buf,
        vocab_size=400,
        hard_vocab_limit=False,
        byte_fallback=True,
        normalization_rule_name="identity",  # spaces, tabs and newlines kept as they are
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    (root / "sp").mkdir()
    (root / "sp" / "tokenizer.model").write_bytes(buf.getvalue())
    out["sentencepiece"] = load_tokenizer(root / "sp" / "tokenizer.model")
    return out


TEXTS = ["naïve 日本 🙂 café", "The quick brown fox", "x = [1, 2]  # tabs\tand\n", "Straße 💡"]


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace", "sentencepiece"])
def test_token_bytes_spell_the_encoded_text(tokenizers, kind: str) -> None:
    """Encoding by the library, then our bytes per id joined: the text's own UTF-8 (with the
    leading space a Metaspace or dummy prefix adds)."""
    tok = tokenizers[kind]
    for text in TEXTS:
        joined = b"".join(tok.token_bytes(i) for i in tok.encode(text))
        assert joined in (text.encode(), b" " + text.encode()), (joined, text)
    if kind != "bytelevel":  # "ß" and "💡" are not in the training text: byte pieces
        pieces = [tok.token_text(i) for i in tok.encode("Straße 💡")]
        assert "<0xF0>" in pieces and "<0xC3>" in pieces, pieces


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace", "sentencepiece"])
def test_sampler_under_a_constraint_on_every_vocabulary_kind(tokenizers, kind: str) -> None:
    """The sampler alone, fed random logits: what it picks decodes to a full match, spaces
    and multi-byte characters (byte pieces) included."""
    tok = tokenizers[kind]
    eos = max(tok.special_ids)
    compiler = ConstraintCompiler(tok, {eos})
    pattern = r"(naïve|café|日本) [a-z]{1,6}( 🙂)?"
    grammar = compiler.compile(Constraint("regex", pattern))
    for seed in range(6):
        rng = np.random.default_rng(seed)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, constraint=grammar))
        ids: list[int] = []
        for _ in range(60):
            t = sampler(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3)
            if t == eos:
                break
            ids.append(t)
        else:
            raise AssertionError(f"no end after {ids}")
        text = b"".join(tok.token_bytes(i) for i in ids).decode()
        assert re.fullmatch(pattern, text), text


def _finite(masked: np.ndarray) -> list[int]:
    return [int(i) for i in np.flatnonzero(np.isfinite(masked))]


def _sample(tok: Tokenizer, grammar, seed: int, n: int = 300) -> list[int] | None:
    """The sampler alone on random logits: the ids up to the stop token (None: no stop)."""
    eos = max(tok.special_ids)
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, constraint=grammar))
    ids: list[int] = []
    for _ in range(n):
        t = sampler(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3)
        if t == eos:
            return ids
        ids.append(t)
    return None


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace", "sentencepiece"])
def test_json_on_every_vocabulary_kind_validates(tokenizers, kind: str) -> None:
    """json_schema and json_object through the sampler on byte-level BPE, Metaspace with
    ``<0xNN>`` fallback and SentencePiece with byte fallback (which spell ``{`` as a byte
    piece where it has no ``{`` of its own), checked by jsonschema and json."""
    tok = tokenizers[kind]
    compiler = ConstraintCompiler(tok, {max(tok.special_ids)})
    person = compiler.compile(Constraint("json_schema", json.dumps(PERSON)))
    anything = compiler.compile(Constraint("json_object"))
    for seed in range(4):
        ids = _sample(tok, person, seed)
        assert ids is not None, "PERSON is bounded: it must close"
        jsonschema.validate(json.loads(b"".join(tok.token_bytes(i) for i in ids)), PERSON)
        ids = _sample(tok, anything, seed, n=120)
        if ids is not None:  # json_object is unbounded: random logits may not close it
            assert isinstance(json.loads(b"".join(tok.token_bytes(i) for i in ids)), dict)
        first = anything.start().mask(np.zeros(tok.vocab_size, np.float32))
        assert all(tok.token_bytes(i).lstrip().startswith(b"{") for i in _finite(first))


@pytest.fixture(scope="module")
def sp_kinds(tokenizers, tiny_model_dir) -> dict[str, Tokenizer]:
    """Both SentencePiece models: the tiny one (no byte fallback, ``<unk>`` for what it
    lacks) and one with byte fallback."""
    return {
        "tiny": load_tokenizer(tiny_model_dir / "tokenizer.model"),
        "byte_fallback": tokenizers["sentencepiece"],
    }


def _reference(tok: Tokenizer):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(tok.path))


@pytest.mark.parametrize("which", ["tiny", "byte_fallback"])
def test_every_ids_bytes_are_what_sentencepiece_decodes_in_context(sp_kinds, which) -> None:
    """For every id, the bytes llguidance is given against sentencepiece's own
    `id_to_piece`/`decode`: a byte piece is its byte, ``<unk>`` and control pieces are kept
    out of grammars, and any other piece is what it adds after a plain-letter piece."""
    from agent.constraint.compiler import _Tokens

    tok = sp_kinds[which]
    ref = _reference(tok)
    given = _Tokens(tok, max(tok.special_ids)).tokens
    assert len(given) == tok.vocab_size == ref.get_piece_size()
    anchor = next(i for i in range(ref.get_piece_size()) if ref.id_to_piece(i).isalpha())
    for i in range(tok.vocab_size):
        piece = ref.id_to_piece(i)
        if ref.is_control(i) or ref.is_unknown(i) or i in tok.special_ids:
            assert given[i] == b"", (i, piece)
        elif ref.is_byte(i):
            assert given[i] == bytes([int(piece[3:5], 16)]), (i, piece)
        else:
            after = ref.decode([anchor, i])
            assert after == ref.decode([anchor]) + given[i].decode(), (i, piece, after)
    assert (ref.unk_id() in range(tok.vocab_size)) == (tok.unk_id is not None)


@pytest.mark.parametrize("which", ["tiny", "byte_fallback"])
def test_encoded_text_spells_what_sentencepiece_decodes(sp_kinds, which) -> None:
    """Property: any text, encoded by sentencepiece; our bytes per id, joined, are its decode
    (the first piece's dummy-prefix space aside)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tok = sp_kinds[which]
    ref = _reference(tok)

    @settings(max_examples=150, deadline=None, database=None)
    @given(st.text(max_size=24))
    def check(text: str) -> None:
        ids = ref.encode(text)
        joined = b"".join(tok.token_bytes(i) for i in ids)
        want = ref.decode(ids).encode()
        assert joined in (want, b" " + want), (text, ids, joined, want)

    check()


@pytest.mark.parametrize("which", ["tiny", "byte_fallback"])
def test_the_encoder_llguidance_calls_spells_exactly_or_refuses(sp_kinds, which) -> None:
    """Property: what llguidance is told for forced bytes is a tokenization that spells them
    exactly, or `Unspellable`; never fewer bytes (the bug: ``{`` became no tokens at all)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from agent.constraint.compiler import Unspellable, _Tokens

    tok = sp_kinds[which]
    tokens = _Tokens(tok, max(tok.special_ids))

    @settings(max_examples=200, deadline=None, database=None)
    @given(st.text(alphabet=st.characters(codec="utf-8"), max_size=16))
    def check(text: str) -> None:
        try:
            ids = tokens(text)
        except Unspellable:
            assert which == "tiny"  # byte fallback spells every byte
            return
        assert b"".join(tokens.tokens[i] for i in ids) == text.encode(), (text, ids)
        assert all(i not in tokens.special_token_ids for i in ids)

    check()


def test_without_llguidance_a_constrained_request_names_the_extra(tiny_model_dir) -> None:
    """A 32-bit Arm board has no llguidance wheel: the import fails there as it does here."""
    code = (
        "import sys; sys.modules['llguidance'] = None\n"
        "from agent.constraint.compiler import ConstraintCompiler\n"
        "from agent.engine.types import Constraint\n"
        "from agent.base.errors import InvalidRequest\n"
        "from agent.tokenizer.load import load_tokenizer\n"
        "from pathlib import Path\n"
        f"tok = load_tokenizer(Path({str(tiny_model_dir / 'tokenizer.model')!r}))\n"
        "try:\n"
        "    ConstraintCompiler(tok, {2}).compile(Constraint('regex', 'a'))\n"
        "except InvalidRequest as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == MISSING_EXTRA, out.stderr
    assert "32-bit Arm" in MISSING_EXTRA


def test_grpc_constraint_fields_through_a_real_daemon(tmp_path, tiny_model_dir) -> None:
    import grpc

    from agent.pb.edge_agent.v1 import agent_pb2 as pb
    from tests.support.daemon_harness import Daemon

    d = Daemon(tmp_path, tiny_model_dir, '[model]\nquantization = "fp32"\n')
    try:
        client = d.client()
        pattern = r"[a-z]{1,8} [a-z]{1,8}"
        msgs = list(
            client.stream(
                pb.GenerateRequest(
                    prompt="The user is", max_tokens=40, constraint=pb.Constraint(regex=pattern)
                )
            )
        )
        text = "".join(m.text for m in msgs)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        assert re.fullmatch(pattern, text), text
        bad = pb.GenerateRequest(prompt="x", constraint=pb.Constraint(json_schema="{nope"))
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "json_schema is not JSON" in (err.value.details() or "")
        grammar = pb.GenerateRequest(
            prompt="x", max_tokens=20, constraint=pb.Constraint(grammar='start: "self"')
        )
        assert "".join(m.text for m in client.stream(grammar)) == "self"
        client.close()
    finally:
        d.stop()
