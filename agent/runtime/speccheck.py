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
    record = _record(profile, cache_key)
    key = f"batch {_path_key(runner)}"
    known = _read(record) if record is not None else {}
    if key in known:
        outcome = known[key]
        runner.allow_batch(None if outcome == ALLOWED else outcome)
        if outcome != ALLOWED:
            log.warning("batched decode off: an earlier load found %s", outcome)
        return
    problem = runner.check_batch()
    give_back_memory()
    if problem is None:
        log.info(
            "batched decode allowed: batch signatures %s match decode bit for bit",
            list(runner.batch_sizes),
        )
    else:
        log.warning("batched decode off for this model: %s", problem)
    if record is not None:
        known[key] = ALLOWED if problem is None else problem
        try:
            record.write_text(json.dumps(known, indent=1) + "\n")
        except OSError as exc:  # the next load checks again
            log.warning("cannot keep the batch check's outcome (%s)", exc)


def check_speculation(runner: Runner, profile: DeviceProfile, cache_key: str | None) -> None:
    """Allow speculation on `runner` (its `verify_lengths`) only if its verify signatures match
    decode bit for bit: the outcome kept by an earlier load of the same files on the same path,
    else `check_verify` now (kept for the next load). One log line either way."""
    if not isinstance(runner, RunnerBase) or not any(w.verify for w in runner.layout.all_windows()):
        return
    record = _record(profile, cache_key)
    key = _path_key(runner)
    known = _read(record) if record is not None else {}
    if key in known:
        outcome = known[key]
        runner.allow_verify(None if outcome == ALLOWED else outcome)
        if outcome != ALLOWED:
            log.warning("speculation off: an earlier load found %s", outcome)
        return
    problem = runner.check_verify()
    give_back_memory()
    if problem is None:
        log.info(
            "speculation allowed: verify signatures %s match decode bit for bit",
            list(runner.verify_lengths),
        )
    else:
        log.warning("speculation off for this model: %s", problem)
    if record is not None:
        known[key] = ALLOWED if problem is None else problem
        try:
            record.write_text(json.dumps(known, indent=1) + "\n")
        except OSError as exc:  # the next load checks again
            log.warning("cannot keep the verify check's outcome (%s)", exc)
