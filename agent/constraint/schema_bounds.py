"""A JSON schema's numeric bounds as llguidance keeps them exactly
(`agent.constraint.schema_rewrite`
calls `bounds` on every node that has one): inclusive, on the 64-bit float grid for integers
within ±2^59, numbers cut to 12 significant digits within ±1e18 and no closer to 0 than 1e-30,
exclusive bounds judged on the decimals as written. Where no exact form exists the schema is
refused (or, where narrowing keeps only valid instances, narrowed), never emitted past."""

from __future__ import annotations

import decimal
import math
from fractions import Fraction
from typing import Any, Final

from agent.base.errors import InvalidRequest

INT_LIMIT: Final = 1 << 59  # integer bounds llguidance keeps exactly (it fails past ~1e18)
NUM_LIMIT: Final = 1e18  # number bounds (it fails past ~9.2e18)
NUM_TINY: Final = 1e-30  # nonzero number bounds closer to 0 (it fails below ~1e-66)
NUM_DIGITS: Final = 12  # significant digits of a number bound (it misjudges 16-17)
BOUNDS: Final = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_BOUNDS = BOUNDS


def _refuse(path: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"json_schema: {what} at {path}")


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


def bounds(out: dict[str, Any], path: str, exact: bool) -> bool:
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
