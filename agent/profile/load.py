"""Profile files: reading and validating one, and listing the shipped ones."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Final

from agent.base.errors import ConfigError, ProfileNotFound
from agent.base.shipped import shipped_dir
from agent.profile.parse import parse_profile
from agent.profile.schema import DeviceProfile

PROFILES_ENV: Final = "EDGE_AGENT_PROFILES_DIR"


def load_profile(path: Path) -> DeviceProfile:
    """Read and validate one profile file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ProfileNotFound(f"no profile file {path}") from exc
    except OSError as exc:
        raise ConfigError(str(path), "(file)", str(exc), "a readable file") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "(file)", str(exc), "UTF-8 text") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "(syntax)", str(exc), "TOML 1.0") from exc
    return parse_profile(data, path)


def profiles_dir() -> Path:
    """The shipped profiles: ``$EDGE_AGENT_PROFILES_DIR``, else the checkout's
    ``firmware_profiles/``, else the installed package's copy (`agent.base.shipped`)."""
    override = os.environ.get(PROFILES_ENV)
    if override:
        return Path(override)
    return shipped_dir("firmware_profiles")


def list_profiles(directory: Path | None = None) -> list[DeviceProfile]:
    """Every ``*.toml`` in `directory` (default: `profiles_dir()`), sorted by name.

    One broken file fails the whole listing: a shipped profile that does not parse is a bug.
    """
    where = directory if directory is not None else profiles_dir()
    if not where.is_dir():
        raise ProfileNotFound(f"profile directory {where} does not exist (see ${PROFILES_ENV})")
    return [load_profile(p) for p in sorted(where.glob("*.toml"))]
