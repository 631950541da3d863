"""SentencePiece tokenizer: exact round trips and streaming that never splits a character."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.errors import InvalidRequest, ModelFormatError
from agent.modeldir import demo_model_dir
from agent.runtime.tokenizer import Tokenizer

# U+2581 is SentencePiece's own space marker; text containing it cannot round-trip by design.
texts = st.text(st.characters(blacklist_characters="\u2581", blacklist_categories=("Cs",)))


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer(demo_model_dir() / "tokenizer.model")


@pytest.fixture(scope="module")
def dummy_prefix(tmp_path_factory) -> Tokenizer:
    """A tokenizer trained the usual way for prose: NFKC, dummy prefix, byte fallback."""
    lines = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(300)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=400,
        hard_vocab_limit=False,
        byte_fallback=True,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("spm") / "prose.model"
    path.write_bytes(buf.getvalue())
    return Tokenizer(path)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    s = tok.stream()
    return [s.push(i) for i in ids] + [s.flush()]


@settings(max_examples=300, deadline=None)
@given(texts)
def test_demo_round_trip_is_exact_and_streams_whole_characters(demo: Tokenizer, text: str) -> None:
    ids = demo.encode(text)
    deltas = stream(demo, ids)
    assert "".join(deltas) == text  # identity normalization + byte fallback: exact
    assert "".join(deltas) == demo._sp.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # never half a character


@settings(max_examples=200, deadline=None)
@given(texts)
def test_stream_matches_sentencepiece_with_dummy_prefix(dummy_prefix: Tokenizer, text) -> None:
    ids = dummy_prefix.encode(text)
    assert "".join(stream(dummy_prefix, ids)) == dummy_prefix._sp.decode(ids)


def test_a_four_byte_character_appears_only_when_complete(demo: Tokenizer) -> None:
    ids = demo.encode("\U0001f642")  # not in the vocabulary: four byte-fallback pieces
    assert len(ids) == 4
    s = demo.stream()
    assert [s.push(i) for i in ids] == ["", "", "", "\U0001f642"]


def test_an_incomplete_tail_is_reported_not_dropped(demo: Tokenizer) -> None:
    ids = demo.encode("a\u00e9")  # é = two bytes
    byte_ids = [i for i in ids if demo._sp.is_byte(i)]
    s = demo.stream()
    out = "".join(s.push(i) for i in ids[: len(ids) - 1])
    if byte_ids:
        assert out == "a"
        assert s.flush() == "\ufffd"


def test_control_tokens_decode_to_nothing(demo: Tokenizer) -> None:
    bos, eos = 1, 2
    assert demo._sp.is_control(bos) and demo._sp.is_control(eos)
    assert demo.decode([bos, *demo.encode("x = 1"), eos]) == "x = 1"


def test_out_of_range_id_is_an_invalid_request(demo: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="out of range"):
        demo.token_bytes(demo.vocab_size)


def test_not_a_tokenizer_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelFormatError, match="not a SentencePiece model"):
        Tokenizer(bad)
