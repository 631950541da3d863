"""Opening a model for an engine: the directory (or .litertlm bundle) and its variant, the
sha256 check, the tokenizer and chat template, the runtime's load, and how many KV caches
the memory budget holds beside it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.base.errors import ModelFormatError
from agent.chat.template import ChatTemplate, end_of_turn_ids, template_for
from agent.engine.stats import ModelInfo
from agent.model.directory import ModelMeta, Variant, defining_files, model_digest, sha256_file
from agent.model.open import open_model, unpack_cache_dir
from agent.profile import DeviceProfile, choose_quantization
from agent.runtime import litert
from agent.runtime.plan import MemoryPlan, expected_plan
from agent.runtime.prepare.cachefiles import parse_cache
from agent.tokenizer.base import Tokenizer
from agent.tokenizer.load import load_tokenizer


@dataclass(frozen=True, slots=True)
class EngineModel:
    """A loaded model and what the engine sizes around it."""

    meta: ModelMeta
    variant: Variant
    tokenizer: Tokenizer
    chat: ChatTemplate
    loaded: litert.LoadedModel
    memory: MemoryPlan  # the load's plan with the engine's KV caches counted
    max_active: int  # requests holding a KV cache at once
    info: ModelInfo
    stop_ids: frozenset[int]


def load_model(
    profile: DeviceProfile,
    model_dir: Path,
    *,
    quantization: str | None,
    verify: bool,
    prefer_interpreter: bool,
    state_dir: Path | None,
    kv_windows: bool,
    max_active: int,
    max_sessions: int,
) -> EngineModel:
    """Open, check and load `model_dir` under `profile`; `max_active` and `max_sessions` are
    the engine's limits, cut to what the budget holds."""
    meta: ModelMeta = open_model(  # a model directory or a .litertlm bundle
        model_dir, unpack_cache_dir(profile.runtime.xnnpack_weight_cache_dir, state_dir)
    )
    available = [v.quantization for v in meta.variants]
    quant = quantization or choose_quantization(profile, available)
    variant: Variant = meta.variant(quant)
    path = meta.path_of(variant)
    if verify:
        actual = sha256_file(path)
        if actual != variant.sha256:
            raise ModelFormatError(
                f"{path}: sha256 {actual} does not match metadata {variant.sha256}"
            )
    tokenizer: Tokenizer = load_tokenizer(meta.tokenizer_path)
    chat = template_for(meta.chat_template, tokenizer, meta.bos_id, meta.eos_id)
    loaded = litert.load(
        path,
        profile,
        context_length=meta.context_length,
        prefer_interpreter=prefer_interpreter,
        cache_key=variant.sha256,
        kv_windows=kv_windows,
    )
    runner = loaded.runner
    layout = runner.layout
    if layout.vocab_size < tokenizer.vocab_size:
        raise ModelFormatError(
            f"{path}: model vocabulary {layout.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}"
        )
    plan = loaded.memory
    # KV caches for running requests and bound sessions: as many as the limits ask for and
    # the budget holds beside the one the load counted, the host tier and the prefix cache.
    kvc = profile.kv
    spare = plan.budget - plan.total - kvc.host_max_bytes - kvc.prefix_max_bytes
    spare_slots = 1 + max(0, spare) // plan.kv_per_session
    max_active = max(1, min(max_active, spare_slots))
    bound_slots = max(0, min(max_sessions, spare_slots - max_active))
    memory = MemoryPlan(
        plan.weights,
        plan.packed_weights,
        plan.activations,
        plan.kv_per_session,
        max_active + bound_slots,
        plan.budget,
        kvc.host_max_bytes + kvc.prefix_max_bytes,
    )
    info = ModelInfo(
        digest=model_digest(defining_files(meta)),
        name=meta.name,
        version=meta.version,
        quantization=quant,
        sha256=variant.sha256,
        path=path,
        vocab_size=layout.vocab_size,
        context_length=layout.context_length,
        kv_layout=layout.kv.name,
        signatures=tuple(s.key for w in layout.all_windows() for s in w.signatures),
        accelerator=loaded.accelerator,
        execution_path=loaded.path_kind,
        fallbacks=loaded.fallbacks,
        memory=memory,
        prepared=loaded.prepared,
    )
    # the template's end-of-turn token ends an answer even if metadata.json omits it
    stop_ids = meta.stop_ids | end_of_turn_ids(chat, tokenizer)
    return EngineModel(meta, variant, tokenizer, chat, loaded, memory, max_active, info, stop_ids)


def estimate_memory(
    profile: DeviceProfile, model_dir: Path, quantization: str | None = None
) -> int:
    """Bytes an engine for this model would plan for one session, without loading it: the KV
    windows its load would add included (`plan.expected_plan`). The reading of the file is
    kept where its load will look for it."""
    from agent.model.tflite.file import read_model_file
    from agent.model.tflite.layout import discover_layout

    cache = unpack_cache_dir(profile.runtime.xnnpack_weight_cache_dir, None)
    meta = open_model(model_dir, cache)
    quant = quantization or choose_quantization(profile, [v.quantization for v in meta.variants])
    variant = meta.variant(quant)
    model = read_model_file(meta.path_of(variant), parse_cache(profile, variant.sha256))
    layout = discover_layout(model, meta.context_length)
    return expected_plan(model, layout, profile).total
