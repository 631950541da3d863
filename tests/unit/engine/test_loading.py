"""Loading apart from the engine: `load_model` reads the model once and the engine is built from
its value without touching the directory again; `kv_slots` sizes the engine from its limits."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from agent.engine.engine import Engine, EngineLimits
from agent.engine.loading import kv_slots, load_model
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.profile import DeviceProfile
from agent.profile.schema import KVConfig
from agent.runtime.plan import MemoryPlan

PROMPT = "def main():\n    return 1\n"
MIB = 1 << 20


def test_an_engine_is_built_from_a_loaded_model_with_the_directory_gone(
    tiny_model_dir: Path, dev_profile: DeviceProfile, tmp_path: Path
) -> None:
    """The daemon loads first and hands the value over: building the engine reads nothing of
    the model directory (here deleted in between) and answers as `Engine.load`'s does."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    model = load_model(dev_profile, d, quantization="fp32", state_dir=tmp_path / "state")
    shutil.rmtree(d)
    limits = EngineLimits(max_active=2, max_sessions=3)
    engine = Engine(dev_profile, model, limits=limits)
    reference = Engine.load(dev_profile, tiny_model_dir, quantization="fp32", limits=limits)
    try:
        request = GenerateRequest(PROMPT, max_tokens=6, sampling=SamplingParams(0.0))
        assert engine.complete(request).token_ids == reference.complete(request).token_ids
        assert engine.info.memory == engine.memory == reference.memory
        assert engine.info.sha256 == reference.info.sha256
        assert model.disk is not None or dev_profile.kv.disk_max_bytes == 0
    finally:
        engine.close()
        reference.close()


def test_kv_slots_are_what_the_limits_ask_for_cut_to_the_budget() -> None:
    """Beside the one KV cache the load counted, the budget left after the host tier and the
    prefix cache holds running requests first, then bound sessions."""
    load = MemoryPlan(100 * MIB, 0, 10 * MIB, 4 * MIB, 1, 150 * MIB)
    kv = KVConfig(host_max_bytes=8 * MIB, prefix_max_bytes=4 * MIB)
    # 150 - 114 - 12 = 24 MiB spare: 6 more caches, 7 slots in all
    active, memory = kv_slots(load, kv, max_active=4, max_sessions=16)
    assert active == 4
    assert memory == dataclasses.replace(load, sessions=7, spilled=12 * MIB)
    assert kv_slots(load, kv, max_active=16, max_sessions=16)[0] == 7
    assert kv_slots(load, kv, max_active=2, max_sessions=1)[1].sessions == 3
    # no room beside the load's own cache: one request runs, no session stays bound
    tight = dataclasses.replace(load, budget=load.total)
    active, memory = kv_slots(tight, KVConfig(), max_active=4, max_sessions=16)
    assert (active, memory.sessions) == (1, 1)
