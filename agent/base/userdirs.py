"""Where a one-shot command (``generate``, ``profile ...``, ``model ...``, ``update make``) keeps
what it writes: the user's own directories, never the daemon's ``/var`` ones.

caches go to ``$CACHE_DIRECTORY`` (systemd's ``CacheDirectory=``, when a unit runs the
command), else ``$XDG_CACHE_HOME/edge-agent``, else ``~/.cache/edge-agent`` (a relative
``XDG_CACHE_HOME`` is ignored, as the XDG Base Directory specification says). No one-shot
command keeps state: ``generate`` has no disk tier for sessions. The daemon
(``edge-agent run``) keeps its own defaults (``/var/lib/edge-agent``, ``/run/edge-agent``,
``$CACHE_DIRECTORY``), which its unit gives it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

APP: Final = "edge-agent"


def _systemd_dir(variable: str) -> Path | None:
    """The first directory of a systemd ``*_DIRECTORY`` variable (``:``-separated), if set."""
    first = os.environ.get(variable, "").split(":")[0]
    return Path(first) if first.startswith("/") else None


def _xdg(variable: str, fallback: str) -> Path:
    value = os.environ.get(variable, "")
    base = Path(value) if value.startswith("/") else Path.home() / fallback
    return base / APP


def cache_dir() -> Path:
    """The user's cache directory for edge-agent (not created here)."""
    return _systemd_dir("CACHE_DIRECTORY") or _xdg("XDG_CACHE_HOME", ".cache")
