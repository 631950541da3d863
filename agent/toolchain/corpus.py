"""The demo model's training corpus: the Python standard library's own source (PSF-2.0).

Files are every ``*.py`` under the stdlib directory except test suites (``test/``,
``tests/``, ``idle_test/``), installed packages (``site-packages/``), build configuration
(``config-*``, ``_sysconfigdata*``) and generated data (``pydoc_data/``, the codec mapping
tables ``encodings/cp*.py``, ``mac_*.py`` ...: mostly hex tables).

The split is deterministic: a file is held out for evaluation when the first byte of
sha256(relative path) is below `HOLDOUT_BYTE` (~5% of files). No torch here.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ~5% of files (byte < 13 of 256) go to the held-out set.
HOLDOUT_BYTE = 13

SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data", "lib-dynload"}
)
SKIP_DIR_PREFIXES = ("config-",)
SKIP_FILE_PREFIXES = ("_sysconfigdata",)
#: Codec modules that are generated mapping tables rather than code.
SKIP_ENCODING_PREFIXES = ("cp", "mac_", "iso8859_", "koi8_", "hp_", "kz1048", "ptcp", "tis_")


def default_stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    rel: str

    @property
    def held_out(self) -> bool:
        return hashlib.sha256(self.rel.encode()).digest()[0] < HOLDOUT_BYTE

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def _skipped(rel_parts: tuple[str, ...]) -> bool:
    dirs, name = rel_parts[:-1], rel_parts[-1]
    if any(d in SKIP_DIRS or d.startswith(SKIP_DIR_PREFIXES) for d in dirs):
        return True
    if name.startswith(SKIP_FILE_PREFIXES):
        return True
    return bool(dirs[:1] == ("encodings",) and name.startswith(SKIP_ENCODING_PREFIXES))


def list_files(root: Path | None = None) -> list[CorpusFile]:
    """All corpus files under `root` (default: this interpreter's stdlib), sorted."""
    root = Path(root) if root is not None else default_stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel_parts = p.relative_to(root).parts
        if _skipped(rel_parts):
            continue
        out.append(CorpusFile(p, "/".join(rel_parts)))
    if not out:
        raise FileNotFoundError(f"no Python files under {root}")
    return out


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, held out)."""
    train = [f for f in files if not f.held_out]
    held = [f for f in files if f.held_out]
    return train, held


def describe(root: Path | None = None) -> dict[str, Any]:
    files = list_files(root)
    train, held = split(files)
    return {
        "root": str(root or default_stdlib_dir()),
        "python": sys.version.split()[0],
        "files": len(files),
        "train_files": len(train),
        "heldout_files": len(held),
        "train_bytes": sum(f.path.stat().st_size for f in train),
        "heldout_bytes": sum(f.path.stat().st_size for f in held),
        "heldout": [f.rel for f in held],
    }
