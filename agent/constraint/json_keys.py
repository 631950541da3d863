"""Keys kept distinct while a JSON output is generated: a grammar cannot remember which keys an
object already holds, so `DistinctKeys` masks tokens that would repeat one, and
`check_output` re-reads the finished output against the request's schema.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from agent.base.errors import ConstraintFailed, RuntimeFailure

log = logging.getLogger(__name__)

QUOTE, BACKSLASH = 0x22, 0x5C
JSON_KINDS = ("json_schema", "json_object")
OBJECT_SCHEMA = '{"type": "object"}'


class GrammarState(Protocol):
    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...

    def advance(self, token: int) -> None: ...


class _Scanner:
    """Where a JSON text is: open containers (an object's keys, or None for an array), the
    key being written, and whether the next string of the current object is a key."""

    __slots__ = ("escape", "expect_key", "in_key", "in_string", "key", "stack")

    def __init__(self) -> None:
        self.stack: list[set[bytes] | None] = []
        self.in_string = self.in_key = self.escape = self.expect_key = False
        self.key = bytearray()

    def holds_keys(self) -> bool:
        return any(frame for frame in self.stack)

    def feed(self, data: bytes, commit: bool) -> bool:
        """Run `data` on; False if it closes a key its object already holds. With `commit`
        false nothing is changed (the open objects' key sets are only read)."""
        stack = self.stack if commit else list(self.stack)
        fresh: set[int] = set()  # objects opened within `data` (free to change when trying)
        added: dict[int, set[bytes]] = {}  # keys `data` closes in objects opened before it
        in_string, in_key, escape, expect_key = (
            self.in_string,
            self.in_key,
            self.escape,
            self.expect_key,
        )
        key = self.key if commit else bytearray(self.key) if in_key else bytearray()
        for b in data:
            if in_string:
                if escape:
                    escape = False
                elif b == BACKSLASH:
                    escape = True
                elif b == QUOTE:
                    in_string = False
                    if in_key:
                        in_key = expect_key = False
                        frame = stack[-1] if stack else None
                        if frame is not None:
                            name = bytes(key)
                            if name in frame or name in added.get(id(frame), ()):
                                return False
                            if commit or id(frame) in fresh:
                                frame.add(name)
                            else:
                                added.setdefault(id(frame), set()).add(name)
                        key.clear()
                        continue
                if in_key:
                    key.append(b)
            elif b == QUOTE:
                in_string = True
                in_key = bool(stack) and stack[-1] is not None and expect_key
            elif b == 0x7B:  # {
                frame = set()
                fresh.add(id(frame))
                stack.append(frame)
                expect_key = True
            elif b == 0x5B:  # [
                stack.append(None)
            elif b in (0x7D, 0x5D):  # } ]
                if stack:
                    stack.pop()
                expect_key = False
            elif b == 0x2C:  # ,
                expect_key = bool(stack) and stack[-1] is not None
            elif b == 0x3A:  # :
                expect_key = False
        if commit:
            self.in_string, self.in_key, self.escape, self.expect_key = (
                in_string,
                in_key,
                escape,
                expect_key,
            )
        return True


class DistinctKeys:
    """A grammar state whose JSON output never holds a key twice in one object.

    A grammar cannot remember which keys an object already holds, so where a schema leaves keys free
    (a map's ``additionalProperties``, ``json_object``, a pattern with infinitely many names)
    llguidance lets one repeat (``{"a":1,"a":2}``). `DistinctKeys` wraps a request's grammar state:
    it follows the output with a small JSON scanner (the open containers, each open object's keys,
    the key being written) and, before each draw, masks every allowed token that would close a key
    its object already holds. Only tokens holding a ``"`` can close a key, so each step looks at few
    tokens. Keys are compared as written: the compiled schema allows one spelling per character
    (`schema_rewrite.GUIDANCE`), so equal keys are equal bytes.

    Where every continuation the grammar allows repeats a key (a pattern whose other names are used
    up), the request ends with an error, never with a repeated key.
    """

    __slots__ = ("_forbidden", "_inner", "_out", "_scan", "_schema", "_stop", "_vocab")

    def __init__(
        self, inner: GrammarState, token_bytes: Sequence[bytes], stop_ids: Any, schema: str
    ) -> None:
        """`inner`: the grammar's own state; `token_bytes`: every id's bytes; `schema`: the
        request's schema text, for the final check."""
        self._inner = inner
        self._vocab = _vocab(token_bytes)
        self._stop = frozenset(int(t) for t in stop_ids)
        self._schema = schema
        self._scan = _Scanner()
        self._out = bytearray()
        self._forbidden: list[int] = []

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        out = self._inner.mask(logits)
        scan, vocab = self._scan, self._vocab
        allowed = out != -np.inf
        forbidden: list[int] = []
        keys = scan.holds_keys()
        if scan.in_key and not scan.escape:
            # Inside a key: a token whose first quote closes it (nothing escaped before that
            # quote) repeats a key exactly when what it writes first completes one the object
            # holds: found from the object's keys, not by trying every quote token.
            frame = scan.stack[-1] or set()
            partial = bytes(scan.key)
            for name in frame:
                if name.startswith(partial):
                    ids = vocab.closers.get(name[len(partial) :])
                    if ids is not None:
                        forbidden += ids[allowed[ids]].tolist()
            tried = vocab.tricky & allowed  # 3+ quotes, or a backslash before the first
        else:
            # the fewest quotes a token needs to close a key an open object already holds
            # (none holds one yet: this token must write the same key twice)
            need = (1 if keys else 3) + (2 if scan.in_string and not scan.in_key else 0)
            need += 0 if scan.in_string else 1
            tried = (vocab.quotes >= need) & allowed
        forbidden += [
            t for t in np.flatnonzero(tried).tolist() if not scan.feed(vocab.data[t], commit=False)
        ]
        self._forbidden = forbidden
        if forbidden:
            out[forbidden] = -np.inf
            if not (out != -np.inf).any():
                raise ConstraintFailed(
                    "constraint: every token the schema allows here repeats a key of this "
                    "object (its other keys are used up)"
                )
        return out

    def advance(self, token: int) -> None:
        if token in self._forbidden:
            raise RuntimeFailure(f"constraint: token {token} would repeat a key")
        self._inner.advance(token)
        if token in self._stop:
            why = check_output(bytes(self._out), json.loads(self._schema))
            if why is not None:  # the engine logs it in one line (no traceback) and ends it
                raise ConstraintFailed(f"constraint: the output failed its final check: {why}")
            return
        data = self._vocab.data[token]
        self._out += data
        self._scan.feed(data, commit=True)


@dataclass(frozen=True, slots=True)
class _Vocab:
    """What the key guard needs of a vocabulary, worked out once: each token's bytes, its
    number of quotes, the tokens whose first quote closes a key by what they write before it
    (keyed by that), and the tokens that need trying byte by byte."""

    data: Sequence[bytes]
    quotes: npt.NDArray[np.uint8]
    closers: dict[bytes, npt.NDArray[np.intp]]
    tricky: npt.NDArray[np.bool_]


_VOCABS: dict[int, _Vocab] = {}  # by id of the token list (held by its entry)
_VOCABS_LOCK = threading.Lock()
MAX_VOCABS = 8


def _vocab(token_bytes: Sequence[bytes]) -> _Vocab:
    with _VOCABS_LOCK:
        hit = _VOCABS.get(id(token_bytes))
        if hit is not None and hit.data is token_bytes:
            return hit
    n = len(token_bytes)
    quotes = np.fromiter((min(b.count(b'"'), 255) for b in token_bytes), np.uint8, count=n)
    tricky = np.zeros(n, np.bool_)
    closing: dict[bytes, list[int]] = {}
    for i in np.flatnonzero(quotes).tolist():
        before = token_bytes[i][: token_bytes[i].index(b'"')]
        if quotes[i] >= 3 or b"\\" in before:
            tricky[i] = True
        else:
            closing.setdefault(before, []).append(i)
    closers = {k: np.array(v, np.intp) for k, v in closing.items()}
    vocab = _Vocab(token_bytes, quotes, closers, tricky)
    with _VOCABS_LOCK:
        while len(_VOCABS) >= MAX_VOCABS:
            del _VOCABS[next(iter(_VOCABS))]
        _VOCABS[id(token_bytes)] = vocab
    return vocab


def distinct_keys(
    state: GrammarState, kind: str, text: str, token_bytes: Sequence[bytes], stop_ids: Any
) -> GrammarState:
    """`state` for a constraint of `kind` (its schema `text`), wrapped in `DistinctKeys` if
    its output is JSON."""
    if kind not in JSON_KINDS:
        return state
    schema = text if kind == "json_schema" else OBJECT_SCHEMA
    return DistinctKeys(state, token_bytes, stop_ids, schema)


def _distinct_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def loads_distinct(text: str | bytes) -> Any:
    """`json.loads`, refusing an object that holds a key twice (ValueError)."""
    return json.loads(text, object_pairs_hook=_distinct_pairs)


def check_output(text: bytes, schema: Any) -> str | None:
    """None if `text` is one JSON value, no object holding a key twice, valid under
    `schema` (when ``jsonschema`` is installed); otherwise why not, in one line.

    When the grammar ends the output (its stop token), `check_output` reads it once more, with a
    parser that refuses duplicate keys and with ``jsonschema`` against the request's own schema:
    tokens already streamed cannot be taken back, so a failure there (a bug, never expected) ends
    the request as an error instead of a silent "stop" with a wrong answer.
    """
    try:
        value = loads_distinct(text)
    except (ValueError, RecursionError) as exc:
        return f"not JSON without repeated keys: {str(exc)[:200]}"
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    except Exception as exc:  # a schema the validator cannot run (a regex dialect, a ref)
        log.warning("constrained output not checked by jsonschema: %s", str(exc)[:200])
        return None
    if error is None:
        return None
    where = "$" + "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"{where}: {error.message[:200]}"
