"""What a structured output must be, as a request names it."""

from __future__ import annotations

from dataclasses import dataclass

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must be: the sampler allows only tokens that keep it in this language.

    `kind` is one of CONSTRAINT_KINDS: "json_schema" (`text` is the schema as JSON),
    "json_object" (any JSON object; `text` is ignored), "regex" (the whole output matches
    `text`), "grammar" (`text` is a Lark grammar, as llguidance takes it).
    """

    kind: str
    text: str = ""
