"""The text checks of `agent.constraint.limits`: a regex's (or a Lark grammar's)
nesting and its size with bounded repetitions multiplied out, in one pass that never recurses,
and the ``%json {...}`` blocks of a Lark grammar."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

from agent.base.errors import InvalidRequest


class Limits(Protocol):
    """What the scan reads of `agent.constraint.limits.ConstraintLimits`."""

    @property
    def max_nesting(self) -> int: ...

    @property
    def max_expansion(self) -> int: ...


def _refuse(kind: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{kind}: {what}")


class _Frame:
    __slots__ = ("last", "total")

    def __init__(self) -> None:
        self.total = 0  # positions of the items closed so far
        self.last = 0  # the item a quantifier would apply to


_QUANT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def scan(text: str, what: str, limits: Limits, lark: bool) -> int:
    """Positions of a regex (or a Lark grammar's rules) with bounded repetitions multiplied
    out, refusing deep nesting or a total past the limit on the way. Conservative: every
    alternative counts, and ``{n,}`` counts n."""
    frames = [_Frame()]
    i, n = 0, len(text)

    def atom(size: int) -> None:
        f = frames[-1]
        f.total += f.last
        f.last = size
        if f.total + f.last > limits.max_expansion:
            raise _too_big(what, limits, i)

    def repeat(count: int) -> None:
        f = frames[-1]
        f.last *= max(count, 1)
        if f.total + f.last > limits.max_expansion:
            raise _too_big(what, limits, i, count)

    while i < n:
        ch = text[i]
        if lark and ch == "/" and text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if lark and ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            atom(1)
            i = j + 1
            continue
        if lark and ch == "/":
            j = i + 1
            while j < n and text[j] != "/":
                j += 2 if text[j] == "\\" else 1
            inner = scan(text[i + 1 : j], f"{what} (the regex at character {i})", limits, False)
            atom(max(inner, 1))
            i = j + 1
            continue
        if ch == "\\":
            atom(1)
            i += 2
            continue
        if not lark and ch == "[":  # a character class is one position
            j = i + 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            atom(1)
            i = j + 1
            continue
        if ch == "(" or (lark and ch == "["):
            frames.append(_Frame())
            if len(frames) - 1 > limits.max_nesting:
                raise _refuse(
                    what.split(":")[0],
                    f"{_where(what)}nesting exceeds {limits.max_nesting} levels at character {i}",
                )
            i += 1
            continue
        if ch == ")" or (lark and ch == "]"):
            if len(frames) > 1:
                inner_frame = frames.pop()
                atom(inner_frame.total + inner_frame.last)
            i += 1
            continue
        if ch == "|":
            f = frames[-1]
            f.total += f.last
            f.last = 0
            i += 1
            continue
        if ch == "{":
            m = _QUANT.match(text, i)
            if m:
                low, comma, high = m.group(1), m.group(2), m.group(3)
                repeat(int(high) if comma and high else int(low))
                i = m.end()
                continue
        if lark and ch == "~":
            m = _LARK_RANGE.match(text, i)
            if m:
                repeat(int(m.group(2) or m.group(1)))
                i = m.end()
                continue
        if lark and (ch.isalnum() or ch == "_"):
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            atom(1)
            i = j
            continue
        if ch in "*+?" or ch.isspace() or (lark and ch in ":.%-><=,#&!@;"):
            i += 1
            continue
        atom(1)
        i += 1
    while len(frames) > 1:  # unbalanced: the library will say so; count what was there
        inner_frame = frames.pop()
        frames[-1].last += inner_frame.total + inner_frame.last
    f = frames[0]
    return f.total + f.last


def _where(what: str) -> str:
    rest = what.split(":", 1)[1].strip() if ":" in what else ""
    return f"{rest}: " if rest else ""


def _too_big(what: str, limits: Limits, at: int, count: int | None = None) -> InvalidRequest:
    rep = f"repetition {{{count}}} at character {at} makes " if count is not None else ""
    return _refuse(
        what.split(":")[0],
        f"{_where(what)}{rep}the pattern over {limits.max_expansion} positions with its "
        "bounded repetitions multiplied out",
    )


def brackets(text: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """Where JSON text opens or closes an array or object, outside strings: (index, char), with
    no recursion (a hostile text nests 100,000 deep)."""
    in_string = escaped = False
    for at in range(start, len(text)):
        ch = text[at]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[]{}":
            yield at, ch


def json_block(text: str, start: int) -> str | None:
    """The balanced ``{...}`` that starts after `start` (skipping blanks), or None."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j, ch in brackets(text, i):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i : j + 1]
    return text[i:]


def without_json(text: str) -> str:
    """The grammar with each ``%json {...}`` block replaced by one rule name."""
    out: list[str] = []
    pos = 0
    for m in re.finditer(r"%json\b", text):
        if m.start() < pos:
            continue
        body = json_block(text, m.end())
        out.append(text[pos : m.start()])
        out.append(" json_block ")
        pos = m.end() if body is None else text.index(body, m.end()) + len(body)
    out.append(text[pos:])
    return "".join(out)
