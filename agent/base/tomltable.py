"""Typed reads from parsed TOML tables, with errors that name the file, key, value and rule.

Shared by device profiles (`agent.profile`) and the agent configuration (`agent.config.file`):
unknown keys are errors, and every `ConfigError` says what is allowed.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from agent.base.errors import ConfigError

MiB: Final = 1 << 20
GiB: Final = 1 << 30
TiB: Final = 1 << 40


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Final = _Missing()


def size_text(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n} bytes"


def _keys_text(prefix: str, keys: Sequence[str], bad: str) -> str:
    where = f"[{prefix}]" if prefix else "the top level"
    text = f"one of the keys of {where}: {', '.join(keys)}"
    close = difflib.get_close_matches(bad, keys, n=1)
    if close:
        text += f" (did you mean {close[0]!r}?)"
    return text


class Table:
    """Typed reads from one TOML table; every error names the file and the dotted key."""

    def __init__(
        self, raw: Mapping[str, object], source: str, prefix: str, keys: Sequence[str]
    ) -> None:
        self.raw = raw
        self.source = source
        self.prefix = prefix
        for key, value in raw.items():
            if key not in keys:
                raise ConfigError(source, self.key(key), value, _keys_text(prefix, keys, key))

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, name: str, value: object, allowed: str) -> ConfigError:
        return ConfigError(self.source, self.key(name), value, allowed)

    def _require(self, name: str, allowed: str) -> object:
        if name not in self.raw:
            raise self.error(name, MISSING, f"{allowed} (required)")
        return self.raw[name]

    def _int_in(self, name: str, lo: int, hi: int | None, default: int | None, allowed: str) -> int:
        if name not in self.raw and default is not None:
            return default
        value = self._require(name, allowed)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < lo
            or (hi is not None and value > hi)
        ):
            raise self.error(name, value, allowed)
        return value

    def integer(self, name: str, lo: int, hi: int | None, default: int | None = None) -> int:
        allowed = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"
        return self._int_in(name, lo, hi, default, allowed)

    def optional_integer(self, name: str, lo: int, hi: int | None) -> int | None:
        return self.integer(name, lo, hi) if name in self.raw else None

    def size(self, name: str, lo: int, hi: int | None, default: int | None = None) -> int:
        """An integer number of bytes (TOML ints; write 2_147_483_648 for 2 GiB)."""
        allowed = (
            f"an integer number of bytes from {lo} ({size_text(lo)}) to {hi} ({size_text(hi)})"
            if hi is not None
            else f"an integer number of bytes >= {lo}"
        )
        return self._int_in(name, lo, hi, default, allowed)

    def number(
        self,
        name: str,
        lo: float,
        hi: float,
        *,
        lo_open: bool = False,
        default: float | None = None,
    ) -> float:
        """A number in range; `default` when the key is absent (else the key is required)."""
        if default is not None and name not in self.raw:
            return default
        lower = f"greater than {lo:g}" if lo_open else f"from {lo:g}"
        upper = f"and at most {hi:g}" if lo_open else f"to {hi:g}"
        allowed = f"a number {lower} {upper}"
        value = self._require(name, allowed)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(name, value, allowed)
        as_float = float(value)
        too_low = as_float <= lo if lo_open else as_float < lo
        if math.isnan(as_float) or too_low or as_float > hi:
            raise self.error(name, value, allowed)
        return as_float

    def flag(self, name: str, default: bool | None = None) -> bool:
        if name not in self.raw and default is not None:
            return default
        value = self._require(name, "true or false")
        if not isinstance(value, bool):
            raise self.error(name, value, "true or false")
        return value

    def text(self, name: str) -> str:
        value = self._require(name, "a non-empty string")
        if not isinstance(value, str) or not value.strip():
            raise self.error(name, value, "a non-empty string")
        return value

    def optional_text(self, name: str) -> str | None:
        return self.text(name) if name in self.raw else None

    def choice(self, name: str, options: Sequence[str]) -> str:
        allowed = "one of " + ", ".join(repr(o) for o in options)
        value = self._require(name, allowed)
        if not isinstance(value, str) or value not in options:
            raise self.error(name, value, allowed)
        return value

    def text_list(self, name: str, default: tuple[str, ...] | None = None) -> tuple[str, ...]:
        if name not in self.raw and default is not None:
            return default
        value = self._require(name, "a list of strings")
        if not isinstance(value, list):
            raise self.error(name, value, "a list of strings")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise self.error(f"{name}[{i}]", item, "a non-empty string")
        return tuple(value)

    def absolute_path(self, name: str) -> Path | None:
        if name not in self.raw:
            return None
        value = self.raw[name]
        if not isinstance(value, str) or not value.startswith("/"):
            raise self.error(name, value, "an absolute path (a string starting with '/')")
        return Path(value)

    def table(self, name: str, keys: Sequence[str], *, required: bool) -> Table | None:
        allowed = f"a table [{self.key(name)}]"
        if name not in self.raw:
            if required:
                raise self.error(name, MISSING, f"{allowed} (required)")
            return None
        value = self.raw[name]
        if not isinstance(value, dict):
            raise self.error(name, value, allowed)
        return Table(value, self.source, self.key(name), keys)
