"""The runtime's front door: load an exported LLM, bind its KV cache, run it, on one of two
execution paths behind one interface (`Runner`): ``CompiledModel`` (KV buffers bound in place)
or ``Interpreter`` (the fallback and the external-delegate path). The profile's accelerator
chain picks the path; a link that fails falls back to the next with one warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from agent.base.errors import AcceleratorError, ModelFormatError
from agent.model.tflite.file import read_model_file
from agent.model.tflite.info import ModelFile
from agent.model.tflite.layout import ModelLayout, discover_layout
from agent.profile import DeviceProfile
from agent.runtime.compiled import CompiledRunner
from agent.runtime.cpufeatures import aarch64_without_lse
from agent.runtime.interpreter import InterpreterRunner
from agent.runtime.legacy import LEGACY_BACKEND, check_legacy_compatible
from agent.runtime.memory import give_back_memory, keep_large_buffers_mapped
from agent.runtime.plan import MemoryPlan, check_budget, plan_memory
from agent.runtime.prepare import check
from agent.runtime.prepare.cachefiles import IN_MEMORY_WEIGHT_CACHE, parse_cache, weight_cache_path
from agent.runtime.prepare.model import (
    PreparedModel,
    check_new_windows,
    keep_checked,
    prepare,
    refuse,
)
from agent.runtime.runner import Runner
from agent.runtime.speccheck import check_batching, check_speculation

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A runner plus what was decided while loading it."""

    runner: Runner
    model_file: ModelFile
    memory: MemoryPlan
    accelerator: str
    path_kind: str  # "compiled" | "interpreter"
    fallbacks: tuple[str, ...]  # one line per accelerator that was skipped, with the reason
    prepared: str = "none"  # what runs instead of the file: "none", "inlined ...", "refused, ..."


def load(
    path: Path,
    profile: DeviceProfile,
    *,
    context_length: int | None = None,
    prefer_interpreter: bool = False,
    cache_key: str | None = None,
    kv_windows: bool = True,
) -> LoadedModel:
    """Load `path` under `profile`: check format and budget, then walk the accelerator chain.

    `cache_key` (the model's sha256) names the persistent XNNPACK weight cache file when the
    profile sets `xnnpack_weight_cache_dir`; without both, the cache lives in memory.
    `kv_windows=False` runs only the full-length signatures of a file that has KV windows.

    Two execution paths behind one interface (`Runner`):

    * ``CompiledModel`` (primary): the runtime creates each session's KV buffers once; the same
      buffer is bound as the input *and* the output of a signature, so the model updates the cache
      in place and nothing is copied per token.
    * ``Interpreter`` (fallback, and the path for TFLite external delegates): the session's KV
      lives in our arrays; before a signature runs its input tensors are loaded (only when another
      session or signature wrote since), and after it runs only the rows it wrote are copied back.
      The KV cache never travels through a signature runner.

    The modules behind it, one noun each: `agent.runtime.plan` (what a load costs),
    `agent.runtime.runner` (the interface and the shared base), `agent.runtime.compiled` and
    `agent.runtime.interpreter` (the two paths), `agent.runtime.prepare.model` (the copy the CPU
    path runs), `agent.runtime.prepare.cachefiles` (the weight cache directory) and
    `agent.runtime.legacy` (tflite-runtime). This module loads: format and budget checks, the
    accelerator chain, the first-load checks.
    """
    keep_large_buffers_mapped()
    model = read_model_file(path, parse_cache(profile, cache_key))
    try:
        layout = discover_layout(model, context_length)
    except ModelFormatError as exc:  # say which file: a directory holds several
        raise ModelFormatError(f"{path}: {exc}") from exc
    if not kv_windows:
        layout = replace(layout, windows=())
    source = str(profile.source)
    if profile.runtime.require_fused and not model.fused:
        raise ModelFormatError(
            f"{path.name}: profile {profile.name} ({source}) sets runtime.require_fused = true, "
            "but the model has no fused STABLEHLO_COMPOSITE ops; export it with composites on "
            "(enable_hlfb) or set require_fused = false"
        )
    if profile.runtime.backend == LEGACY_BACKEND:
        check_legacy_compatible(model, path, layout)
        prefer_interpreter = True  # tflite-runtime has no CompiledModel
    elif not prefer_interpreter and aarch64_without_lse():
        # CompiledModel's environment loads a LiteRT library that aborts without LSE atomics
        log.info(
            "this CPU has no LSE atomics (e.g. Cortex-A72/A53): running %s on the "
            "Interpreter, not CompiledModel (agent/runtime/cpufeatures.py)",
            path.name,
        )
        prefer_interpreter = True
    plan = plan_memory(model, layout, profile)
    check_budget(plan, profile, path)
    chain = list(profile.runtime.accelerators)
    prepared, cpu = prepare(
        path, model, layout, plan, profile, cache_key, chain, kv_windows, prefer_interpreter
    )
    checks = _Checks(path, model, layout, profile, cache_key, prefer_interpreter)
    fallbacks: list[str] = []
    for i, acc in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else "nothing"
        use_layout, use_plan = (layout, plan) if acc == "npu" else cpu
        if acc != "npu" and prepared.fresh:
            # now: its runner is closed before the copy's opens, and on XNNPACK it packs the
            # weights into the copy's cache file, which the copy then maps
            checks.reference(_shared_cache(profile, acc, prefer_interpreter, prepared))
        try:
            try:
                runner, kind = _open(path, use_layout, profile, acc, prefer_interpreter, prepared)
            except (OSError, RuntimeError, ValueError) as exc:
                if acc == "npu" or not prepared.windows:
                    raise
                log.warning("KV windows not used: %s cannot run them (%s)", acc, _first_line(exc))
                prepared.path.unlink(missing_ok=True)  # our copy: the next load makes it again
                prepared, cpu = prepare(
                    path, model, layout, plan, profile, cache_key, chain, False, prefer_interpreter
                )
                use_layout, use_plan = cpu
                runner, kind = _open(path, use_layout, profile, acc, prefer_interpreter, prepared)
            if acc != "npu":
                runner, kind, prepared = checks.run(runner, kind, acc, prepared, prefer_interpreter)
                use_plan = cpu[1] if prepared.path != path else plan
            checked_key = cache_key if acc == "npu" else prepared.cache_key
            check_speculation(runner, profile, checked_key)
            check_batching(runner, profile, checked_key)
            # the checks' calls are each signature's first: lazy initialisation, page faults
            runner.costs.clear()
        except (OSError, RuntimeError, ValueError, AcceleratorError) as exc:
            reason = f"{acc}: {_first_line(exc)}"
            log.warning("accelerator %s unavailable (%s); falling back to %s", acc, reason, nxt)
            fallbacks.append(reason)
            continue
        log.info(
            "model loaded: %s on %s via %s, %s",
            path.name,
            runner.accelerator,
            kind,
            use_plan.describe(),
        )
        return LoadedModel(
            runner,
            model,
            use_plan,
            runner.accelerator,
            kind,
            tuple(fallbacks),
            checks.refused or prepared.describe(path),
        )
    raise AcceleratorError(
        f"no accelerator of profile {profile.name} could run {path.name}: " + "; ".join(fallbacks)
    )


class _Checks:
    """The first-load checks of one load (`agent.runtime.prepare.check`): a fresh prepared copy,
    and the
    builtin-kernel ``cpu`` link of a fused model, against the original file on XNNPACK. The
    reference is computed once, before the runner it checks is needed again, and its runner
    closed before anything else is opened."""

    def __init__(
        self,
        path: Path,
        model: ModelFile,
        layout: ModelLayout,
        profile: DeviceProfile,
        cache_key: str | None,
        interpreter: bool = False,
    ) -> None:
        self.path, self.model, self.layout, self.profile = path, model, layout, profile
        self.cache_key, self.interpreter = cache_key, interpreter
        self._probe: check.Probe | str | None = None  # the reference, or why there is none
        self.refused: str | None = None  # the prepared copy's refusal, as status shows it

    def reference(self, pack_to: str | None = None) -> check.Probe | str:
        """What the original file computes on XNNPACK (computed once), or why it could not
        be had. Its runner packs the weights in memory and is closed before this returns, so
        a first load's peak holds one packed model, not two.

        On the CompiledModel path the reference runs on a CompiledModel with XNNPACK's
        in-memory weight cache, the Interpreter (its default XNNPACK delegate) only where that
        cannot open the file: the same logits, bit for bit, in half the time (measured on the
        SmolLM-shaped files: opening int8 0.66 against 1.16 s, int4 1.29 against 2.46 s;
        docs/PERFORMANCE.md, "Time to serve a new model"). With `pack_to` (the prepared
        copy's weight cache file, `_shared_cache`) it packs the weights there instead."""
        if self._probe is None:
            try:
                ref = self._reference_runner(pack_to)
                try:
                    self._probe = check.reference(ref, self.model)
                    if pack_to is not None and os.path.exists(pack_to):
                        log.info(
                            "weights packed to %s by the reference run on %s",
                            pack_to,
                            self.path.name,
                        )
                finally:
                    ref.close()
                    del ref
            except (OSError, RuntimeError, ValueError) as exc:
                self._probe = f"the original file did not run on XNNPACK: {_first_line(exc)}"
            except check.NonFiniteReference as exc:
                self._probe = str(exc)
            give_back_memory()
        return self._probe

    def _reference_runner(self, pack_to: str | None) -> Runner:
        rt = self.profile.runtime
        if not self.interpreter:
            full = replace(self.layout, windows=())  # the probe runs the full length
            cache = pack_to or IN_MEMORY_WEIGHT_CACHE
            try:
                return CompiledRunner(self.path, full, "xnnpack", rt.num_threads, cache, None)
            except (OSError, RuntimeError, ValueError) as exc:
                if pack_to is not None:  # whatever it left is not for the copy to map
                    Path(pack_to).unlink(missing_ok=True)
                log.info("reference on the Interpreter: %s", _first_line(exc))
        return InterpreterRunner(
            self.path, self.layout, "xnnpack", rt.num_threads, None, rt.backend
        )

    def run(
        self, runner: Runner, kind: str, acc: str, prepared: PreparedModel, interpreter: bool
    ) -> tuple[Runner, str, PreparedModel]:
        """`runner` if it computes what the original file does; else the original file opened
        on `acc` (a refused copy) or AcceleratorError (the cpu link)."""
        if prepared.fresh:
            prepared = check_new_windows(runner, prepared)  # a failure here drops only windows
            problem = self._problem(runner, "the prepared copy")
            if problem is None:
                if prepared.path.exists():  # not dropped with its windows
                    prepared = keep_checked(prepared)
                return runner, kind, self._cpu(runner, kind, acc, prepared, interpreter)
            runner.close()
            del runner
            give_back_memory()
            self.refused = refuse(prepared, self.cache_key, problem, self.path)
            prepared = PreparedModel(self.path, self.cache_key)
            runner, kind = _open(self.path, self.layout, self.profile, acc, interpreter, prepared)
        return runner, kind, self._cpu(runner, kind, acc, prepared, interpreter)

    def _cpu(
        self, runner: Runner, kind: str, acc: str, prepared: PreparedModel, interpreter: bool
    ) -> PreparedModel:
        """The builtin kernels run a composite through its decomposition, which is not always
        what the composite means: a fused model runs there only once checked."""
        if acc != "cpu" or not self.model.fused:
            return prepared
        problem = self._problem(runner, "LiteRT's builtin kernels")
        if problem is not None:
            runner.close()
            raise AcceleratorError(
                f"the builtin CPU kernels do not compute what {self.path.name} computes on "
                f"XNNPACK ({problem})"
            )
        return prepared

    def _problem(self, runner: Runner, what: str) -> str | None:
        want = self.reference()
        if isinstance(want, str):
            return want
        problem = check.compare(runner, want)
        give_back_memory()
        if problem is None:
            log.info("%s checked against %s: logits within %g", what, self.path, want.tolerance)
        return problem


def _shared_cache(
    profile: DeviceProfile, acc: str, interpreter: bool, prepared: PreparedModel
) -> str | None:
    """The weight cache file a fresh prepared copy will map, for the reference run on the
    original file to pack into, or None (then the reference packs in memory). XNNPACK's file
    cache identifies packed weights by buffer index, and a prepared copy keeps every buffer of
    the original at its index (`agent.runtime.prepare.overlay`; new buffers are appended): the copy
    maps what the original packed instead of packing the same weights again and reopening
    (measured on the SmolLM-shaped int8 file: the copy opens in 0.33 s instead of 0.83 s plus
    the reopen, with bit-identical logits). The check that follows compares the copy with the
    reference, so weights that were not the same would show there."""
    if acc != "xnnpack" or interpreter or not prepared.fresh:
        return None
    cache = weight_cache_path(profile, prepared.cache_key, prepared.path)
    if cache == IN_MEMORY_WEIGHT_CACHE or os.path.exists(cache):
        return None
    return cache


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _open(
    path: Path,
    layout: ModelLayout,
    profile: DeviceProfile,
    acc: str,
    prefer_interpreter: bool,
    prepared: PreparedModel,
) -> tuple[Runner, str]:
    npu = profile.npu
    threads = profile.runtime.num_threads
    backend = profile.runtime.backend
    if acc == "npu":
        if npu is None:
            raise AcceleratorError("no [npu] section in the profile")
        if not os.path.exists(npu.library):
            raise AcceleratorError(f"{npu.library} does not exist")
        if npu.kind == "external_delegate":
            opts = npu.options_as_strings()
            return InterpreterRunner(
                path, layout, "npu", threads, (npu.library, opts), backend
            ), "interpreter"
        if backend == LEGACY_BACKEND:
            raise AcceleratorError("a dispatch-library NPU needs ai-edge-litert's CompiledModel")
        return CompiledRunner(path, layout, "npu", threads, None, npu.library), "compiled"
    path = prepared.path
    cache = weight_cache_path(profile, prepared.cache_key, path) if acc == "xnnpack" else None
    if prefer_interpreter:
        runner = InterpreterRunner(path, layout, acc, threads, None, profile.runtime.backend)
        runner.hold_cache_files(profile.runtime.xnnpack_weight_cache_dir, prepared.cache_key)
        return runner, "interpreter"
    packing = cache not in (None, IN_MEMORY_WEIGHT_CACHE) and not os.path.exists(str(cache))
    compiled = CompiledRunner(path, layout, acc, threads, cache, None)
    if packing and os.path.exists(str(cache)):
        # XNNPACK keeps the buffers it packed into for the model's lifetime and writes the file
        # for the next load; reopening maps the file instead (~the packed size less RSS).
        compiled.close()
        del compiled
        give_back_memory()
        log.info("weights packed to %s; model reopened to map them", cache)
        compiled = CompiledRunner(path, layout, acc, threads, cache, None)
    compiled.hold_cache_files(profile.runtime.xnnpack_weight_cache_dir, prepared.cache_key)
    return compiled, "compiled"
