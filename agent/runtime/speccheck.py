"""Whether a loaded model may speculate: its verify signatures must compute what decode one by
one computes, bit for bit (`RunnerBase.check_verify`), or greedy speculation would not give
plain decoding's tokens. Likewise whether it may batch decode steps (`check_batching`): each row
of a batch signature must compute what decode computes for that session alone.

The check runs on a first load; its outcome is kept in the weight cache directory as
``<cache key>.verify`` (one line per execution path and LiteRT version), so a warm start of
the same files reads it instead of running the check again. The cache key names the file
(its sha256 and what was done to it), so a changed file is checked again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Final

from agent.profile import DeviceProfile
from agent.runtime.memory import give_back_memory
from agent.runtime.prepare.cachefiles import VERIFY_SUFFIX
from agent.runtime.runner import Runner, RunnerBase

log = logging.getLogger("agent.runtime.litert")  # a load's lines keep the front door's name

ALLOWED: Final = "allowed"


def _litert_version() -> str:
    for name in ("ai-edge-litert", "tflite-runtime"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _path_key(runner: RunnerBase[object]) -> str:
    """What the outcome depends on besides the file: the execution path, its kernels, LiteRT."""
    return f"{type(runner).__name__} {runner.accelerator} {_litert_version()}"


def _read(record: Path) -> dict[str, str]:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _record(profile: DeviceProfile, cache_key: str | None) -> Path | None:
    directory = profile.runtime.xnnpack_weight_cache_dir
    return (
        None
        if directory is None or cache_key is None
        else directory / f"{cache_key}{VERIFY_SUFFIX}"
    )


def check_batching(runner: Runner, profile: DeviceProfile, cache_key: str | None) -> None:
    """Allow batched decode on `runner` (its `batch_sizes`) only if its batch signatures match
    decode bit for bit: the outcome kept by an earlier load of the same files on the same path
    (in the verify record, under its own key), else `check_batch` now. One log line when the
    file has batch signatures."""
    if not isinstance(runner, RunnerBase):
        return
    if not runner._batch:
        log.debug("no batched decode: %s", runner.batch_problem)
        return
    _checked(
        profile,
        cache_key,
        f"batch {_path_key(runner)}",
        runner.check_batch,
        runner.allow_batch,
        lambda: f"batched decode allowed: batch signatures {list(runner.batch_sizes)}",
        "batched decode off",
        "batch",
    )


def check_speculation(runner: Runner, profile: DeviceProfile, cache_key: str | None) -> None:
    """Allow speculation on `runner` (its `verify_lengths`) only if its verify signatures match
    decode bit for bit: the outcome kept by an earlier load of the same files on the same path,
    else `check_verify` now (kept for the next load). One log line either way."""
    if not isinstance(runner, RunnerBase) or not any(w.verify for w in runner.layout.all_windows()):
        return
    _checked(
        profile,
        cache_key,
        _path_key(runner),
        runner.check_verify,
        runner.allow_verify,
        lambda: f"speculation allowed: verify signatures {list(runner.verify_lengths)}",
        "speculation off",
        "verify",
    )


def _checked(
    profile: DeviceProfile,
    cache_key: str | None,
    key: str,
    check: Callable[[], str | None],
    allow: Callable[[str | None], None],
    allowed: Callable[[], str],
    off: str,
    what: str,
) -> None:
    """One check and its kept outcome: the record's line `key` when an earlier load wrote
    it (`allow` takes it), else `check` now, logged, and kept for the next load."""
    record = _record(profile, cache_key)
    known = _read(record) if record is not None else {}
    if key in known:
        outcome = known[key]
        allow(None if outcome == ALLOWED else outcome)
        if outcome != ALLOWED:
            log.warning("%s: an earlier load found %s", off, outcome)
        return
    problem = check()
    give_back_memory()
    if problem is None:
        log.info("%s match decode bit for bit", allowed())
    else:
        log.warning("%s for this model: %s", off, problem)
    if record is not None:
        known[key] = ALLOWED if problem is None else problem
        try:
            record.write_text(json.dumps(known, indent=1) + "\n")
        except OSError as exc:  # the next load checks again
            log.warning("cannot keep the %s check's outcome (%s)", what, exc)
