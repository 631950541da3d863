"""Structured output means what the schema means (issue 32 item 2), on real llguidance.

Every constrained JSON output here is read by a parser that refuses an object holding a key
twice and validated by ``jsonschema`` (references outside our code). The bad cases are
forced, not waited for: text is fed token by token through a compiled constraint's mask (a
deterministic adversarial test: the token that would repeat a key must be masked), and
seeded random walks over a vocabulary trained on JSON (tokens like ``":``, ``","`` that
close one key and open the next) are biased toward a two-letter key alphabet.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import numpy as np
import pytest

from agent.base.errors import AgentError, InvalidRequest
from agent.constraint.compiler import ConstraintCompiler
from agent.constraint.types import Constraint
from agent.engine.engine import Engine
from agent.engine.sampler import Sampler, SamplingParams
from agent.engine.types import GenerateRequest
from agent.tokenizer.base import Tokenizer
from agent.tokenizer.load import load_tokenizer
from tests.support.paths import FIXTURES

FIXTURES = FIXTURES / "schemas"


# ------------------------------------------------------------------------------- references


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"repeated key in {keys}")
    return dict(pairs)


def strict(text: str | bytes) -> Any:
    """json.loads refusing any object that holds a key twice."""
    return json.loads(text, object_pairs_hook=_pairs)


def valid(text: str | bytes, schema: Any) -> None:
    """The output is one JSON value without repeated keys and an instance of `schema`."""
    value = strict(text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls(schema).validate(value)


_LEX = re.compile(
    rb'(?P<closed>"(?:[^"\\]|\\.)*")|(?P<open>"(?:[^"\\]|\\.)*\\?\Z)'
    rb"|[{}\[\],:]|[^\"{}\[\],:\s]+|\s+"
)


def repeats_a_key(prefix: bytes) -> bool:
    """Whether a JSON text (complete or not) already closed a key its object held: an
    oracle written apart from the scanner under test (a regex lexer and json.loads)."""
    stack: list[set[str] | None] = []
    expect_key = False
    for m in _LEX.finditer(prefix):
        tok = m.group()
        if m.group("open") is not None:
            break  # a string still open at the end
        if m.group("closed") is not None:
            if stack and stack[-1] is not None and expect_key:
                key = json.loads(tok)
                if key in stack[-1]:
                    return True
                stack[-1].add(key)
                expect_key = False
        elif tok == b"{":
            stack.append(set())
            expect_key = True
        elif tok == b"[":
            stack.append(None)
        elif tok in (b"}", b"]"):
            stack.pop()
            expect_key = False
        elif tok == b",":
            expect_key = bool(stack) and stack[-1] is not None
        elif tok == b":":
            expect_key = False
    return False


# ---------------------------------------------------------------------------------- fixtures

JSON_CORPUS = [
    '{"a": 1, "b": 2, "ab": 3, "ba": [1, 2]}',
    '{"ab":1,"ba":2,"a":{"b":"a"},"b":[{"a":1}]}',
    '{"name": "x", "value": 12, "items": ["a", "b"], "ok": true}',
    '{"UB":0,"PT":0,"x-1":"y","x-2":null}',
    '[{"a":"b"},{"b":"a"},{"ab":"ba"}]',
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE trained on JSON: every byte, and merged tokens that hold several
    quotes (``":``, ``","``, ``{"``) as real vocabularies do."""
    from tests.unit.tokenizer.test_tokenizer import CORPUS, _byte_level

    d = tmp_path_factory.mktemp("jsontok")
    (d / "tokenizer.json").write_text(
        _byte_level(700, JSON_CORPUS * 20 + CORPUS, None), encoding="utf-8"
    )
    return load_tokenizer(d / "tokenizer.json")


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(tok, {max(tok.special_ids)})


def eos(tok: Tokenizer) -> int:
    return max(tok.special_ids)


def byte_ids(tok: Tokenizer) -> dict[int, int]:
    out: dict[int, int] = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if len(b) == 1 and i not in tok.special_ids:
            out.setdefault(b[0], i)
    return out


def drive(state, tok: Tokenizer, text: bytes) -> int:
    """Write `text` through a grammar state, each step with the longest token the mask
    allows that spells the text's next bytes (llguidance allows only its own spelling of
    forced bytes); how many bytes were written before no allowed token fit."""
    zeros = np.zeros(tok.vocab_size, np.float32)
    pos = 0
    while pos < len(text):
        allowed = np.flatnonzero(np.isfinite(state.mask(zeros)))
        fits = [int(i) for i in allowed if text.startswith(tok.token_bytes(int(i)), pos)]
        fits = [i for i in fits if tok.token_bytes(i)]
        if not fits:
            return pos
        best = max(fits, key=lambda i: len(tok.token_bytes(i)))
        state.advance(best)
        pos += len(tok.token_bytes(best))
    return pos


def feed(compiler: ConstraintCompiler, tok: Tokenizer, schema: Any, text: str) -> str:
    """`text` written through `schema`'s constraint: "accepted" (all of it, then the end),
    "prefix" (all of it, not complete) or "masked at N" (no allowed token at byte N)."""
    state = compiler.compile(Constraint("json_schema", json.dumps(schema))).start()
    data = text.encode()
    pos = drive(state, tok, data)
    if pos < len(data):
        return f"masked at {pos}"
    return (
        "accepted"
        if np.isfinite(state.mask(np.zeros(tok.vocab_size, np.float32))[eos(tok)])
        else "prefix"
    )


def walk(compiled, tok: Tokenizer, seed: int, favour: bytes, n: int = 400) -> bytes | None:
    """The sampler on seeded random logits, tokens made of `favour`'s bytes pushed up: the
    output up to the stop token (None: no stop within `n`)."""
    rng = np.random.default_rng(seed)
    bias = np.array(
        [
            3.0 if b and set(b) <= set(favour) else 0.0
            for b in (tok.token_bytes(i) for i in range(tok.vocab_size))
        ],
        np.float32,
    )
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, constraint=compiled))
    out = b""
    for _ in range(n):
        t = sampler(rng.standard_normal(tok.vocab_size).astype(np.float32) + bias)
        if t == eos(tok):
            return out
        out += tok.token_bytes(t)
        assert not repeats_a_key(out), out
    return None


# ------------------------------------------------------------------------- keys never repeat

FREE_KEYS = {
    "json_object": {"type": "object"},
    "map": {"type": "object", "additionalProperties": {"type": "integer"}},
    "map with a declared key": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": {"type": "integer"},
    },
    "infinite pattern": {
        "type": "object",
        "patternProperties": {"^[ab]+$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "additionalProperties": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
}


@pytest.mark.parametrize("name", list(FREE_KEYS))
def test_the_token_that_would_repeat_a_key_is_masked(compiler, tok, name: str) -> None:
    """After ``{"ab":1,"ab`` (or the same one level down) no allowed token closes the key,
    a multi-quote token included; a key of another object may be the same."""
    schema = FREE_KEYS[name]
    first = {"nested": '{"ab":{"ab":1},"ab', "map with a declared key": '{"a":1,"ab":1,"ab'}.get(
        name, '{"ab":1,"ab'
    )
    state = compiler.compile(Constraint("json_schema", json.dumps(schema))).start()
    assert drive(state, tok, first.encode()) == len(first)
    masked = state.mask(np.zeros(tok.vocab_size, np.float32))
    allowed = [int(i) for i in np.flatnonzero(np.isfinite(masked))]
    assert allowed, "something other than the repeat must go on"
    assert not [i for i in allowed if repeats_a_key(first.encode() + tok.token_bytes(i))]
    closing = [i for i in range(tok.vocab_size) if tok.token_bytes(i).startswith(b'"')]
    assert not np.isfinite(masked[closing]).any()
    if name == "nested":  # the same key in a new object is no repeat
        assert feed(compiler, tok, schema, '{"ab":{"ab":1},"b":{"ab":2}}') == "accepted"
    else:
        assert feed(compiler, tok, schema, first + 'b":2}') == "accepted"


@pytest.mark.parametrize(
    "prefix",
    ['{"a\\"":1,"a\\"', '{"ab":{"cd":1},"ab', '{"ab":1,"b":"x', '{"ab":1,"b":[', '{"ab":1,"c":2,'],
)
def test_no_allowed_token_repeats_a_key_from_any_state(compiler, tok, prefix: str) -> None:
    """Inside an escaped key, a nested object's sibling key, a value, an array, after a
    comma: the guard masks exactly the tokens the grammar allows that the oracle says repeat
    a key, no more."""
    state = compiler.compile(Constraint("json_object", "")).start()
    assert drive(state, tok, prefix.encode()) == len(prefix)
    zeros = np.zeros(tok.vocab_size, np.float32)
    grammar = np.isfinite(state._inner.mask(zeros))  # the grammar's own mask, unguarded
    guarded = np.isfinite(state.mask(zeros))
    removed = {int(i) for i in np.flatnonzero(grammar & ~guarded)}
    repeats = {
        int(i)
        for i in np.flatnonzero(grammar)
        if repeats_a_key(prefix.encode() + tok.token_bytes(int(i)))
    }
    assert removed == repeats
    assert guarded.any()


@pytest.mark.parametrize("name", list(FREE_KEYS))
def test_random_walks_biased_to_repeat_keys_never_do(compiler, tok, name: str) -> None:
    """Seeded walks over a two-letter key alphabet: every prefix free of repeated keys, every
    finished output valid (json_object and maps bounded by maxProperties to finish)."""
    schema = {**FREE_KEYS[name], "maxProperties": 5}
    compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    finished = 0
    for seed in range(12):
        out = walk(compiled, tok, seed, favour=b'{}ab":,1')
        if out is not None:
            valid(out, schema)
            finished += 1
    assert finished >= 6


def test_the_reported_pattern_case_is_refused_naming_why(compiler) -> None:
    """``{"UB":0,"PT":0,"PT":0}`` was answered: two names, three properties asked."""
    schema = {
        "type": "object",
        "patternProperties": {"^(UB|PT)$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 3,
    }
    with pytest.raises(InvalidRequest, match=r"minProperties 3 .*2 distinct keys.* at \$$"):
        compiler.compile(Constraint("json_schema", json.dumps(schema)))


def test_finite_patterns_are_written_out_once_each(compiler, tok) -> None:
    schema = {
        "type": "object",
        "patternProperties": {"^(UB|PT)$": {"type": "integer"}, "^x-[0-2]$": {"type": "string"}},
        "additionalProperties": False,
        "minProperties": 2,
    }
    assert feed(compiler, tok, schema, '{"UB":0,"PT":0,"PT"').startswith("masked")
    compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    for seed in range(6):
        out = walk(compiled, tok, seed, favour=b'{}UBPT":,0x-1')
        assert out is not None
        value = strict(out)
        valid(out, schema)
        assert len(value) >= 2


def test_an_escaped_key_is_no_way_around_a_declared_one(compiler, tok) -> None:
    """``"\\u0061"`` is the key ``a``: it slipped past ``a``'s own schema as an extra key."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert feed(compiler, tok, schema, '{"\\u0061":"x"}').startswith("masked")
    assert feed(compiler, tok, schema, '{"a":1,"\\u0061"').startswith("masked")


def test_min_properties_count_distinct_keys(compiler, tok) -> None:
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}
    assert feed(compiler, tok, schema, '{"a":1,"a"').startswith("masked")
    assert feed(compiler, tok, schema, '{"a":1,"b":2}') == "masked at 12"  # no } yet
    assert feed(compiler, tok, schema, '{"a":1,"b":2,"c":3}') == "accepted"


def test_when_only_a_repeat_could_go_on_the_request_fails_clearly(compiler, tok) -> None:
    """``^(a|b+)$``: after ``"a"`` is used, ``"a`` can only close as a repeat."""
    from agent.base.errors import ConstraintFailed

    schema = {
        "type": "object",
        "patternProperties": {"^(a|b+)$": {"type": "integer"}},
        "additionalProperties": False,
    }
    state = compiler.compile(Constraint("json_schema", json.dumps(schema))).start()
    assert drive(state, tok, b'{"a":1,"a') == 9
    with pytest.raises(ConstraintFailed, match="repeats a key"):
        state.mask(np.zeros(tok.vocab_size, np.float32))


# ----------------------------------------------------------------------------- other meanings


def test_declared_properties_only_where_extra_keys_are_merely_allowed(compiler, tok) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    assert feed(compiler, tok, schema, '{"a":1,"c":2}').startswith("masked")
    assert feed(compiler, tok, schema, '{"a":1,"b":"x"}') == "accepted"


def test_optional_properties_under_min_and_max_properties(compiler, tok) -> None:
    """llguidance refused min/maxProperties unless every declared key is required."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {}},
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 2,
    }
    compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    for seed in range(4):
        out = walk(compiled, tok, seed, favour=b'{}abc":,1')
        assert out is not None
        valid(out, schema)


def test_unique_items_and_dependencies_are_kept_by_a_subset_not_refused(compiler, tok) -> None:
    """llguidance refused ``uniqueItems`` and ``dependentRequired`` (SchemaStore: 86 and 9
    schemas); arrays of at most one item are unique, and a dependency always met holds."""
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    dependent = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]},
    }
    assert feed(compiler, tok, unique, "[1,1]") != "accepted"
    assert feed(compiler, tok, dependent, '{"a":1}') != "accepted"
    for schema in (unique, dependent):
        compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
        for seed in range(4):
            out = walk(compiled, tok, seed, favour=b'{}[]ab":,1')
            assert out is not None
            valid(out, schema)
    with pytest.raises(InvalidRequest, match="uniqueItems"):  # two distinct items: refused
        compiler.compile(Constraint("json_schema", json.dumps({**unique, "minItems": 2})))


def test_property_names_over_declared_keys_leave_out_the_keys_they_refuse(compiler, tok) -> None:
    """llguidance refused ``propertyNames`` (SchemaStore: 13 schemas)."""
    schema = {
        "type": "object",
        "properties": {"ab": {"type": "integer"}, "abc": {"type": "integer"}},
        "propertyNames": {"maxLength": 2},
    }
    assert feed(compiler, tok, schema, '{"abc":1}') != "accepted"
    compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    for seed in range(4):
        out = walk(compiled, tok, seed, favour=b'{}abc":,1')
        assert out is not None
        valid(out, schema)
    with pytest.raises(InvalidRequest, match=r"propertyNames refuses the required key 'abc' at \$"):
        compiler.compile(Constraint("json_schema", json.dumps({**schema, "required": ["abc"]})))
    free = {"type": "object", "propertyNames": {"maxLength": 2}}  # free keys: still refused
    with pytest.raises(InvalidRequest, match="propertyNames"):
        compiler.compile(Constraint("json_schema", json.dumps(free)))
    named = {  # a pattern over free keys: the keys' own pattern
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "propertyNames": {"type": "string", "pattern": "^b+$"},
        "maxProperties": 3,
    }
    assert feed(compiler, tok, named, '{"a":1}') != "accepted"
    compiled = compiler.compile(Constraint("json_schema", json.dumps(named)))
    for seed in range(4):
        out = walk(compiled, tok, seed, favour=b'{}ab":,1')
        assert out is not None
        valid(out, named)


def test_a_requests_own_x_guidance_cannot_switch_off_checks(compiler) -> None:
    schema = {"x-guidance": {"lenient": True}, "type": "string", "format": "no-such-format"}
    with pytest.raises(InvalidRequest, match="format"):
        compiler.compile(Constraint("json_schema", json.dumps(schema)))


# (schema, text outside its bounds that llguidance 1.9.1 accepted)
OUTSIDE = [
    ({"type": "integer", "exclusiveMaximum": 9223372036854775807}, "9223372036854775807"),
    ({"type": "integer", "minimum": 9007199254740993}, "9007199254740992"),
    ({"type": "integer", "maximum": -9007199254740993}, "-9007199254740992"),
    ({"type": "number", "maximum": -943.3050469559873}, "-943.3050469559872"),
    ({"type": "number", "maximum": 99.99999999999999}, "100.0"),
    ({"type": "number", "minimum": -13686411759758.807}, "-13686411759758.809"),
    ({"type": "number", "exclusiveMinimum": 0.1}, "0.10000000000000001"),
    ({"type": "number", "exclusiveMaximum": 1}, "0.99999999999999999999"),
]


@pytest.mark.parametrize(("schema", "text"), OUTSIDE, ids=lambda v: str(v)[:40])
def test_numbers_outside_their_bounds_are_masked(compiler, tok, schema, text: str) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)  # the reference agrees it is outside
    assert feed(compiler, tok, schema, text) != "accepted"


def test_integer_bounds_the_engine_cannot_keep_are_refused(compiler) -> None:
    """``minimum: 2^63`` was answered ``2^63-1`` (the bound clamped)."""
    schema = {"type": "integer", "minimum": 2**63, "maximum": 2**63 + 10}
    with pytest.raises(InvalidRequest, match=r"integer range .* at \$$"):
        compiler.compile(Constraint("json_schema", json.dumps(schema)))
    nested = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2**64}}}
    with pytest.raises(InvalidRequest, match=r"at \$\.properties\.n$"):
        compiler.compile(Constraint("json_schema", json.dumps(nested)))


def test_wide_bounds_are_narrowed_not_refused(compiler, tok) -> None:
    """llguidance refused number bounds past ~9.2e18 and ones nearer 0 than ~1e-66; a
    narrower range is still the schema's."""
    for schema in (
        {"type": "number", "maximum": 1e20},
        {"type": "number", "minimum": -1e300, "maximum": 1e300},
        {"type": "number", "exclusiveMinimum": 1e-200},
        {"type": "integer", "maximum": 2**63 - 1},
    ):
        assert feed(compiler, tok, schema, "1") in ("accepted", "prefix"), schema
        compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
        for seed in range(3):
            out = walk(compiled, tok, seed, favour=b"0123456789.")
            if out is not None:
                valid(out, schema)


@pytest.mark.parametrize("bound", [2**53 + 1, 2**58 + 3, -(2**55) - 7, 10**17 + 1, 123456789])
def test_integer_bounds_are_exact(compiler, tok, bound: int) -> None:
    """The rewritten bound lets in only integers the original allows, whatever llguidance's
    float conversion does (checked at the bound, one past it, and one inside)."""
    for kw, inside, outside in (
        ("minimum", bound + 64, bound - 1),
        ("maximum", bound - 64, bound + 1),
        ("exclusiveMinimum", bound + 64, bound),
        ("exclusiveMaximum", bound - 64, bound),
    ):
        schema = {"type": "integer", kw: bound}
        assert feed(compiler, tok, schema, str(outside)) != "accepted", (kw, outside)
        assert feed(compiler, tok, schema, str(inside)) == "accepted", (kw, inside)


# -------------------------------------------------------------------------- the final check


def test_the_final_check_turns_a_wrong_output_into_an_error(tok, compiler) -> None:
    """A grammar state whose output breaks the schema it is checked against (never the case
    by construction): the stop ends in an error, not in a silent "stop"."""
    from agent.base.errors import ConstraintFailed
    from agent.constraint.json_keys import DistinctKeys, check_output, loads_distinct

    assert check_output(b'{"a":1}', {"type": "object"}) is None
    assert "twice" in (check_output(b'{"a":1,"a":2}', {"type": "object"}) or "")
    assert "$['a']" in (
        check_output(b'{"a":"x"}', {"properties": {"a": {"type": "integer"}}}) or ""
    )
    with pytest.raises(ValueError, match="twice"):
        loads_distinct('{"a":{"b":1,"b":2}}')
    regex = compiler.compile(Constraint("regex", r'\{"a":"x"\}'))
    bytes_ = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    schema = '{"properties": {"a": {"type": "integer"}}}'
    state = DistinctKeys(regex.start(), bytes_, {eos(tok)}, schema)
    assert drive(state, tok, b'{"a":"x"}') == 9
    state.mask(np.zeros(tok.vocab_size, np.float32))
    with pytest.raises(ConstraintFailed, match=r"final check: \$\['a'\]"):
        state.advance(eos(tok))


# ------------------------------------------------------------- real schemas, the real model


def suite_schemas() -> list[tuple[str, Any]]:
    """JSON-Schema-Test-Suite draft 4 (tests/fixtures/schemas): every schema of its keyword
    tests, named by file and description."""
    out = []
    for path in sorted((FIXTURES / "draft4").glob("*.json")):
        for group in json.loads(path.read_text(encoding="utf-8")):
            out.append((f"{path.stem}: {group['description']}", group["schema"]))
    return out


def test_every_test_suite_schema_is_refused_or_only_writes_its_instances(compiler, tok) -> None:
    """Each schema of the test suite compiles (then seeded walks give only valid instances,
    checked by jsonschema under draft 4) or is refused with an InvalidRequest, never anything
    else."""
    schemas = suite_schemas()
    assert len(schemas) > 60
    compiled_n = 0
    for name, schema in schemas:
        schema = {"$schema": "http://json-schema.org/draft-04/schema#", **schema}
        try:
            compiled = compiler.compile(Constraint("json_schema", json.dumps(schema)))
        except InvalidRequest:
            continue
        compiled_n += 1
        for seed in range(2):
            try:
                out = walk(compiled, tok, seed, favour=b'{}[]ab":,01', n=150)
            except AgentError as exc:  # a dead end is an error, never a wrong output
                assert "repeats a key" in str(exc), (name, exc)
                continue
            if out is not None:
                try:
                    valid(out, schema)
                except (ValueError, jsonschema.ValidationError) as exc:
                    raise AssertionError(f"{name}: {out!r}: {exc}") from exc
    assert compiled_n > len(schemas) // 2


@pytest.fixture(scope="module")
def bpe(tiny_model_dir, dev_profile_data, tmp_path_factory) -> Engine:
    """The tiny model with a byte-level BPE tokenizer.json (every printable ASCII byte)."""
    from agent.profile import parse_profile, profiles_dir
    from tests.unit.chat.test_chat import BOOM, make_chat_dir
    from tests.unit.chat.test_chat import source as template_source

    profile = parse_profile(dev_profile_data, profiles_dir() / "generic-x86_64.toml")
    d = make_chat_dir(
        tiny_model_dir, tmp_path_factory.mktemp("bpe") / "model", BOOM + template_source("chatml")
    )
    e = Engine.load(profile, d, quantization="fp32")
    yield e
    e.close()


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "maxProperties": 4},
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 4},
        {
            "type": "object",
            "patternProperties": {"^(UB|PT)$": {"type": "integer"}},
            "additionalProperties": False,
            "minProperties": 2,
        },
        {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**63 - 1}}},
    ],
    ids=["object", "map", "patterns", "int64"],
)
def test_the_tiny_model_answers_only_instances(bpe: Engine, schema) -> None:
    """Through the engine (real LiteRT, real llguidance), seeded sampling: every answer that
    ends as "stop" is a valid instance without repeated keys."""
    stopped = 0
    for seed in range(4):
        c = bpe.complete(
            GenerateRequest(
                "The user is",
                constraint=Constraint("json_schema", json.dumps(schema)),
                max_tokens=80,
                sampling=SamplingParams(temperature=1.0, seed=seed),
            )
        )
        assert c.finish_reason in ("stop", "length"), (c.finish_reason, c.text)
        if c.finish_reason == "stop":
            valid(c.text, schema)
            stopped += 1
    assert stopped >= 1
