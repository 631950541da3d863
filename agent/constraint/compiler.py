"""Structured output: a `Constraint` compiled into a token mask by llguidance, checked against
`agent.constraint.limits` first and compiled on `agent.constraint.worker`'s thread under a
deadline; compiled grammars are kept in an LRU bounded in bytes. llguidance reads each token's
exact bytes from our tokenizer.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.base.errors import ConstraintFailed, InvalidRequest, RuntimeFailure
from agent.constraint.json_keys import GrammarState, distinct_keys
from agent.constraint.limits import LIMITS, check_lark, check_pattern, check_schema, parse_schema
from agent.constraint.schema_rewrite import rewrite_schema
from agent.constraint.types import CONSTRAINT_KINDS, Constraint
from agent.constraint.worker import COMPILE_TIMEOUT_S, CompileWorker, rss_bytes
from agent.tokenizer.base import Tokenizer

log = logging.getLogger(__name__)

CACHE_MAX_BYTES = 64 << 20  # compiled grammars kept per engine, by their measured size
ENTRY_MIN_BYTES = 64 << 10  # an entry counts at least this (an RSS delta can read as ~0)
MAX_CONSTRAINT_CHARS = LIMITS.max_chars
# llguidance's own limits: no internal state in its messages; lexer states (1-2 kB each) are
# what a grammar grows while it generates, so they bound a cached entry's later growth
PARSER_LIMITS = {"verbose_errors": False, "max_lexer_states": 20_000}
MISSING_EXTRA = (
    "structured output needs llguidance, which is not installed here: it is part of the "
    "default install wherever it has a wheel (x86_64, aarch64), and 32-bit Arm has none"
)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise InvalidRequest(MISSING_EXTRA) from exc
    return llguidance


class Unspellable(ValueError):
    """The grammar forces bytes that no sequence of this vocabulary's tokens spells."""


class _Tokens:
    """What llguidance's `TokenizerWrapper` reads: every id's bytes, EOS, and an encoder.

    llguidance tokenizes the bytes a grammar forces (``afé`` after ``c`` in ``café``) and
    allows only that tokenization's first token, so the encoder must spell exactly the bytes
    it is given, as they would continue the output. Our tokenizers do that for most text, but
    a SentencePiece dummy prefix or a Metaspace ``prepend_scheme`` adds a leading ``▁``:
    allowing only that space where ``a`` is forced would end in a dead end. Such text is
    spelled by the longest matching tokens instead.

    Text that no tokens spell at all (a ``{`` in a vocabulary with neither a ``{`` piece nor
    byte fallback, which the tiny SentencePiece model is) is `Unspellable`: llguidance trusts
    whatever tokenization it gets, and one that spells less than the forced bytes made it
    treat them as written and allow tokens of what follows (a ``"`` where ``{`` was forced),
    which the matcher then refused. The unknown piece is never grammar text: its ``⁇`` is a
    rendering, not what the model meant, so it is kept out like a special token.
    """

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos
        self.bos_token_id: int | None = None
        unk = tokenizer.unk_id
        special = tokenizer.special_ids | ({unk} if unk is not None else set())
        self.special_token_ids = sorted(special)
        self.tokens = [
            b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)
        ]
        self._ids: dict[bytes, int] = {}
        for i in reversed(range(len(self.tokens))):  # the lowest id of equal spellings wins
            if self.tokens[i] and i not in special:
                self._ids[self.tokens[i]] = i
        self._longest = max((len(b) for b in self._ids), default=1)
        self._failed = threading.local()  # what the last encoding on this thread could not spell

    def __call__(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        ids = self._tok.encode(text)
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        ids = self.greedy(data)
        spelled = sum(len(self.tokens[i]) for i in ids)
        if spelled != len(data):
            char = data[spelled : spelled + 4].decode("utf-8", "replace")[:1]
            self._failed.char = char
            raise Unspellable(f"no token spells {char!r}")
        return ids

    def unspellable(self) -> str | None:
        """The character the last failed encoding on this thread stopped at (then forgotten)."""
        char: str | None = getattr(self._failed, "char", None)
        self._failed.char = None
        return char

    def greedy(self, data: bytes) -> list[int]:
        """`data` as the longest tokens that spell it (up to a byte no token holds)."""
        out: list[int] = []
        pos = 0
        while pos < len(data):
            for n in range(min(self._longest, len(data) - pos), 0, -1):
                i = self._ids.get(data[pos : pos + n])
                if i is not None:
                    out.append(i)
                    pos += n
                    break
            else:
                return out
        return out


def _unspellable_message(char: str) -> str:
    return (
        f"the grammar needs {char!r} next, which no token of this model's vocabulary spells "
        "(it has no such piece and no byte fallback)"
    )


class ConstraintState:
    """One request's position in its grammar.

    The mask and the applied token always agree: `advance` refuses a token the last mask did
    not allow (a sampler bug, never a silently wrong token), and the matcher refusing one the
    mask allowed is an error too, never skipped.

    Per request, `CompiledConstraint.start()` gives a `ConstraintState` (the matcher's copy, owned
    by the request's `Sampler` like its RNG): before each draw it masks every token that would leave
    the language (a stop token is allowed only where the grammar accepts), and after the draw it
    advances on the chosen token.
    """

    __slots__ = ("_allowed", "_bits", "_matcher", "_np", "_stop", "_tokens", "_vocab")

    def __init__(
        self, matcher: Any, stop_ids: npt.NDArray[np.intp], vocab: int, tokens: _Tokens
    ) -> None:
        import llguidance.numpy as llnp

        self._np = llnp
        self._matcher = matcher
        self._stop = stop_ids
        self._vocab = vocab
        self._tokens = tokens
        self._bits = llnp.allocate_token_bitmask(1, vocab)
        self._allowed: npt.NDArray[np.bool_] | None = None

    def _why(self) -> str:
        data = self._tokens.unspellable()
        if data is not None:
            return _unspellable_message(data)
        return library_message(self._matcher.get_error())

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """`logits` with every token the grammar forbids here at -inf (a new array)."""
        if logits.shape != (self._vocab,):
            raise RuntimeFailure(
                f"constraint: logits of shape {logits.shape} for a vocabulary of {self._vocab}"
            )
        m = self._matcher
        self._np.fill_next_token_bitmask(m, self._bits)
        if m.is_error():
            raise ConstraintFailed(f"constraint: {self._why()}")
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab]
        allowed[self._stop] = m.is_accepting()
        if not allowed.any():
            raise ConstraintFailed("constraint: no token can continue the output")
        self._allowed = allowed.view(np.bool_)
        return np.where(self._allowed, logits, np.float32(-np.inf))

    def advance(self, token: int) -> None:
        """The sampler chose `token` (a stop token ends the request: nothing to consume)."""
        allowed, self._allowed = self._allowed, None
        if allowed is None or not 0 <= token < self._vocab or not allowed[token]:
            raise RuntimeFailure(f"constraint: token {token} was not allowed by the mask")
        if token in self._stop:
            return
        if not self._matcher.consume_token(token):
            raise ConstraintFailed(f"constraint: token {token} refused: {self._why()}")


class CompiledConstraint:
    """A compiled grammar; `start()` gives each request its own matcher."""

    def __init__(
        self,
        constraint: Constraint,
        matcher: Any,
        stop_ids: Iterable[int],
        vocab: int,
        tokens: _Tokens,
    ) -> None:
        self.constraint = constraint
        self._matcher = matcher
        self._stop = np.array(sorted(stop_ids), dtype=np.intp)
        self._vocab = vocab
        self._tokens = tokens

    def start(self) -> GrammarState:
        state = ConstraintState(self._matcher.deep_copy(), self._stop, self._vocab, self._tokens)
        c = self.constraint  # JSON: no object holds a key twice (agent.constraint.json_keys)
        return distinct_keys(state, c.kind, c.text, self._tokens.tokens, self._stop)


def _one_line(message: str, limit: int = 400) -> str:
    """The library's (multi-line) message as one line, bounded."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# llguidance's words → ours, for the messages a client sees
_LIBRARY_WORDS = {
    "NoExtensionBias": "the grammar accepts no output here (a rule or $ref that never reaches "
    "a value?)",
    "too many expressions constructed": "its patterns grew past the constraint library's "
    "limit (large or nested repetitions)",
    "ParserTooComplex": "the grammar is too ambiguous for the constraint library's limits",
    "LexerTooComplex": "a pattern is too complex for the constraint library's limits",
}


def library_message(message: str) -> str:
    """What llguidance said, in one bounded line without its internal state dump."""
    first = str(message).split("<state>", 1)[0].replace("<non-verbose/>", "")
    for words, ours in _LIBRARY_WORDS.items():
        if words in first:
            return ours
    return _one_line(first, 300)


def grammar_text(llg: Any, constraint: Constraint) -> str:
    """The constraint as llguidance's grammar, or InvalidRequest for one it cannot take or
    one past `agent.constraint.limits`."""
    kind, text = constraint.kind, constraint.text
    if kind not in CONSTRAINT_KINDS:
        raise InvalidRequest(
            f"constraint kind {kind!r} is not one of {', '.join(CONSTRAINT_KINDS)}"
        )
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"{kind} is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS}")
    if kind == "json_object":
        text = '{"type": "object"}'
        kind = "json_schema"
    if kind == "json_schema":
        schema = parse_schema(text)
        if not isinstance(schema, dict | bool):
            raise InvalidRequest("json_schema must be a JSON object (a schema)")
        check_schema(schema)
        schema = rewrite_schema(schema).schema  # what the schema means, not only its syntax
        try:
            return str(
                llg.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False}
                )
            )
        except ValueError as exc:
            raise InvalidRequest(
                f"json_schema is not supported: {library_message(str(exc))}"
            ) from exc
    if not text:
        raise InvalidRequest(f"{kind} is empty")
    if kind == "regex":
        check_pattern(text)
        return str(llg.LLMatcher.grammar_from_regex(text))
    check_lark(text)
    return str(llg.LLMatcher.grammar_from_lark(text))


class ConstraintCompiler:
    """Compiles constraints for one tokenizer on a worker thread; thread-safe, with a cache
    bounded in bytes.

    `ConstraintCompiler` (one per engine, on its tokenizer) turns a request's `Constraint` into a
    `CompiledConstraint` before the request is queued: the text is first measured against
    `agent.constraint.limits` (llguidance overflows its stack or balloons past them), then compiled
    on `agent.constraint.worker`'s worker thread under a deadline. A grammar the library or a limit
    refuses is an `InvalidRequest` naming why, in one line of our words. Compiled grammars are kept
    in an LRU bounded in bytes (each entry's size measured as the process's RSS growth while it
    compiled) keyed by (kind, text), so a schema used again costs a copy of its matcher, not a
    compilation.

    llguidance is fed from our own tokenizer: each id's exact bytes (`Tokenizer.token_bytes`:
    SentencePiece ``▁`` as a space and ``<0xNN>`` pieces as their byte, byte-level BPE's ``Ġ``
    alphabet undone), so a grammar that needs a space gets the tokens that hold one. It is in the
    default install wherever it has a wheel; 32-bit Arm has none, and there a constrained request is
    refused with one line saying so (`MISSING_EXTRA`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_ids: Iterable[int],
        *,
        cache_max_bytes: int = CACHE_MAX_BYTES,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = frozenset(stop_ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], tuple[CompiledConstraint, int]] = OrderedDict()
        self.cache_max_bytes = cache_max_bytes
        self.cache_bytes = 0
        self._timeout = timeout_s
        self._worker: CompileWorker | None = None
        self._lltok: Any = None
        self._tokens: _Tokens | None = None
        self.hits = 0
        self.misses = 0

    def _ll_tokenizer(self, llg: Any) -> Any:
        if self._lltok is None:
            if not self._stop:
                raise InvalidRequest(
                    "structured output needs a model with an end-of-sequence token"
                )
            self._tokens = _Tokens(self._tokenizer, min(self._stop))
            wrapped = llg.TokenizerWrapper(self._tokens)
            self._lltok = llg.LLTokenizer(wrapped, n_vocab=self._tokenizer.vocab_size)
        return self._lltok

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled constraint (cached), or InvalidRequest naming what is unsupported or
        which limit it passes; Overloaded when too many compiles already wait."""
        key = (constraint.kind, constraint.text if constraint.kind != "json_object" else "")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit[0]
            if self._worker is None:
                self._worker = CompileWorker()
            worker = self._worker
        what = f"{constraint.kind} ({len(constraint.text)} characters)"
        compiled, size = worker.run(lambda: self._build(constraint), self._timeout, what)
        with self._lock:
            self.misses += 1
            if key not in self._cache:
                self._cache[key] = (compiled, size)
                self.cache_bytes += size
            while self.cache_bytes > self.cache_max_bytes and len(self._cache) > 1:
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cache_bytes -= dropped
        log.info(
            "constraint compiled: %s, %d characters, ~%d KiB",
            constraint.kind,
            len(constraint.text),
            size >> 10,
        )
        return compiled

    def _build(self, constraint: Constraint) -> tuple[CompiledConstraint, int]:
        """On the worker: check, compile, take the first mask; the entry's measured size."""
        llg = _llguidance()
        with self._lock:  # the token table, built once, is not the entry's
            lltok = self._ll_tokenizer(llg)
            tokens = self._tokens
        before = rss_bytes()
        grammar = grammar_text(llg, constraint)
        assert tokens is not None
        limits = llg.LLParserLimits(**PARSER_LIMITS)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, lltok, limits=limits
        )
        if is_error:
            why = library_message(messages[0])
            raise InvalidRequest(f"{constraint.kind} is not supported: {why}")
        matcher = llg.LLMatcher(lltok, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            why = library_message(matcher.get_error())
            raise InvalidRequest(f"{constraint.kind} is not supported: {why}")
        compiled = CompiledConstraint(
            constraint, matcher, self._stop, self._tokenizer.vocab_size, tokens
        )
        try:  # the first mask: a grammar this vocabulary cannot even start is the request's fault
            compiled.start().mask(np.zeros(self._tokenizer.vocab_size, dtype=np.float32))
        except ConstraintFailed as exc:
            why = str(exc).removeprefix("constraint: ")
            raise InvalidRequest(f"{constraint.kind} cannot be written by this model: {why}") from (
                exc
            )
        size = max(rss_bytes() - before, ENTRY_MIN_BYTES, 16 * len(grammar))
        return compiled, size
