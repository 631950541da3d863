"""Keys kept distinct while a JSON output is generated.

A grammar cannot remember which keys an object already holds, so where a schema leaves keys
free (a map's ``additionalProperties``, ``json_object``, a pattern with infinitely many
names) llguidance lets one repeat (``{"a":1,"a":2}``). `DistinctKeys` wraps a request's
grammar state: it follows the output with a small JSON scanner (the open containers, each
open object's keys, the key being written) and, before each draw, masks every allowed token
that would close a key its object already holds. Only tokens holding a ``"`` can close a key,
so each step looks at few tokens. Keys are compared as written: the compiled schema allows
one spelling per character (`schema_rewrite.GUIDANCE`), so equal keys are equal bytes.

Where every continuation the grammar allows repeats a key (a pattern whose other names are
used up), the request ends with an error, never with a repeated key.

When the grammar ends the output (its stop token), `check_output` reads it once more, with a
parser that refuses duplicate keys and with ``jsonschema`` against the request's own schema:
tokens already streamed cannot be taken back, so a failure there (a bug, never expected) ends
the request as an error instead of a silent "stop" with a wrong answer.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from agent.errors import ConstraintFailed, RuntimeFailure

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
    """A grammar state whose JSON output never holds a key twice in one object."""

    __slots__ = ("_bytes", "_forbidden", "_inner", "_out", "_quotes", "_scan", "_schema", "_stop")

    def __init__(
        self,
        inner: GrammarState,
        token_bytes: Sequence[bytes],
        quotes: npt.NDArray[np.uint8],
        stop_ids: frozenset[int],
        schema: str,
    ) -> None:
        self._inner = inner
        self._bytes = token_bytes
        self._quotes = quotes
        self._stop = stop_ids
        self._schema = schema
        self._scan = _Scanner()
        self._out = bytearray()
        self._forbidden: list[int] = []

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        out = self._inner.mask(logits)
        scan = self._scan
        # the fewest quotes a token needs to close a key an open object already holds (none
        # holds one yet: this token must write the same key twice)
        need = (1 if scan.holds_keys() else 3) + (0 if scan.in_string else 1)
        tried = np.flatnonzero((self._quotes >= need) & (out != -np.inf)).tolist()
        self._forbidden = [t for t in tried if not scan.feed(self._bytes[t], commit=False)]
        if self._forbidden:
            out[self._forbidden] = -np.inf
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
            if why is not None:
                log.error("constrained output failed its final check: %s", why)
                raise RuntimeFailure(f"constraint: the output failed its final check: {why}")
            return
        data = self._bytes[token]
        self._out += data
        self._scan.feed(data, commit=True)


_QUOTES: dict[int, tuple[Sequence[bytes], npt.NDArray[np.uint8]]] = {}  # by vocabulary
_QUOTES_LOCK = threading.Lock()
MAX_VOCABS = 8


def _quote_counts(token_bytes: Sequence[bytes]) -> npt.NDArray[np.uint8]:
    """How many ``"`` each token holds (capped at 255), counted once per vocabulary."""
    with _QUOTES_LOCK:
        hit = _QUOTES.get(id(token_bytes))
        if hit is not None and hit[0] is token_bytes:
            return hit[1]
    counts = np.fromiter(
        (min(b.count(b'"'), 255) for b in token_bytes), dtype=np.uint8, count=len(token_bytes)
    )
    with _QUOTES_LOCK:
        while len(_QUOTES) >= MAX_VOCABS:
            del _QUOTES[next(iter(_QUOTES))]
        _QUOTES[id(token_bytes)] = (token_bytes, counts)  # the list is held: its id stays its
    return counts


def distinct_keys(
    state: GrammarState, kind: str, text: str, token_bytes: Sequence[bytes], stop_ids: Any
) -> GrammarState:
    """`state` for a constraint of `kind` (its schema `text`), wrapped in `DistinctKeys` if
    its output is JSON."""
    if kind not in JSON_KINDS:
        return state
    schema = text if kind == "json_schema" else OBJECT_SCHEMA
    stops = frozenset(int(t) for t in stop_ids)
    return DistinctKeys(state, token_bytes, _quote_counts(token_bytes), stops, schema)


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
    `schema` (when ``jsonschema`` is installed); otherwise why not, in one line."""
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
