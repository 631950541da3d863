"""The names a ``patternProperties`` pattern allows, when they are few enough to list.

A JSON Schema pattern matches anywhere in a key (ECMA-262 ``search``), so only a pattern
anchored at both ends (``^(UB|PT)$``) can allow finitely many keys. Its inside is turned into
a finite-state machine by greenery (pure Python) and its strings counted and listed; every
name is checked against the whole pattern with Python's `re.search` (what ``jsonschema``
does), so a name listed is always one the pattern allows.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

MAX_PATTERN_CHARS = 200  # longer patterns are not listed (their machines can be large)
# (unescaped) *, +, {n,}, ., [^...], \w \W \S \D: infinitely or too many names, known
# without building a machine (greenery can take seconds on such patterns)
_UNBOUNDED = re.compile(r"(?<!\\)(?:\\\\)*(?:[*+.]|\{\d*,\}|\[\^|\\[wWSD])")


def finite_names(pattern: str, limit: int) -> list[str] | None:
    """Every key `pattern` allows, in a stable order, if there are at most `limit` of them;
    None if there are more, infinitely many, or the pattern is beyond this module's reach."""
    if limit <= 0 or len(pattern) > MAX_PATTERN_CHARS:
        return None
    if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
        return None
    inner = pattern[1:-1]
    if _UNBOUNDED.search(inner):
        return None  # a repetition without an upper bound, or a class of most characters
    if "^" in inner.replace("[^", "") or "$" in inner.replace("\\$", ""):
        return None  # anchors inside: not one anchored expression
    try:
        from greenery import parse

        parsed = parse(inner)
        if len(parsed.concs) != 1:  # ^a|b$ is "starts with a" or "ends with b"
            return None
        fsm = parsed.to_fsm()
        count = fsm.cardinality()
    except OverflowError:  # infinitely many
        return None
    except Exception as exc:  # a syntax greenery does not read (lookarounds, \u, \p{..})
        log.debug("pattern %r not listed: %s", pattern, exc)
        return None
    if count > limit:
        return None
    names = list(fsm.strings([]))
    compiled = re.compile(pattern)
    if len(names) != count or not all(compiled.search(n) for n in names):
        return None
    return names
