"""What an import gathers for `metadata.json`, and the one-pass copy that hashes a file."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

Progress = Callable[[str, int, int], None]  # (what, bytes done, bytes in all)
_CHUNK = 1 << 20


@dataclass(slots=True)
class Draft:
    """What the import has gathered for `write_model_dir_metadata`."""

    name: str
    version: str
    context_length: int = 0
    tokenizer: str = ""
    bos_id: int | None = None
    eos_id: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    chat_template: str = ""
    add_bos: bool = False
    generation: dict[str, float] = field(default_factory=dict)
    variants: list[tuple[str, str]] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)
    decided: list[str] = field(default_factory=list)  # "bos_id 1 '<s>' from tokenizer.model"


def copy_hashed(src: Path, dst: Path, progress: Progress | None = None) -> str:
    """Copy `src` to `dst` in one pass that also hashes it; returns the sha256."""
    h = hashlib.sha256()
    total = src.stat().st_size
    done = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(_CHUNK):
            h.update(block)
            fout.write(block)
            done += len(block)
            if progress is not None:
                progress(dst.name, done, total)
        fout.flush()
        os.fsync(fout.fileno())
    return h.hexdigest()
