"""Which profile runs: a file, a shipped profile's name, or the board's detected one, and why."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from agent.base.errors import ProfileNotFound
from agent.profile.detect import detect
from agent.profile.load import load_profile, profiles_dir
from agent.profile.schema import DeviceProfile

log = logging.getLogger(__name__)


def resolve_profile(
    name_or_path: str | None, root: Path = Path("/")
) -> tuple[DeviceProfile, tuple[str, ...]]:
    """The profile to run and why.

    A value ending in ``.toml`` or containing a slash is a file; any other value is the name of a
    shipped profile; ``None`` means detect the board under `root`.
    """
    if name_or_path is None:
        found = detect(root)
        return found.profile, found.reasons
    if name_or_path.endswith(".toml") or "/" in name_or_path or os.sep in name_or_path:
        path = Path(name_or_path)
        return load_profile(path), (f"profile file {path} given explicitly",)
    where = profiles_dir()
    path = where / f"{name_or_path}.toml"
    if not path.is_file():
        names = sorted(p.stem for p in where.glob("*.toml")) if where.is_dir() else []
        raise ProfileNotFound(
            f"no shipped profile named {name_or_path!r} in {where}; "
            f"available: {', '.join(names) or '(none)'}"
        )
    return load_profile(path), (f"profile {name_or_path!r} given explicitly ({path})",)


def log_reasons(name: str, reasons: Sequence[str], *, detected: bool) -> None:
    """Why `name` runs, one INFO line per reason, for a command that resolved it; `detected`:
    detection chose it and has logged its first reason (the choice) already."""
    for r in reasons[1 if detected else 0 :]:
        log.info("profile %s: %s", name, r)
