"""A JSON schema rewritten so that what llguidance generates is what the schema means.

llguidance compiles a schema's syntax into a grammar, and a context-free grammar loses a few
of its meanings (measured on llguidance 1.9.1; docs/API.md, "Structured output"):

* keys matched by ``patternProperties`` or free ``additionalProperties`` may repeat within one
  object, and ``minProperties`` then counts the repeats;
* a key may be spelled with escapes (``"\\u0061"``), which slips a declared property past its
  own schema as an "additional" key;
* integer bounds pass through a 64-bit float (``minimum: 9007199254740993`` allowed
  ``9007199254740992``) and are clamped to 2^63-1 (``minimum: 2^63`` allowed ``2^63-1``);
  exclusive bounds are judged on decimals a float parser cannot tell apart
  (``exclusiveMinimum: 0.1`` allowed ``0.10000000000000001``, which is 0.1);
* a request's own ``x-guidance`` could switch on ``lenient`` (unknown keywords ignored).

`rewrite_schema` gives a schema whose every instance is an instance of the original (a
subset of its language, never more), or refuses with `InvalidRequest` naming the schema path
where no such subset keeps the schema's requirements. Keys that stay free (a map's
``additionalProperties`` schema, a pattern with infinitely many names) are kept distinct at
generation by `agent.engine.json_keys`.
"""

from __future__ import annotations

import decimal
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent.engine.regex_names import finite_names
from agent.errors import InvalidRequest

# What llguidance is told, whatever the request's own "x-guidance" said: every keyword it
# does not implement refused (not ignored), oneOf only where its branches are disjoint, and
# one spelling per character (no \u or \/ escapes), so a key is equal to another exactly
# when its bytes are.
GUIDANCE = {"lenient": False, "coerce_one_of": False, "json_allowed_escapes": 'nrbtf\\"'}

INT_LIMIT = 1 << 59  # integer bounds llguidance keeps exactly (it fails past ~1e18)
NUM_LIMIT = 1e18  # number bounds (it fails past ~9.2e18)
NUM_TINY = 1e-30  # nonzero number bounds closer to 0 (it fails below ~1e-66)
NUM_DIGITS = 12  # significant digits of a number bound (it misjudges 16-17)
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
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@dataclass(frozen=True, slots=True)
class Rewritten:
    """The schema to compile and where it was changed (paths, for the log)."""

    schema: Any
    changes: tuple[str, ...]


def _refuse(path: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"json_schema: {what} at {path}")


def rewrite_schema(schema: Any) -> Rewritten:
    """`schema` (parsed JSON, not modified) as a schema llguidance compiles to its meaning."""
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


def _bound(value: Any, key: str, path: str) -> Fraction | None:
    """A bound's value (None: no bound); an unusable one is refused, never dropped."""
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refuse(path, f"{key} is not a number")
    if math.isnan(value):
        raise _refuse(path, f"{key} is not a number")
    if math.isinf(value):  # 1e400 parses as infinity: no bound on its side, nothing past it
        if (value > 0) == key.endswith("inimum"):
            raise _refuse(path, f"{key} {value} leaves no number")
        return None
    return Fraction(value)


def _bounds(out: dict[str, Any], path: str, exact: bool) -> bool:
    """Numeric bounds as inclusive ones llguidance keeps exactly; whether they changed.
    Refused where the bounds hold nothing, or where no exact form exists (`exact`: nor any
    narrower one)."""
    kind = out.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    integer = "integer" in kinds and "number" not in kinds
    old = {k: out[k] for k in _BOUNDS if k in out}
    lo, hi = (
        _bound(old.get("minimum"), "minimum", path),
        _bound(old.get("maximum"), "maximum", path),
    )
    lo_open = hi_open = False
    low_x, high_x = old.get("exclusiveMinimum"), old.get("exclusiveMaximum")
    if low_x is True:  # draft 4: a flag on minimum
        lo_open = lo is not None
    elif (x := _bound(low_x, "exclusiveMinimum", path)) is not None and (lo is None or x >= lo):
        lo, lo_open = x, True
    if high_x is True:
        hi_open = hi is not None
    elif (x := _bound(high_x, "exclusiveMaximum", path)) is not None and (hi is None or x <= hi):
        hi, hi_open = x, True
    new: dict[str, int | float] = {}
    if integer:
        low = None if lo is None else (math.floor(lo) + 1 if lo_open else math.ceil(lo))
        high = None if hi is None else (math.ceil(hi) - 1 if hi_open else math.floor(hi))
        if low is not None and high is not None and low > high:
            raise _refuse(path, "the integer bounds hold no integer")
        if (low is not None and low > INT_LIMIT) or (high is not None and high < -INT_LIMIT):
            raise _refuse(path, f"integer range {_span(low, high)} lies beyond ±2^59, {_WHY_INT}")
        if low is not None:
            new["minimum"] = _float_grid(max(low, -INT_LIMIT), up=True)
        if high is not None:
            new["maximum"] = _float_grid(min(high, INT_LIMIT), up=False)
        moved = (low is not None and new["minimum"] != low) or (
            high is not None and new["maximum"] != high
        )
        if moved and (exact or _empty(new)):
            raise _refuse(
                path,
                f"integer range {_span(low, high)} cannot be kept exactly, {_WHY_INT}",
            )
    else:
        # Under oneOf an open bound at 0 stays llguidance's own (exact on decimals; only a
        # decimal of 300-odd zeros would parse to 0.0): 1e-30 would narrow the branch.
        if exact and lo == 0 and lo_open:
            new["exclusiveMinimum"], lo = 0, None
        if exact and hi == 0 and hi_open:
            new["exclusiveMaximum"], hi = 0, None
        flo = None if lo is None else _inward(lo, lo_open, up=True)
        fhi = None if hi is None else _inward(hi, hi_open, up=False)
        if (flo is not None and flo > NUM_LIMIT) or (fhi is not None and fhi < -NUM_LIMIT):
            raise _refuse(path, f"number range {_span(flo, fhi)} lies beyond ±1e18, {_WHY_NUM}")
        if flo is not None:
            new["minimum"] = _clamp(flo, up=True)
        if fhi is not None:
            new["maximum"] = _clamp(fhi, up=False)
        moved = new.get("minimum", flo) != flo or new.get("maximum", fhi) != fhi
        if moved and (exact or _empty(new)):
            raise _refuse(
                path,
                f"number range {_span(flo, fhi)} cannot be kept exactly, {_WHY_NUM}",
            )
    if _empty(new):
        raise _refuse(path, "the bounds hold no number")
    for key in _BOUNDS:
        out.pop(key, None)
    for key, value in new.items():  # an unchanged bound keeps its own spelling (0, not 0.0)
        same = key in old and old[key] is not True and _bound(old[key], key, path) == value
        same = same or key.startswith("exclusive")
        out[key] = old[key] if same else value
    return old != {k: out[k] for k in _BOUNDS if k in out}


_WHY_INT = "which llguidance cannot bound exactly (its integer bounds pass through floats)"
_WHY_NUM = "which llguidance cannot bound (it takes ±1e18, and no closer to 0 than 1e-30)"


def _span(low: float | None, high: float | None) -> str:
    if low is None:
        return f"<= {high}"
    return f">= {low}" if high is None else f"{low}..{high}"


def _empty(new: dict[str, int | float]) -> bool:
    return "minimum" in new and "maximum" in new and new["minimum"] > new["maximum"]


def _clamp(value: float, up: bool) -> float:
    """`value` moved inward (up: a minimum) into the range llguidance can bound."""
    if up:
        value = max(value, -NUM_LIMIT)
        return NUM_TINY if 0 < value < NUM_TINY else 0.0 if -NUM_TINY < value < 0 else value
    value = min(value, NUM_LIMIT)
    return 0.0 if 0 < value < NUM_TINY else -NUM_TINY if -NUM_TINY < value < 0 else value


def _float_grid(value: int, up: bool) -> int:
    """The nearest integer to `value` that a 64-bit float holds exactly, rounded inward."""
    f = float(value)
    if up and f < value:
        f = math.nextafter(f, math.inf)
    elif not up and f > value:
        f = math.nextafter(f, -math.inf)
    return int(f)


def _inward(bound: Fraction, is_open: bool, up: bool) -> float:
    """A float inclusive bound for `bound` (open or not) that admits nothing beyond it: any
    decimal on the inside parses to a float strictly inside an open bound."""
    f = float(bound)
    direction = math.inf if up else -math.inf
    if (Fraction(f) < bound) if up else (Fraction(f) > bound):
        f = math.nextafter(f, direction)
    if is_open and Fraction(f) == bound:
        f = math.nextafter(f, direction)
    # llguidance misjudges bounds of 16-17 significant digits (maximum -943.3050469559873
    # allowed -943.3050469559872): rounded inward to fewer digits, which it keeps exactly
    # and a float holds as written (any decimal past it parses to a float past it)
    if f != 0:
        rounding = decimal.ROUND_CEILING if up else decimal.ROUND_FLOOR
        exponent = decimal.Decimal(f).adjusted() - (NUM_DIGITS - 1)
        quantum = decimal.Decimal(1).scaleb(exponent)
        with decimal.localcontext() as ctx:
            ctx.prec = 400
            f = float(decimal.Decimal(f).quantize(quantum, rounding=rounding))
    return f
