"""Device profiles: one TOML file per board class, parsed once into frozen dataclasses.

Three layers, each usable alone:

* ``parse_profile(data, source)`` is pure: a TOML document (already a dict) becomes a validated
  ``DeviceProfile`` or a ``ConfigError`` naming the file, the dotted key, the bad value and what
  is allowed. Unknown keys at any level are errors.
* ``load_profile(path)``, ``list_profiles()``, ``resolve_profile(...)`` do the file I/O.
* ``detect(root)`` reads a /proc-like tree under ``root`` (the real one by default, fixture trees
  in tests), scores every shipped profile against what it finds and says why it picked one.

The schema, the scoring rules and the shipped profiles are documented in docs/PROFILES.md.

The package, one noun a module: `schema` (the dataclasses, allowed values and table keys),
`parse` (validation), `load` (profile files, the shipped directory), `facts` (what the board's
/proc says), `detect` (scoring the profiles against those facts), `resolve` (which profile runs
and why), `quantization` (what ``auto`` picks), `describe` (``profile show`` text and JSON).
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
