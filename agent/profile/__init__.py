"""Device profiles: one TOML file per board class, parsed once into frozen dataclasses, in three
layers usable alone: ``parse_profile`` (pure validation), ``load_profile`` and friends (file
I/O), ``detect`` (which shipped profile fits a /proc-like tree, and why). docs/PROFILES.md.
"""

from agent.profile.describe import as_json, describe
from agent.profile.detect import SCORE_DEVICE_TREE, SCORE_NPU_NODE, Detection, detect
from agent.profile.facts import HardwareFacts, read_facts
from agent.profile.load import PROFILES_ENV, list_profiles, load_profile, profiles_dir
from agent.profile.parse import MAX_MAX_NUM_BYTES, MAX_TOP_K, MIN_MAX_NUM_BYTES, parse_profile
from agent.profile.quantization import (
    FOOTPRINT_ORDER,
    LEGACY_ORDER,
    choose_quantization,
    quantization_preference,
)
from agent.profile.resolve import log_reasons, resolve_profile
from agent.profile.schema import (
    ACCELERATORS,
    ARCHES,
    ARENA_STRATEGIES,
    AUTO,
    BACKENDS,
    NPU_KINDS,
    BoardMatch,
    DeviceProfile,
    GenerationDefaults,
    KVConfig,
    ModelChoice,
    NpuConfig,
    NpuOptionValue,
    RuntimeConfig,
)

__all__ = [
    "ACCELERATORS",
    "ARCHES",
    "ARENA_STRATEGIES",
    "AUTO",
    "BACKENDS",
    "FOOTPRINT_ORDER",
    "LEGACY_ORDER",
    "MAX_MAX_NUM_BYTES",
    "MAX_TOP_K",
    "MIN_MAX_NUM_BYTES",
    "NPU_KINDS",
    "PROFILES_ENV",
    "SCORE_DEVICE_TREE",
    "SCORE_NPU_NODE",
    "BoardMatch",
    "Detection",
    "DeviceProfile",
    "GenerationDefaults",
    "HardwareFacts",
    "KVConfig",
    "ModelChoice",
    "NpuConfig",
    "NpuOptionValue",
    "RuntimeConfig",
    "as_json",
    "choose_quantization",
    "describe",
    "detect",
    "list_profiles",
    "load_profile",
    "log_reasons",
    "parse_profile",
    "profiles_dir",
    "quantization_preference",
    "read_facts",
    "resolve_profile",
]
