"""The profile schema: the frozen dataclasses a profile file becomes, the allowed values
and the keys of each TOML table (docs/PROFILES.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

BACKENDS: Final = ("ai-edge-litert", "tflite-runtime")
ACCELERATORS: Final = ("npu", "gpu", "xnnpack", "cpu")
ARENA_STRATEGIES: Final = ("kNextPowerOfTwo", "kSameAsRequested")
NPU_KINDS: Final = ("external_delegate", "dispatch")
ARCHES: Final = ("aarch64", "armv7l", "x86_64")
AUTO: Final = "auto"

TOP_KEYS: Final = ("name", "description", "board", "runtime", "npu", "model", "generation", "kv")
BOARD_KEYS: Final = (
    "device_tree_model",
    "arch",
    "cpu_features",
    "ram_mb_min",
    "ram_mb_max",
    "cores_min",
    "cores_max",
    "npu_nodes",
    "priority",
)
RUNTIME_KEYS: Final = (
    "backend",
    "accelerators",
    "num_threads",
    "arena_extend_strategy",
    "max_num_bytes",
    "require_fused",
    "xnnpack_weight_cache_dir",
    "kv_windows",
)
NPU_KEYS: Final = ("kind", "library", "options")
MODEL_KEYS: Final = ("quantization", "path")
GENERATION_KEYS: Final = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "prefill_chunk",
    "speculation",
)
# speculative decoding: none, or drafts by prompt lookup (agent.engine.drafts); "draft" (a
# second, smaller model) is named so that asking for it gets a clear "not available"
SPECULATION_MODES: Final = ("off", "ngram")
SPECULATION_UNAVAILABLE: Final = "draft"
KV_KEYS: Final = ("host_max_bytes", "disk_max_bytes", "prefix_max_bytes", "preallocate")

NpuOptionValue = str | int | float | bool


@dataclass(frozen=True, slots=True)
class BoardMatch:
    """How to recognise a board of this class. RAM is in MiB (MemTotal / 1024)."""

    device_tree_model: tuple[str, ...]
    arch: tuple[str, ...]
    cpu_features: tuple[str, ...]
    ram_mb_min: int
    ram_mb_max: int | None
    cores_min: int
    cores_max: int | None
    npu_nodes: tuple[str, ...]
    priority: int


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How LiteRT runs on the board and how much memory it may use."""

    backend: str
    accelerators: tuple[str, ...]
    num_threads: int
    arena_extend_strategy: str
    max_num_bytes: int
    require_fused: bool
    xnnpack_weight_cache_dir: Path | None
    # give a single-length model KV windows at load (agent/runtime/prepare/windows.py)
    kv_windows: bool = True


@dataclass(frozen=True, slots=True)
class NpuConfig:
    """The NPU entry of the accelerator chain."""

    kind: str
    library: str
    options: tuple[tuple[str, NpuOptionValue], ...]

    def options_as_strings(self) -> dict[str, str]:
        """Options as the string pairs a TFLite external delegate receives (bools lower-case)."""
        out: dict[str, str] = {}
        for key, value in self.options:
            out[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return out


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """Which model variant to run: ``auto`` or an explicit quantization, and a default dir."""

    quantization: str
    path: Path | None


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Defaults for requests that do not say otherwise."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    prefill_chunk: int
    speculation: str = "ngram"  # one of SPECULATION_MODES


@dataclass(frozen=True, slots=True)
class KVConfig:
    """KV tier budgets in bytes (zero turns a tier off) and how the runtime caches are made."""

    host_max_bytes: int = 0  # spilled sessions' used rows in RAM (counted in max_num_bytes)
    disk_max_bytes: int = 0  # session files in the state directory
    prefix_max_bytes: int = 0  # shared-prefix cache in RAM (counted in max_num_bytes)
    preallocate: bool = False  # make every runtime KV cache the budget allows at load


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One validated board-class profile."""

    name: str
    description: str
    source: Path
    board: BoardMatch
    runtime: RuntimeConfig
    npu: NpuConfig | None
    model: ModelChoice
    generation: GenerationDefaults
    kv: KVConfig
