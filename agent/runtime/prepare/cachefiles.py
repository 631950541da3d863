"""The XNNPACK weight cache directory (``runtime.xnnpack_weight_cache_dir``): what the runtime's
files there are called, where a model's packed weights and readings go, and which files a load
may delete.

A model's files are named after its sha256 (its cache key) and what was done to it: packed
weights, prepared copies (`agent.runtime.prepare.model`), the outcome of their checks and the
reading of the file (`read_model_file`). Loading a model prunes the files of every model that
no runner of this process still runs (`hold`, `release`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from pathlib import Path
from typing import Final

from agent.model import room
from agent.profile import DeviceProfile

log = logging.getLogger("agent.runtime.litert")  # moved from litert.py: its lines keep their name

# <weight cache dir>/<cache key> of the models this process runs, with how many runners run
# each: their files outlive loads of other models into the directory (`weight_cache_path`)
_in_use: dict[Path, int] = {}
_in_use_lock = threading.Lock()

# XNNPACK's in-memory weight cache (a memfd). Without any weight cache XNNPACK packs the weights
# once per signature: 3x the packed bytes for a model with 4 signatures (docs/PERFORMANCE.md).
IN_MEMORY_WEIGHT_CACHE: Final = ":memory:"
WEIGHT_CACHE_SUFFIX: Final = ".xnnpack"
MODEL_SUFFIX: Final = ".tflite"
UNCHECKED_SUFFIX: Final = ".unchecked"  # a prepared copy before its first-load check
NO_WINDOWS_SUFFIX: Final = ".nowindows"  # why a model's windows were refused or failed
REFUSED_SUFFIX: Final = ".refused"  # why a model's prepared copy failed its first-load check
PARSE_SUFFIX: Final = ".parse.json"  # what reading a model file found (`read_model_file`)
VERIFY_SUFFIX: Final = ".verify"  # whether its verify signatures match decode (`speccheck`)
# files the runtime keeps in a weight cache directory: <sha256>[.<variant>].xnnpack|.tflite,
# <sha256>.<variant>.tflite.unchecked, <sha256>.p<format>.nowindows,
# <sha256>[.<variant>].parse.json|.verify; and what a load killed while writing one leaves:
# <name>.tmp (a prepared copy), <name><mkstemp's 8 characters>.tmp (a reading)
_CACHE_FILE = re.compile(
    r"^[0-9a-f]{64}(\.[a-z0-9-]+)?"
    r"\.(xnnpack|tflite|tflite\.unchecked|nowindows|refused|parse\.json|verify)"
    r"(([a-z0-9_]{8})?\.tmp)?$"
)

# Bumped whenever `prepare_file` writes a different file for the same input, so that a copy
# an older edge-agent left in the weight cache directory is made again, not reused. 4: the
# attention composite is no longer inlined (p3 copies of one-KV-head default-layout models
# computed something else), and every copy is checked against the original file. 5: windows
# of 512 rows or more get a second, longer prefill length, and every window the verify graphs.
PREPARED_FORMAT: Final = 5


def _keep_files(cache_key: str) -> set[str]:
    """The files of the model named `cache_key` (``<sha256>.<variant>``) in the directory."""
    model = f"{cache_key}{MODEL_SUFFIX}"
    return {
        f"{cache_key}{WEIGHT_CACHE_SUFFIX}",
        model,
        model + UNCHECKED_SUFFIX,
        no_windows_name(cache_key),
        refused_name(cache_key),
        f"{cache_key}{PARSE_SUFFIX}",
        f"{cache_key}{VERIFY_SUFFIX}",
        f"{cache_key.split('.', 1)[0]}{PARSE_SUFFIX}",  # the model file's own
    }


def parse_cache(profile: DeviceProfile, cache_key: str | None) -> Path | None:
    """Where a reading of the file named `cache_key` is kept: beside its packed weights."""
    directory = profile.runtime.xnnpack_weight_cache_dir
    if directory is None or cache_key is None:
        return None
    return directory / f"{cache_key}{PARSE_SUFFIX}"


def refused_name(cache_key: str | None) -> str:
    """``<sha256>.p<format>.refused``: a prepared copy that failed its first-load check."""
    sha = (cache_key or "").split(".", 1)[0]
    return f"{sha}.p{PREPARED_FORMAT}{REFUSED_SUFFIX}"


def no_windows_name(cache_key: str | None) -> str:
    """``<sha256>.p<format>.nowindows``: one per model file and prepare format."""
    sha = (cache_key or "").split(".", 1)[0]
    return f"{sha}.p{PREPARED_FORMAT}{NO_WINDOWS_SUFFIX}"


def remember_no_windows(directory: Path, cache_key: str | None, reason: str) -> None:
    """Keep why this model gets no windows: the outcome is the same for the same file and
    format, and finding it again would cost a rewrite (and a check) at every start."""
    try:
        (directory / no_windows_name(cache_key)).write_text(reason + "\n")
    except OSError as exc:
        log.warning("cannot remember that KV windows failed (%s)", exc)


def weight_cache_path(
    profile: DeviceProfile, cache_key: str | None, model: Path | None = None
) -> str:
    """The XNNPACK weight cache for a model: a file in the profile's directory, else memory.

    `CpuOptions.xnnpack_weight_cache_path` is a file (a directory makes XNNPACK log an error and
    run without a cache). Files of other models (and other variants of this one) in the
    directory are removed: one model's packed weights are as large as the model, and an update
    leaves the old ones unused. Kept: the files of models this process still runs (an update
    loaded beside the serving model must not take the files a rollback would start from).

    A file not packed yet needs room for the packed weights of `model` (`room.packed_bound`):
    XNNPACK aborts the process when it cannot write its cache file, so without that room the
    weights are packed in memory (one log line; the next load packs to the file again).
    """
    directory = profile.runtime.xnnpack_weight_cache_dir
    if directory is None or cache_key is None:
        return IN_MEMORY_WEIGHT_CACHE
    target = directory / f"{cache_key}{WEIGHT_CACHE_SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK) and not target.exists():
            raise PermissionError(f"{directory} is not writable")
        prune_weight_cache(directory, cache_key)
        if model is not None and not target.exists():
            need, free = room.packed_bound(model.stat().st_size), room.free_bytes(directory)
            if free is not None and free < need:
                raise OSError(errno.ENOSPC, f"{free} bytes free, {need} needed to pack {model}")
    except OSError as exc:
        log.warning("XNNPACK weight cache dir unusable (%s); packing weights in memory", exc)
        return IN_MEMORY_WEIGHT_CACHE
    return str(target)


def prune_weight_cache(directory: Path, loading: str | None = None) -> None:
    """Remove from weight cache `directory` the files (named like the runtime's) of every model
    that no runner of this process runs, except those of the model `loading` names: what
    updates left behind, once the model they replaced is closed. Raises OSError."""
    with _in_use_lock:
        running = {k.name for k in _in_use if k.parent == directory}
    if loading is not None:
        running.add(loading)
    # their packed weights, their copies, their windows' outcomes
    keep = set().union(*map(_keep_files, running))
    for old in directory.iterdir():
        if _CACHE_FILE.match(old.name) and old.name not in keep:
            old.unlink(missing_ok=True)
            log.info("weight cache removed: %s (another model or variant)", old)


def hold(key: Path) -> None:
    """One more runner runs the files of `key` (<weight cache dir>/<cache key>)."""
    with _in_use_lock:
        _in_use[key] = _in_use.get(key, 0) + 1


def release(key: Path) -> None:
    """A runner of the files of `key` is closed: once none is left, a load may prune them."""
    with _in_use_lock:
        left = _in_use.pop(key, 0) - 1
        if left > 0:
            _in_use[key] = left
