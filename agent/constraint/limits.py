"""What a constraint may ask of llguidance, checked before anything is compiled: its compiler
recurses on the thread's stack (a deep grammar or schema kills the process) and multiplies out
bounded repetitions, so a constraint is measured here in plain Python that never recurses and
refused past limits well inside what the library survives (docs/API.md, "Constraint limits").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from agent.base.errors import InvalidRequest
from agent.constraint.patterns import brackets, json_block, scan, without_json


@dataclass(frozen=True, slots=True)
class ConstraintLimits:
    """How much of each kind a constraint may hold (see the module docstring for why)."""

    max_chars: int = 1 << 17  # the constraint's text (128 KiB: 5.6% more of SchemaStore fits)
    max_json_nesting: int = 128  # [ and { in a schema's JSON text (llguidance stops at 128)
    max_schema_depth: int = 64  # subschema levels, each local $ref followed counting as one
    max_rules: int = 1000  # rule and terminal definitions in a Lark grammar
    max_nesting: int = 64  # ( and [ nested in a regex or a Lark rule
    max_expansion: int = 100_000  # a pattern's positions with bounded repetitions multiplied out


LIMITS = ConstraintLimits()

# keywords whose value is one subschema / a map of them / a list of them
_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "contentSchema",
)
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def refuse(kind: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{kind}: {what}")


def check_json_nesting(text: str, kind: str, limits: ConstraintLimits = LIMITS) -> None:
    """Refuse JSON text nested deeper than the limit, before a parser recurses into it."""
    depth = 0
    for at, ch in brackets(text):
        if ch in "[{":
            depth += 1
            if depth > limits.max_json_nesting:
                raise refuse(
                    kind,
                    f"JSON nesting exceeds {limits.max_json_nesting} levels at character {at}",
                )
        elif ch in "]}":
            depth -= 1


def parse_schema(text: str, kind: str = "json_schema", limits: ConstraintLimits = LIMITS) -> Any:
    """A schema's JSON text parsed, its nesting checked first (json.loads recurses)."""
    check_json_nesting(text, kind, limits)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"{kind} is not JSON: {exc}") from None


def _pointer(root: Any, frag: str) -> Any:
    """What a JSON pointer (``/a/b``, "" for the whole) points to in `root`, or None."""
    node = root
    for raw in frag.split("/")[1:]:
        part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), raw)
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Refs:
    """Where a ``$ref`` leads inside one document: ``#/pointer`` and ``#anchor`` in the
    schema resource it is written in (the nearest enclosing subschema with its own ``$id``,
    as llguidance resolves them), or ``<$id>#...`` naming a resource of the document. Any
    other ref (another document, a relative URI) is refused: it cannot be measured."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.anchors: dict[str, Any] = {}
        self.ids: dict[str, Any] = {}
        stack: list[Any] = [root]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            anchor = node.get("$anchor")
            if isinstance(anchor, str):
                self.anchors[anchor] = node
            ident = node.get("$id", node.get("id"))
            if isinstance(ident, str):
                if ident.startswith("#"):
                    self.anchors[ident[1:]] = node
                else:
                    self.ids[ident.rstrip("#")] = node
            stack.extend(sub for _, sub in _children(node))

    def base_of(self, node: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        ident = node.get("$id", node.get("id"))
        return node if isinstance(ident, str) and not ident.startswith("#") else base

    def resolve(self, ref: str, base: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        """(target, its resource) for a ref this document holds; None if it holds none."""
        doc, _, frag = ref.partition("#")
        if doc:
            if doc not in self.ids:
                return None
            base = self.ids[doc]
        if frag and not frag.startswith("/"):
            target = self.anchors.get(frag)
        else:
            target = _pointer(base, frag)
        return (target, base) if isinstance(target, dict) else None


def _children(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key in _ONE:
        sub = node.get(key)
        if isinstance(sub, dict):
            yield f".{key}", sub
    for key in _MAP:
        subs = node.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                if isinstance(sub, dict):
                    yield f".{key}.{name}", sub
    for key in _LIST:
        subs = node.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                if isinstance(sub, dict):
                    yield f".{key}[{i}]", sub
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, dict):
                yield f".dependencies.{name}", sub


def _short(path: str, limit: int = 160) -> str:
    return path if len(path) <= limit else path[:80] + " … " + path[-(limit - 83) :]


def _ref_cycle(refs: _Refs, node: dict[str, Any], base: dict[str, Any]) -> list[str] | None:
    """The refs of a chain of ``$ref``s that comes back to itself without reaching a value."""
    chain: list[str] = []
    seen = {id(node)}
    while isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        chain.append(ref)
        found = refs.resolve(ref, base)
        if found is None:
            return None
        node, base = found[0], refs.base_of(found[0], found[1])
        if id(node) in seen:
            return chain
        seen.add(id(node))
    return None


def _depth_error(kind: str, limits: ConstraintLimits, path: str) -> InvalidRequest:
    return refuse(kind, f"nesting depth exceeds {limits.max_schema_depth} at {_short(path)}")


def check_schema(schema: Any, kind: str = "json_schema", limits: ConstraintLimits = LIMITS) -> None:
    """Refuse a schema deeper than the limit (its ``$ref``s followed), a ``$ref`` outside the
    document, a cycle of ``$ref``s that never reaches a value, or a ``pattern`` past the
    pattern limits. Iterative: a hostile schema cannot exhaust the Python stack either.

    Depth is the longest chain of subschemas, each ``$ref`` hop one more level; a ref back
    into a schema still being walked (a recursive schema, fine for llguidance) ends the
    chain there. The first schema past the limit is named by its path."""
    if not isinstance(schema, dict):
        return
    refs = _Refs(schema)
    below: dict[int, int] = {}  # levels under an already walked subschema
    # (node, its resource, path, depth, children left): the subschemas of the current chain
    stack: list[tuple[dict[str, Any], str, int, Iterator[tuple[str, Any, dict[str, Any]]]]] = []
    on_chain: set[int] = set()
    below_of: dict[int, list[Any]] = {}  # the subschemas a node on the chain leads to

    def enter(node: dict[str, Any], base: dict[str, Any], path: str, depth: int) -> None:
        if id(node) in below:
            if depth + below[id(node)] > limits.max_schema_depth:
                raise _depth_error(kind, limits, path)
            return
        if id(node) in on_chain:
            return  # recursion: llguidance makes it a rule, it does not unfold it
        if depth > limits.max_schema_depth:
            raise _depth_error(kind, limits, path)
        base = refs.base_of(node, base)
        _check_keywords(node, path, kind, limits)
        cycle = _ref_cycle(refs, node, base)
        if cycle is not None:
            raise refuse(
                kind, f"$ref cycle at {_short(path)}: {' -> '.join(cycle)} never reaches a value"
            )
        on_chain.add(id(node))
        edges = list(_edges(refs, node, base, path, kind))
        below_of[id(node)] = [sub for _, sub, _ in edges]
        stack.append((node, path, depth, iter(edges)))

    enter(schema, schema, "$", 0)
    while stack:
        node, path, depth, edges = stack[-1]
        nxt = next(edges, None)
        if nxt is None:
            stack.pop()
            on_chain.discard(id(node))
            subs = below_of.pop(id(node))
            below[id(node)] = max((1 + below.get(id(sub), 0) for sub in subs), default=0)
            continue
        suffix, sub, sub_base = nxt
        enter(sub, sub_base, path + suffix, depth + 1)


def _edges(
    refs: _Refs, node: dict[str, Any], base: dict[str, Any], path: str, kind: str
) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """A subschema's ``$ref`` target (with its resource) and its children."""
    ref = node.get("$ref")
    if ref is not None:
        found = refs.resolve(ref, base) if isinstance(ref, str) else None
        if found is not None:
            yield f".$ref({ref[:60]})", found[0], found[1]
        elif not isinstance(ref, str) or not ref.startswith("#"):
            raise refuse(
                kind,
                f"$ref {str(ref)[:80]!r} at {_short(path)} is not in this schema; only "
                "refs into it ('#/...', '#anchor', or an $id it holds) are followed",
            )
    for suffix, sub in _children(node):
        yield suffix, sub, base


def _check_keywords(node: dict[str, Any], path: str, kind: str, limits: ConstraintLimits) -> None:
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_pattern(pattern, f"{kind}: pattern at {_short(path)}", limits)
    props = node.get("patternProperties")
    if isinstance(props, dict):
        for key in props:
            check_pattern(key, f"{kind}: patternProperties key at {_short(path)}", limits)


def check_pattern(pattern: str, what: str = "regex", limits: ConstraintLimits = LIMITS) -> None:
    """Refuse a regex nested too deep or too large once its bounded repetitions are
    multiplied out (``a{1000000}``, ``((a{100}){100}){100}``)."""
    scan(pattern, what, limits, lark=False)


_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)
_DIRECTIVE = re.compile(r"%(json|lark)\b")


def check_lark(text: str, limits: ConstraintLimits = LIMITS) -> None:
    """Refuse a Lark grammar with too many rules, rules nested or repeated past the limits,
    a nested ``%lark`` grammar, or a ``%json`` schema past the schema limits."""
    rules = len(_RULE.findall(text))
    if rules > limits.max_rules:
        raise refuse("grammar", f"{rules} rule definitions; at most {limits.max_rules}")
    for m in _DIRECTIVE.finditer(text):
        if m.group(1) == "lark":
            raise refuse(
                "grammar", f"nested %lark grammars are not taken (at character {m.start()})"
            )
        body = json_block(text, m.end())
        if body is not None:
            where = f"grammar: %json at character {m.start()}"
            check_schema(parse_schema(body, where, limits), where, limits)
    scan(without_json(text), "grammar", limits, lark=True)
