"""The agent config's `[models]` section (docs/CONFIG.md): several models in one byte budget,
each addressed by name, loaded on first use and unloaded after an idle `keep_alive`.

    [models]
    keep_alive = "5m"          # the default for every model but the first
    [models.chat]              # the first model listed is the default one
    path = "/var/lib/edge-agent/models/chat"
    pinned = true              # never evicted to make room for another
    [models.code]
    path = "/var/lib/edge-agent/models/code.litertlm"
    quantization = "int8"
    keep_alive = "30s"         # Ollama's durations: "0" unloads at once, negative never

`agent.config.file` parses the file and hands this module the section's raw table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.base.errors import ConfigError
from agent.base.tomltable import Table

MODEL_KEYS: Final = ("path", "quantization", "keep_alive", "pinned")
NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
NAME_RULE: Final = "1-64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
KEEP_ALIVE_RULE: Final = (
    'seconds (a number), or a duration such as "30s", "5m", "1h" or "250ms"; 0 unloads a '
    'model as soon as it is idle, a negative value ("-1") keeps it loaded'
)
DEFAULT_KEEP_ALIVE_S: Final = 300.0  # Ollama's default
_DURATION: Final = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNIT_S: Final = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_keep_alive(value: object) -> float | None:
    """Seconds a model stays loaded once idle (`math.inf`: forever), or None if `value` is
    not a keep-alive. Numbers are seconds; text is Ollama's duration form."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DURATION.fullmatch(value.strip())
        if m is None:
            return None
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    else:
        return None
    if math.isnan(seconds):
        return None
    return math.inf if seconds < 0 else seconds


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One named model: where it is, its variant, and how long it stays loaded when idle
    (None: the section's default; `math.inf`: forever); `pinned` models are never evicted."""

    name: str
    path: Path
    quantization: str | None = None
    keep_alive_s: float | None = None
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class ModelsConfig:
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    entries: tuple[ModelEntry, ...] = ()


def check_name(source: str, key: str, name: str) -> str:
    if NAME_RE.fullmatch(name) is None:
        raise ConfigError(source, key, name, f"a model name: {NAME_RULE}")
    return name


def parse_models(raw: Mapping[str, object], source: str) -> ModelsConfig:
    """`[models]`: an optional `keep_alive` and one table per model, in the file's order."""
    keep_alive = DEFAULT_KEEP_ALIVE_S
    entries: list[ModelEntry] = []
    for key, value in raw.items():
        if key == "keep_alive":
            k = parse_keep_alive(value)
            if k is None:
                raise ConfigError(source, "models.keep_alive", value, KEEP_ALIVE_RULE)
            keep_alive = k
            continue
        if not isinstance(value, dict):
            raise ConfigError(
                source,
                f"models.{key}",
                value,
                f"keep_alive, or a [models.NAME] table ({NAME_RULE})",
            )
        check_name(source, f"models.{key}", key)
        t = Table(value, source, f"models.{key}", MODEL_KEYS)
        path = t.absolute_path("path")
        if path is None:
            raise t.error("path", "<missing>", "an absolute path to a model directory or .litertlm")
        k = None
        if "keep_alive" in t.raw:
            k = parse_keep_alive(t.raw["keep_alive"])
            if k is None:
                raise t.error("keep_alive", t.raw["keep_alive"], KEEP_ALIVE_RULE)
        entries.append(
            ModelEntry(
                key, path, t.optional_text("quantization"), k, t.flag("pinned", default=False)
            )
        )
    return ModelsConfig(keep_alive, tuple(entries))
