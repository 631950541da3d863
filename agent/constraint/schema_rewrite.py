"""A JSON schema rewritten so that what llguidance generates is what the schema means: a
context-free grammar loses a few of a schema's meanings, so `rewrite_schema` gives a subset
schema that keeps them, or refuses naming where none exists (docs/API.md, "Structured output").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agent.base.errors import InvalidRequest
from agent.constraint.regex_names import finite_names
from agent.constraint.schema_bounds import BOUNDS as _BOUNDS
from agent.constraint.schema_bounds import bounds as _bounds

# What llguidance is told, whatever the request's own "x-guidance" said: every keyword it
# does not implement refused (not ignored), oneOf only where its branches are disjoint, and
# one spelling per character (no \u or \/ escapes), so a key is equal to another exactly
# when its bytes are.
GUIDANCE = {"lenient": False, "coerce_one_of": False, "json_allowed_escapes": 'nrbtf\\"'}

MAX_NAMES = 64  # keys a finite patternProperties pattern is written out into

# How far a subschema may be narrowed. NARROW: its instances are parts of the whole (root,
# properties, items, anyOf...): it may be given fewer keys. SUBSET: an allOf member or a $defs
# entry describes an object with others, so dropping its undeclared keys would empty the
# whole; bounds may still tighten. EXACT: under oneOf a narrower branch can let an instance
# of two branches pass as one branch's: only rewrites that keep the same instances (under
# float parsing), and a refusal where those are not enough.
NARROW, SUBSET, EXACT = 2, 1, 0

_ONE = ("items", "additionalProperties", "additionalItems")  # instances' parts
_LIST = ("prefixItems", "items")
_MAP = ("properties", "patternProperties")
_OTHER_ONE = ("unevaluatedItems", "unevaluatedProperties", "contains", "propertyNames")
_OTHER_MAP = ("$defs", "definitions", "dependentSchemas")
# keywords under which a narrower subschema may mean a wider whole: left as they are
# (llguidance implements none of them and refuses the schema)
_UNTOUCHED = ("not", "if", "then", "else")
# keywords that describe an instance together with the rest of their schema
_COMPOSED = (
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "$dynamicRef",
    "if",
    "dependentSchemas",
    "dependencies",
)
_OBJECT_KEYS = (
    "propertyNames",
    "properties",
    "patternProperties",
    "additionalProperties",
    "required",
    "minProperties",
    "maxProperties",
)


@dataclass(frozen=True, slots=True)
class Rewritten:
    """The schema to compile and where it was changed (paths, for the log)."""

    schema: Any
    changes: tuple[str, ...]


def _refuse(path: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"json_schema: {what} at {path}")


def rewrite_schema(schema: Any) -> Rewritten:
    """`schema` (parsed JSON, not modified) as a schema llguidance compiles to its meaning.

    llguidance compiles a schema's syntax into a grammar, and a context-free grammar loses a few of
    its meanings (llguidance 1.9.1; docs/API.md, "Structured output"):

    * keys matched by ``patternProperties`` or free ``additionalProperties`` may repeat within one
      object, and ``minProperties`` then counts the repeats;
    * a key may be spelled with escapes (``"\\u0061"``), which slips a declared property past its
      own schema as an "additional" key;
    * integer bounds pass through a 64-bit float (``minimum: 9007199254740993`` allowed
      ``9007199254740992``) and are clamped to 2^63-1 (``minimum: 2^63`` allowed ``2^63-1``);
      exclusive bounds are judged on decimals a float parser cannot tell apart
      (``exclusiveMinimum: 0.1`` allowed ``0.10000000000000001``, which is 0.1);
    * a request's own ``x-guidance`` could switch on ``lenient`` (unknown keywords ignored).

    `rewrite_schema` gives a schema whose every instance is an instance of the original (a subset of
    its language, never more), or refuses with `InvalidRequest` naming the schema path where no such
    subset keeps the schema's requirements. Keys that stay free (a map's ``additionalProperties``
    schema, a pattern with infinitely many names) are kept distinct at generation by
    `agent.constraint.json_keys`.
    """
    if not isinstance(schema, dict):
        return Rewritten(schema, ())
    changes: list[str] = []
    try:
        walk = _Walk(changes, one_of=_has_key(schema, "oneOf"))
        out = walk.node(schema, "$", NARROW)
    except RecursionError:  # the limits module refuses deep schemas first; never a traceback
        raise _refuse("$", "nesting too deep to rewrite") from None
    assert isinstance(out, dict)
    if "x-guidance" in schema:
        changes.append("$.x-guidance")
    out["x-guidance"] = dict(GUIDANCE)
    return Rewritten(out, tuple(changes))


def _has_key(node: Any, key: str) -> bool:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if key in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _Walk:
    def __init__(self, changes: list[str], one_of: bool) -> None:
        self.changes = changes
        self.defs = EXACT if one_of else SUBSET  # a $defs entry may be used under a oneOf

    def node(self, node: Any, path: str, mode: int) -> Any:
        """`node` rewritten (a new dict, the input untouched) as far as `mode` allows."""
        if not isinstance(node, dict):
            return node
        if any(key in node for key in _UNTOUCHED):
            return node  # a narrower part could widen the whole
        out = dict(node)
        # A subschema beside allOf/$ref/anyOf... describes the same instance as they do: its
        # parts may be described there too, so none of them is given fewer keys.
        inner = min(mode, SUBSET) if any(k in node for k in _COMPOSED) else mode
        for key in _ONE:
            if key in node:
                out[key] = self.node(node[key], f"{path}.{key}", inner)
        for key in _MAP:
            if isinstance(node.get(key), dict):
                out[key] = {
                    k: self.node(s, f"{path}.{key}.{k}", inner) for k, s in node[key].items()
                }
        for key in _LIST:
            if isinstance(node.get(key), list):
                out[key] = [
                    self.node(s, f"{path}.{key}[{i}]", inner) for i, s in enumerate(node[key])
                ]
        # anyOf's branches are whole alternatives only where nothing beside them describes
        # the object; allOf's never are; oneOf's may not be narrowed at all
        alone = not any(k in node for k in (*_OBJECT_KEYS, "allOf", "$ref", "oneOf"))
        for key, sub_mode in (
            ("anyOf", mode if alone else min(mode, SUBSET)),
            ("allOf", min(mode, SUBSET)),
            ("oneOf", EXACT),
        ):
            if isinstance(node.get(key), list):
                out[key] = [
                    self.node(s, f"{path}.{key}[{i}]", sub_mode) for i, s in enumerate(node[key])
                ]
        for key in _OTHER_ONE:
            if key in node:
                out[key] = self.node(node[key], f"{path}.{key}", min(mode, SUBSET))
        for key in _OTHER_MAP:
            if isinstance(node.get(key), dict):
                out[key] = {
                    k: self.node(s, f"{path}.{key}.{k}", min(mode, self.defs))
                    for k, s in node[key].items()
                }
        if any(k in node for k in _BOUNDS) and _bounds(out, path, exact=mode == EXACT):
            self.changes.append(path)
        if mode != EXACT and (_unique(out) | _dependent(out)):
            self.changes.append(path)
        if _is_object(out) and _object(out, path, inner):
            self.changes.append(path)
        return out


def _object(out: dict[str, Any], path: str, mode: int) -> bool:
    """Rewrite an object schema's keys (in `out`); whether anything changed."""
    names_changed = mode != EXACT and _names_as_pattern(out, path)
    return _keys(out, path, mode) or names_changed


_NOTES = {"description", "title", "$comment", "examples"}


def _names_as_pattern(out: dict[str, Any], path: str) -> bool:
    """``propertyNames`` that any key meets (``{"type": "string"}``) dropped, and one that is
    a pattern made the keys' pattern: the other keys become ``patternProperties`` under it with
    the additionalProperties schema (declared keys it refuses are left out, refused if
    required). What remains is for `_property_names` or llguidance's refusal."""
    names = out.get("propertyNames")
    if names is True or (
        isinstance(names, dict)
        and set(names) <= _NOTES | {"type"}
        and names.get("type", "string") == "string"
    ):
        del out["propertyNames"]
        return True
    if not (
        isinstance(names, dict)
        and set(names) <= _NOTES | {"type", "pattern"}
        and names.get("type", "string") == "string"
        and isinstance(names.get("pattern"), str)
        and _compiles(names["pattern"])
        and "patternProperties" not in out
    ):
        return False
    pattern = names["pattern"]
    props = out.get("properties")
    if isinstance(props, dict):
        required = out.get("required", [])
        for name in [n for n in props if not _search(pattern, n)]:
            if name in required:
                raise _refuse(path, f"propertyNames refuses the required key {name!r}")
        out["properties"] = {n: v for n, v in props.items() if _search(pattern, n)}
    additional = out.get("additionalProperties", True)
    if additional is not False:
        out["patternProperties"] = {pattern: {} if additional is True else additional}
        out["additionalProperties"] = False
    del out["propertyNames"]
    return True


def _keys(out: dict[str, Any], path: str, mode: int) -> bool:
    props = dict(out["properties"]) if isinstance(out.get("properties"), dict) else {}
    required = [r for r in out.get("required", []) if isinstance(r, str)]
    additional = out.get("additionalProperties", True)
    patterns = out.get("patternProperties")
    patterns = dict(patterns) if isinstance(patterns, dict) else {}
    if not all(_compiles(p) for p in patterns):
        return False  # a pattern Python cannot read: which keys match it is unknown here
    names = {p: finite_names(p, MAX_NAMES) for p in patterns}
    changed = False
    # Extra keys merely allowed (absent or true): only the declared ones are generated, if
    # they can still make up minProperties.
    if mode == NARROW and additional in (True, {}) and (props or required or patterns):
        listed = set(props) | set(required) | {n for ns in names.values() for n in ns or ()}
        mins = out.get("minProperties", 0)
        enough = not isinstance(mins, int) or len(listed) >= mins
        if any(ns is None for ns in names.values()) or enough:
            additional, changed = False, True
            for name in required:
                props.setdefault(name, {})
    # Patterns with finitely many names become those properties, each then written once
    # (the grammar writes a declared property at most once).
    if additional is False and patterns:
        done: set[str] = set()
        for listed_names in names.values():
            if listed_names is None or len(done | set(listed_names)) > MAX_NAMES:
                continue
            for name in listed_names:
                if name in done:
                    continue  # written out already from another pattern
                done.add(name)
                parts = [s for p, s in patterns.items() if _search(p, name)]
                if name in props:
                    parts.insert(0, props[name])
                props[name] = parts[0] if len(parts) == 1 else {"allOf": parts}
            changed = True
        for pattern, listed_names in names.items():
            if listed_names is not None and done.issuperset(listed_names):
                del patterns[pattern]
        if patterns:
            out["patternProperties"] = patterns
        else:
            out.pop("patternProperties", None)
    if additional is False and not patterns and mode != EXACT:
        changed |= _property_names(out, props, required, path)
        changed |= _count_keys(out, props, required, path)
    if changed:
        out["properties"] = props
        out["additionalProperties"] = False
    return changed


def _property_names(
    out: dict[str, Any], props: dict[str, Any], required: list[str], path: str
) -> bool:
    """``propertyNames`` (which llguidance does not implement) over an object whose keys are
    all declared: the declared keys it refuses are left out (refused if one is required) and
    the keyword dropped, every key written then being one it allows. Judged by jsonschema;
    left for llguidance to refuse where that cannot judge it (a $ref inside)."""
    names = out.get("propertyNames")
    if names is None:
        return False
    try:
        import jsonschema

        check = jsonschema.Draft202012Validator(names)
        bad = [name for name in props if not check.is_valid(name)]
    except Exception:  # no jsonschema, or a subschema it cannot run alone
        return False
    for name in bad:
        if name in required:
            raise _refuse(path, f"propertyNames refuses the required key {name!r}")
        del props[name]
    del out["propertyNames"]
    return True


def _unique(out: dict[str, Any]) -> bool:
    """``uniqueItems`` (which llguidance does not implement) as arrays of at most one item,
    which are unique; left for llguidance to refuse where minItems asks for more."""
    if out.get("uniqueItems") is False:
        del out["uniqueItems"]
        return True
    low, high = out.get("minItems", 0), out.get("maxItems")
    if out.get("uniqueItems") is not True or not isinstance(low, int) or low > 1:
        return False
    del out["uniqueItems"]
    out["maxItems"] = 1 if not isinstance(high, int) else min(high, 1)
    return True


def _dependent(out: dict[str, Any]) -> bool:
    """``dependentRequired`` (and draft 4's ``dependencies`` with name lists), which llguidance
    does not implement, met by requiring every name they list: then each is always there."""
    changed = False
    for key in ("dependentRequired", "dependencies"):
        deps = out.get(key)
        if not isinstance(deps, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in deps.values()
        ):
            continue
        required = [r for r in out.get("required", []) if isinstance(r, str)]
        for names in deps.values():
            required += [n for n in names if n not in required]
        out["required"] = required
        del out[key]
        changed = True
    return changed


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return False
    return any(k in node for k in _OBJECT_KEYS)


def _count_keys(out: dict[str, Any], props: dict[str, Any], required: list[str], path: str) -> bool:
    """min/maxProperties over an object whose keys are all declared, met by which keys are
    required and which left out (llguidance takes min/maxProperties only where every
    declared key is required). Unsatisfiable counts are refused."""
    low, high = out.get("minProperties"), out.get("maxProperties")
    if low is None and high is None:
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low or 0, high or 0)):
        return False
    low, high = low or 0, len(props) if high is None else high
    must = [name for name in props if name in required]
    optional = [name for name in props if name not in required]
    if low > len(props):
        raise _refuse(
            path, f"minProperties {low} asks more than the {len(props)} distinct keys allowed"
        )
    if len(must) > high:
        raise _refuse(path, f"maxProperties {high} is below the {len(must)} required keys")
    must += optional[: max(0, low - len(must))]  # the first optional keys become required
    optional = [name for name in optional if name not in must][: high - len(must)]
    keep = set(must) | set(optional)
    for name in list(props):
        if name not in keep:
            del props[name]
    out["required"] = [name for name in props if name in must]
    out.pop("minProperties", None)
    out.pop("maxProperties", None)
    return True
