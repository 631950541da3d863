"""The file the CPU path runs (`PreparedModel`): the model itself, or a copy made for XNNPACK
with its composites inlined (`agent.runtime.prepare.inline`) and KV windows added
(`agent.runtime.prepare.windows`), kept in the weight cache directory
(`agent.runtime.prepare.cachefiles`).

A fresh copy is unchecked until its first load has compared it with the original file
(`agent.runtime.prepare.check`); a copy that fails is dropped and remembered as refused, and windows
that fail are dropped and remembered, so later loads do not make them again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from agent.base.errors import ModelFormatError
from agent.model.tflite.file import read_model_file
from agent.model.tflite.info import ModelFile
from agent.model.tflite.layout import ModelLayout, discover_layout
from agent.profile import DeviceProfile
from agent.runtime.compiled import CompiledRunner
from agent.runtime.legacy import LEGACY_BACKEND
from agent.runtime.memory import give_back_memory
from agent.runtime.plan import MemoryPlan, adds_windows, affordable_windows, plan_memory
from agent.runtime.prepare import check
from agent.runtime.prepare.cachefiles import (
    MODEL_SUFFIX,
    PARSE_SUFFIX,
    PREPARED_FORMAT,
    UNCHECKED_SUFFIX,
    WEIGHT_CACHE_SUFFIX,
    no_windows_name,
    parse_cache,
    refused_name,
    remember_no_windows,
)
from agent.runtime.runner import Runner

log = logging.getLogger("agent.runtime.litert")  # moved from litert.py: its lines keep their name


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """The file the CPU path runs: the model itself, or a copy made for XNNPACK."""

    path: Path
    cache_key: str | None  # names its packed weights
    windows: tuple[int, ...] = ()  # KV windows added to it
    fresh: bool = False  # written by this load: `path` is unchecked until `checked_path`
    inlined: bool = False  # its composites (but `inline.KEPT_COMPOSITES`) are inlined
    refused: str | None = None  # why an earlier load refused this model's copy

    @property
    def checked_path(self) -> Path:
        return self.path.with_name(f"{self.cache_key}{MODEL_SUFFIX}")

    def describe(self, original: Path) -> str:
        """What runs instead of `original`, as status shows it."""
        if self.refused is not None:
            return check.describe_refusal(original, self.refused)
        if self.path == original:
            return "none"
        parts = (["composites inlined"] if self.inlined else []) + (
            [f"KV windows {', '.join(map(str, self.windows))}"] if self.windows else []
        )
        return ", ".join(parts) + f" ({self.path.name})"


def keep_checked(prepared: PreparedModel) -> PreparedModel:
    """Give a copy that passed its first-load check the name later loads trust."""
    try:
        prepared.path.replace(prepared.checked_path)
    except OSError as exc:  # it serves; the next start makes and checks it again
        log.warning("checked copy not kept (%s)", exc)
        return prepared
    return replace(prepared, path=prepared.checked_path, fresh=False)


def refuse(prepared: PreparedModel, cache_key: str | None, problem: str, original: Path) -> str:
    """Drop a copy that failed its check, and remember why: the same file and prepare format
    give the same copy, so later loads serve the original without making it again."""
    directory = prepared.path.parent
    for name in (
        prepared.path.name,
        f"{prepared.cache_key}{WEIGHT_CACHE_SUFFIX}",
        f"{prepared.cache_key}{PARSE_SUFFIX}",
    ):
        (directory / name).unlink(missing_ok=True)
    try:
        (directory / refused_name(cache_key)).write_text(problem + "\n")
    except OSError as exc:
        log.warning("cannot remember that the prepared copy was refused (%s)", exc)
    shown = check.describe_refusal(original, problem)
    log.warning("prepared copy of %s %s", original.name, shown)
    return shown


def _variant(fused: bool, windows: tuple[int, ...]) -> str:
    """Names what was done to a prepared copy: ``p3-inlined-kv256-512``."""
    parts = [f"p{PREPARED_FORMAT}"] + (["inlined"] if fused else [])
    if windows:
        parts.append("kv" + "-".join(str(w) for w in windows))
    return "-".join(parts)


def prepared_model(
    path: Path,
    profile: DeviceProfile,
    cache_key: str | None,
    fused: bool,
    windows: tuple[int, ...] = (),
    kv_length: int = 0,
) -> PreparedModel:
    """The model to give XNNPACK: `path` with its composites inlined
    (`agent.runtime.prepare.inline`)
    and KV windows added (`agent.runtime.prepare.windows`), kept beside the packed weights as
    ``<sha256>.<variant>.tflite`` when the profile has a weight cache directory; else `path`
    itself. A copy made by an earlier load is reused."""
    directory = profile.runtime.xnnpack_weight_cache_dir
    unchanged = PreparedModel(path, cache_key)
    if directory is None or cache_key is None:
        log.info("model not prepared for XNNPACK: the profile sets no xnnpack_weight_cache_dir")
        return unchanged
    refused = directory / refused_name(cache_key)
    if refused.exists():
        reason = refused.read_text(errors="replace").strip()
        log.warning("model not prepared for XNNPACK: an earlier load refused its copy (%s)", reason)
        return replace(unchanged, refused=reason)
    no_windows = directory / no_windows_name(cache_key)
    if windows and no_windows.exists():
        reason = no_windows.read_text(errors="replace").strip()
        log.warning("KV windows not added: an earlier load found %s", reason)
        windows = ()
    key = f"{cache_key}.{_variant(fused, windows)}"
    target = directory / f"{key}{MODEL_SUFFIX}"
    # a copy is named `target` only once its first load has checked it against `path`
    write = target.with_name(target.name + UNCHECKED_SUFFIX)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if target.exists():  # made (and checked) by an earlier load
            return PreparedModel(target, key, windows, inlined=fused)
        from agent.runtime.prepare.inline import (
            prepare_file,  # the flatbuffer schema: only to write
        )

        done = prepare_file(path, write, windows, kv_length)
    except (OSError, ModelFormatError, ValueError, AttributeError) as exc:
        log.warning("model not prepared for XNNPACK (%s); loading %s as it is", exc, path.name)
        return unchanged
    if not done.changed:
        return unchanged
    if done.windows != windows:  # refused: the file holds only the inlined graph
        remember_no_windows(directory, cache_key, done.refused or "the windows were refused")
        key = f"{cache_key}.{_variant(fused, done.windows)}"
        write = write.replace(directory / f"{key}{MODEL_SUFFIX}{UNCHECKED_SUFFIX}")
    return PreparedModel(write, key, done.windows, fresh=True, inlined=bool(done.inlined))


def prepare(
    path: Path,
    model: ModelFile,
    layout: ModelLayout,
    plan: MemoryPlan,
    profile: DeviceProfile,
    cache_key: str | None,
    chain: list[str],
    kv_windows: bool,
    interpreter: bool,
) -> tuple[PreparedModel, tuple[ModelLayout, MemoryPlan]]:
    """The file the CPU links run, and its layout and memory plan.

    XNNPACK cannot take a composite: each one splits the delegated graph (6-10% of a decode
    step, docs/PERFORMANCE.md); LiteRT-LM inlines them when it compiles, so do we. A
    single-length model also gets KV windows (`agent.runtime.prepare.windows`) on the CompiledModel
    path (the Interpreter would allocate each window's KV once per signature), unless the profile
    sets ``kv_windows = false``.
    """
    unchanged = PreparedModel(path, cache_key), (layout, plan)
    if profile.runtime.backend == LEGACY_BACKEND or not {"xnnpack", "cpu"} & set(chain):
        return unchanged
    windows: tuple[int, ...] = ()
    if adds_windows(profile, layout, kv_windows, interpreter):
        windows, _extra = affordable_windows(model, layout, plan)
    if not (model.fused or windows):
        return unchanged
    n = layout.context_length
    prepared = prepared_model(path, profile, cache_key, model.fused, windows, n)
    if not prepared.windows:
        return prepared, (layout, plan)
    made = read_model_file(prepared.path, parse_cache(profile, prepared.cache_key))
    made_layout = discover_layout(made, n)
    made_plan = plan_memory(made, made_layout, profile)
    if made_plan.total > made_plan.budget:
        log.warning("KV windows not used: with them %s", made_plan.describe())
        return prepared_model(path, profile, cache_key, model.fused, (), n), (layout, plan)
    return prepared, (made_layout, made_plan)


def check_new_windows(runner: Runner, prepared: PreparedModel) -> PreparedModel:
    """Compare the windows just added to a model with its full length before using them (the
    copy is named only once this and the check against the original file pass). On a
    difference the model runs its full length only, the copy is dropped and the outcome is
    remembered, so later loads do not rewrite the model for windows again."""
    if not isinstance(runner, CompiledRunner) or not prepared.windows:
        return prepared
    problem = runner.check_windows()
    give_back_memory()
    if problem is None:
        log.info("KV windows %s added and checked", list(prepared.windows))
        return prepared
    log.warning("KV windows not used: %s; running the full length only", problem)
    runner.layout = replace(runner.layout, windows=())
    prepared.path.unlink(missing_ok=True)
    prepared.path.with_name(f"{prepared.cache_key}{PARSE_SUFFIX}").unlink(missing_ok=True)
    remember_no_windows(prepared.path.parent, prepared.cache_key, problem)
    return replace(prepared, windows=())
