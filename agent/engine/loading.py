"""Opening a model for an engine: the directory (or .litertlm bundle) and its variant, the
sha256 check, the tokenizer and chat template, the runtime's load and the model's saved
sessions, in one call (`load_model`) that the daemon makes before it hands the result to
`Engine`; and how many KV caches the memory budget holds beside the model (`kv_slots`, pure:
the engine sizes itself from its limits)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from agent.base.errors import ModelFormatError
from agent.chat.template import ChatTemplate, end_of_turn_ids, template_for
from agent.engine.sessions.store import open_disk_tier
from agent.engine.stats import ModelInfo
from agent.kv.disk import DiskTier
from agent.model.directory import ModelMeta, Variant, defining_files, model_digest, sha256_file
from agent.model.open import open_model, unpack_cache_dir
from agent.profile import DeviceProfile, choose_quantization
from agent.profile.schema import KVConfig
from agent.runtime import litert
from agent.runtime.plan import MemoryPlan, expected_plan
from agent.runtime.prepare.cachefiles import parse_cache
from agent.tokenizer.base import Tokenizer
from agent.tokenizer.load import load_tokenizer


@dataclass(frozen=True, slots=True)
class EngineModel:
    """A model opened, checked and loaded: everything an engine is built from. It is handed to
    one engine, which owns it from then on (closes its runner, writes its disk tier)."""

    meta: ModelMeta
    variant: Variant
    tokenizer: Tokenizer
    chat: ChatTemplate
    loaded: litert.LoadedModel
    info: ModelInfo  # its memory is the load's plan: the engine counts its KV caches in
    stop_ids: frozenset[int]
    disk: DiskTier | None  # the model's saved sessions under the state directory, if any


def load_model(
    profile: DeviceProfile,
    model_dir: Path,
    *,
    quantization: str | None = None,
    verify: bool = True,
    prefer_interpreter: bool = False,
    state_dir: Path | None = None,
    kv_windows: bool = True,
) -> EngineModel:
    """Open, check and load `model_dir` under `profile` (the variant `quantization`, else the
    profile's choice), and open its sessions' disk tier under `state_dir`."""
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
    layout = loaded.runner.layout
    if layout.vocab_size < tokenizer.vocab_size:
        raise ModelFormatError(
            f"{path}: model vocabulary {layout.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}"
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
        memory=loaded.memory,
        prepared=loaded.prepared,
    )
    # the template's end-of-turn token ends an answer even if metadata.json omits it
    stop_ids = meta.stop_ids | end_of_turn_ids(chat, tokenizer)
    disk = open_disk_tier(state_dir, variant.sha256, profile.kv.disk_max_bytes)
    return EngineModel(meta, variant, tokenizer, chat, loaded, info, stop_ids, disk)


def kv_slots(
    plan: MemoryPlan, kv: KVConfig, max_active: int, max_sessions: int
) -> tuple[int, MemoryPlan]:
    """How many requests hold a KV cache at once (`max_active`, cut to the budget) and the
    load's `plan` with the engine's KV caches counted: for running requests and bound
    sessions, as many as the limits ask for and the budget holds beside the one the load
    counted, the host tier and the prefix cache."""
    spare = plan.budget - plan.total - kv.host_max_bytes - kv.prefix_max_bytes
    spare_slots = 1 + max(0, spare) // plan.kv_per_session
    active = max(1, min(max_active, spare_slots))
    bound_slots = max(0, min(max_sessions, spare_slots - active))
    memory = dataclasses.replace(
        plan, sessions=active + bound_slots, spilled=kv.host_max_bytes + kv.prefix_max_bytes
    )
    return active, memory


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
