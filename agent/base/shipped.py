"""Where edge-agent finds the data it ships: profiles, systemd units, protos, the demo model.

The checkout keeps them at its top level (``firmware_profiles/``, ``systemd/``, ``proto/``, as
the docs name them); the wheel carries copies as package data under ``agent/data/`` (setup.py's
``build_py`` puts them there), found through `importlib.resources`. A checkout (an editable
install, or ``python -m agent`` in the repo) reads its own files, so an edit there is seen at
once; an installed wheel reads its package data. The demo model is package data in both
(``agent/models/demo/``).
"""

from __future__ import annotations

import importlib.resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Final

import agent

# the top-level directories of the checkout that the wheel carries under agent/data/
SHIPPED: Final = ("firmware_profiles", "systemd", "proto")


def _as_path(resource: Traversable, what: str) -> Path:
    if isinstance(resource, Path):
        return resource
    raise RuntimeError(
        f"{what} is not on a file system ({resource!r}); install edge-agent unzipped"
    )


def checkout_root() -> Path | None:
    """The source checkout the `agent` package is imported from, if it is one: the parent of
    ``agent/`` holding ``pyproject.toml`` (an installed package's parent is site-packages,
    where other projects' directories, such as systemd-python's ``systemd/``, also live)."""
    root = Path(agent.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "proto").is_dir() else None


def shipped_dir(name: str) -> Path:
    """The shipped directory `name` (one of `SHIPPED`): the checkout's own, else the installed
    package's ``agent/data/<name>``. The path may not exist (a broken install); callers say so
    with the path."""
    if name not in SHIPPED:
        raise ValueError(f"not a shipped directory: {name!r} (one of {', '.join(SHIPPED)})")
    root = checkout_root()
    if root is not None:
        return root / name
    return _as_path(importlib.resources.files(agent) / "data" / name, f"agent/data/{name}")


def demo_model() -> Path:
    """The demo model's directory (``agent/models/demo``, package data in checkout and wheel)."""
    return _as_path(importlib.resources.files("agent.models") / "demo", "agent/models/demo")
