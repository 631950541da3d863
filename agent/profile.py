"""Device profiles: one TOML file per board class, parsed once into frozen dataclasses.

Three layers, each usable alone:

* ``parse_profile(data, source)`` is pure: a TOML document (already a dict) becomes a validated
  ``DeviceProfile`` or a ``ConfigError`` naming the file, the dotted key, the bad value and what
  is allowed. Unknown keys at any level are errors.
* ``load_profile(path)``, ``list_profiles()``, ``resolve_profile(...)`` do the file I/O.
* ``detect(root)`` reads a /proc-like tree under ``root`` (the real one by default, fixture trees
  in tests), scores every shipped profile against what it finds and says why it picked one.

The schema, the scoring rules and the shipped profiles are documented in docs/PROFILES.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.errors import ConfigError, ProfileNotFound
from agent.modeldir import QUANTIZATIONS
from agent.shipped import shipped_dir
from agent.tomltable import MISSING, GiB, MiB, TiB
from agent.tomltable import Table as _Table
from agent.tomltable import size_text as _size_text

log = logging.getLogger(__name__)


PROFILES_ENV: Final = "EDGE_AGENT_PROFILES_DIR"

BACKENDS: Final = ("ai-edge-litert", "tflite-runtime")
ACCELERATORS: Final = ("npu", "gpu", "xnnpack", "cpu")
ARENA_STRATEGIES: Final = ("kNextPowerOfTwo", "kSameAsRequested")
NPU_KINDS: Final = ("external_delegate", "dispatch")
ARCHES: Final = ("aarch64", "armv7l", "x86_64")
AUTO: Final = "auto"

MIN_MAX_NUM_BYTES: Final = 16 * MiB
MAX_MAX_NUM_BYTES: Final = TiB
# The largest vocabulary among the public LiteRT LLMs (Gemma 3: 262,144 entries). The runtime
# clamps top_k to the loaded model's vocabulary; this bound only catches typos.
MAX_TOP_K: Final = 262_144

# Quantizations from the smallest weight footprint to the largest. int4 block sizes differ only
# in how many scales they store (one per 128 / 64 / 32 weights); "mixed" is int8 with embeddings
# and attention output kept in float, so it is larger than int8.
FOOTPRINT_ORDER: Final = (
    "int4_block128",
    "int4_block64",
    "int4_block32",
    "int8",
    "mixed",
    "int8_weight_only",  # int8 on disk, dequantized to float when it loads
    "fp16",  # half the file of fp32, dequantized to float when it loads
    "fp32",
)
# tflite-runtime 2.14 cannot run int4 blockwise graphs (EMBEDDING_LOOKUP type error, FACTS.md),
# and its dynamic-range int8 kernels compute zeros (measured): it runs weight-only int8 or fp32.
LEGACY_ORDER: Final = ("int8_weight_only", "fp32")

# Detection scores (see docs/PROFILES.md).
SCORE_DEVICE_TREE: Final = 1000
SCORE_NPU_NODE: Final = 100

_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]*")
_FEATURE_RE: Final = re.compile(r"[a-z0-9_]+")
_SONAME_RE: Final = re.compile(r"lib[A-Za-z0-9_.+-]*\.so(\.[0-9]+)*")

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
GENERATION_KEYS: Final = ("max_tokens", "temperature", "top_k", "top_p", "prefill_chunk")
KV_KEYS: Final = ("host_max_bytes", "disk_max_bytes", "prefix_max_bytes", "preallocate")

NpuOptionValue = str | int | float | bool


# ---------------------------------------------------------------------------------------------
# The profile


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
    # give a single-length model KV windows at load (agent/runtime/windows.py)
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


# ---------------------------------------------------------------------------------------------
# Parsing


def _parse_board(t: _Table) -> BoardMatch:
    patterns = t.text_list("device_tree_model", default=())
    for i, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise t.error(
                f"device_tree_model[{i}]", pattern, f"a Python regular expression ({exc})"
            ) from exc
    arch = t.text_list("arch")
    if not arch:
        raise t.error("arch", [], "a non-empty list from " + ", ".join(ARCHES))
    for i, a in enumerate(arch):
        if a not in ARCHES:
            raise t.error(f"arch[{i}]", a, "one of " + ", ".join(repr(x) for x in ARCHES))
    features = t.text_list("cpu_features", default=())
    for i, feature in enumerate(features):
        if not _FEATURE_RE.fullmatch(feature):
            raise t.error(
                f"cpu_features[{i}]",
                feature,
                "a lower-case flag as /proc/cpuinfo spells it (e.g. 'asimd', 'avx2')",
            )
    nodes = t.text_list("npu_nodes", default=())
    for i, node in enumerate(nodes):
        if not node.startswith("/dev/") or ".." in node.split("/"):
            raise t.error(f"npu_nodes[{i}]", node, "a device node path under /dev/")
    ram_min = t.integer("ram_mb_min", 0, 1 << 24, default=0)
    ram_max = t.optional_integer("ram_mb_max", 1, 1 << 24)
    if ram_max is not None and ram_max < ram_min:
        raise t.error("ram_mb_max", ram_max, f"an integer >= board.ram_mb_min ({ram_min})")
    cores_min = t.integer("cores_min", 1, 1024, default=1)
    cores_max = t.optional_integer("cores_max", 1, 1024)
    if cores_max is not None and cores_max < cores_min:
        raise t.error("cores_max", cores_max, f"an integer >= board.cores_min ({cores_min})")
    return BoardMatch(
        device_tree_model=patterns,
        arch=arch,
        cpu_features=features,
        ram_mb_min=ram_min,
        ram_mb_max=ram_max,
        cores_min=cores_min,
        cores_max=cores_max,
        npu_nodes=nodes,
        priority=t.integer("priority", -1000, 1000, default=0),
    )


def _parse_runtime(t: _Table) -> RuntimeConfig:
    backend = t.choice("backend", BACKENDS)
    chain = t.text_list("accelerators")
    for i, acc in enumerate(chain):
        if acc not in ACCELERATORS:
            raise t.error(
                f"accelerators[{i}]", acc, "one of " + ", ".join(repr(a) for a in ACCELERATORS)
            )
    if len(set(chain)) != len(chain):
        raise t.error("accelerators", list(chain), "a list without duplicates")
    if not chain or chain[-1] != "cpu":
        raise t.error(
            "accelerators",
            list(chain),
            "a list that ends with 'cpu' (plain CPU kernels are the last resort)",
        )
    if "xnnpack" in chain:
        late = [a for a in ("npu", "gpu") if a in chain and chain.index(a) > chain.index("xnnpack")]
        if late:
            raise t.error(
                "accelerators",
                list(chain),
                f"{late[0]!r} before 'xnnpack' (XNNPACK claims nearly every op, "
                "so nothing would be left for it)",
            )
    return RuntimeConfig(
        backend=backend,
        accelerators=chain,
        num_threads=t.integer("num_threads", 1, 64),
        arena_extend_strategy=t.choice("arena_extend_strategy", ARENA_STRATEGIES),
        max_num_bytes=t.size("max_num_bytes", MIN_MAX_NUM_BYTES, MAX_MAX_NUM_BYTES),
        require_fused=t.flag("require_fused"),
        xnnpack_weight_cache_dir=t.absolute_path("xnnpack_weight_cache_dir"),
        kv_windows=t.flag("kv_windows", True),
    )


def _parse_npu(t: _Table) -> NpuConfig:
    kind = t.choice("kind", NPU_KINDS)
    library = t.text("library")
    if kind == "dispatch" and not library.startswith("/"):
        raise t.error("library", library, "an absolute path of the dispatch library directory")
    if kind == "external_delegate" and not (
        library.startswith("/") or _SONAME_RE.fullmatch(library)
    ):
        raise t.error(
            "library",
            library,
            "an absolute path of the delegate .so, or a bare soname such as 'libedgetpu.so.1'",
        )
    options: list[tuple[str, NpuOptionValue]] = []
    raw = t.raw.get("options", {})
    if not isinstance(raw, dict):
        raise t.error("options", raw, "a table of option = string | integer | float | boolean")
    for key, value in raw.items():
        if not isinstance(value, str | int | float | bool):
            raise t.error(f"options.{key}", value, "a string, integer, float or boolean")
        options.append((key, value))
    return NpuConfig(kind=kind, library=library, options=tuple(options))


def _parse_model(t: _Table) -> ModelChoice:
    return ModelChoice(
        quantization=t.choice("quantization", (AUTO, *QUANTIZATIONS)),
        path=t.absolute_path("path"),
    )


def _parse_generation(t: _Table) -> GenerationDefaults:
    return GenerationDefaults(
        max_tokens=t.integer("max_tokens", 1, 32768),
        temperature=t.number("temperature", 0.0, 2.0),
        top_k=t.integer("top_k", 0, MAX_TOP_K),
        top_p=t.number("top_p", 0.0, 1.0, lo_open=True),
        prefill_chunk=t.integer("prefill_chunk", 16, 4096),
    )


def _parse_kv(t: _Table | None) -> KVConfig:
    if t is None:
        return KVConfig()
    return KVConfig(
        host_max_bytes=t.size("host_max_bytes", 0, None, default=0),
        disk_max_bytes=t.size("disk_max_bytes", 0, None, default=0),
        prefix_max_bytes=t.size("prefix_max_bytes", 0, None, default=0),
        preallocate=t.flag("preallocate", default=False),
    )


def parse_profile(data: Mapping[str, object], source: str | Path) -> DeviceProfile:
    """Validate one parsed TOML document; `source` is the file it came from (names the errors).

    Pure: no I/O. The profile's ``name`` must equal the stem of `source`.
    """
    src = str(source)
    top = _Table(data, src, "", TOP_KEYS)
    name = top.text("name")
    if not _NAME_RE.fullmatch(name):
        raise top.error("name", name, "lower-case letters, digits, '-' and '_' (e.g. 'pi-5')")
    stem = Path(src).stem
    if name != stem:
        raise top.error(
            "name", name, f"the file's stem {stem!r} (a profile is named after its file)"
        )
    description = top.text("description")

    board_t = top.table("board", BOARD_KEYS, required=True)
    runtime_t = top.table("runtime", RUNTIME_KEYS, required=True)
    model_t = top.table("model", MODEL_KEYS, required=True)
    generation_t = top.table("generation", GENERATION_KEYS, required=True)
    npu_t = top.table("npu", NPU_KEYS, required=False)
    kv_t = top.table("kv", KV_KEYS, required=False)
    # required=True never returns None; the checks keep mypy honest without `assert`.
    if board_t is None or runtime_t is None or model_t is None or generation_t is None:
        raise ConfigError(src, "(profile)", data, "the tables board, runtime, model, generation")

    board = _parse_board(board_t)
    runtime = _parse_runtime(runtime_t)
    npu = _parse_npu(npu_t) if npu_t is not None else None
    model = _parse_model(model_t)
    generation = _parse_generation(generation_t)
    kv = _parse_kv(kv_t)

    # Rules that span sections.
    if "npu" in runtime.accelerators and npu is None:
        raise ConfigError(
            src, "npu", MISSING, "an [npu] table, because runtime.accelerators includes 'npu'"
        )
    if npu is not None and "npu" not in runtime.accelerators:
        raise ConfigError(
            src, "npu", data.get("npu"), "no [npu] table unless runtime.accelerators includes 'npu'"
        )
    if runtime.backend == "ai-edge-litert" and "armv7l" in board.arch:
        raise runtime_t.error(
            "backend",
            runtime.backend,
            "'tflite-runtime' when board.arch includes 'armv7l' "
            "(ai-edge-litert has no 32-bit Arm wheel)",
        )
    if runtime.backend == "tflite-runtime":
        if runtime.require_fused:
            raise runtime_t.error(
                "require_fused",
                True,
                "false with backend 'tflite-runtime' (it cannot load STABLEHLO_COMPOSITE ops)",
            )
        if model.quantization not in (AUTO, *LEGACY_ORDER):
            raise model_t.error(
                "quantization",
                model.quantization,
                "'auto', 'int8_weight_only' or 'fp32' with backend 'tflite-runtime' (it cannot "
                "run int4 graphs, and its dynamic-range int8 kernels compute zeros)",
            )
        if npu is not None and npu.kind == "dispatch":
            raise ConfigError(
                src,
                "npu.kind",
                npu.kind,
                "'external_delegate' with backend 'tflite-runtime' (dispatch needs ai-edge-litert)",
            )
    if board.ram_mb_min > 0 and runtime.max_num_bytes > board.ram_mb_min * MiB:
        raise runtime_t.error(
            "max_num_bytes",
            runtime.max_num_bytes,
            f"at most board.ram_mb_min ({board.ram_mb_min} MiB = {board.ram_mb_min * MiB} bytes): "
            "the budget must fit the smallest board the profile accepts",
        )
    if kv.host_max_bytes > runtime.max_num_bytes:
        raise ConfigError(
            src,
            "kv.host_max_bytes",
            kv.host_max_bytes,
            f"at most runtime.max_num_bytes ({runtime.max_num_bytes}): "
            "the host tier is part of that budget",
        )
    if kv.host_max_bytes + kv.prefix_max_bytes > runtime.max_num_bytes:
        raise ConfigError(
            src,
            "kv.prefix_max_bytes",
            kv.prefix_max_bytes,
            f"at most runtime.max_num_bytes - kv.host_max_bytes "
            f"({runtime.max_num_bytes - kv.host_max_bytes}): the host tier and the prefix cache "
            "are both part of that budget",
        )
    return DeviceProfile(
        name=name,
        description=description,
        source=Path(src),
        board=board,
        runtime=runtime,
        npu=npu,
        model=model,
        generation=generation,
        kv=kv,
    )


# ---------------------------------------------------------------------------------------------
# Files


def load_profile(path: Path) -> DeviceProfile:
    """Read and validate one profile file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ProfileNotFound(f"no profile file {path}") from exc
    except OSError as exc:
        raise ConfigError(str(path), "(file)", str(exc), "a readable file") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "(file)", str(exc), "UTF-8 text") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "(syntax)", str(exc), "TOML 1.0") from exc
    return parse_profile(data, path)


def profiles_dir() -> Path:
    """The shipped profiles: ``$EDGE_AGENT_PROFILES_DIR``, else the checkout's
    ``firmware_profiles/``, else the installed package's copy (`agent.shipped`)."""
    override = os.environ.get(PROFILES_ENV)
    if override:
        return Path(override)
    return shipped_dir("firmware_profiles")


def list_profiles(directory: Path | None = None) -> list[DeviceProfile]:
    """Every ``*.toml`` in `directory` (default: `profiles_dir()`), sorted by name.

    One broken file fails the whole listing: a shipped profile that does not parse is a bug.
    """
    where = directory if directory is not None else profiles_dir()
    if not where.is_dir():
        raise ProfileNotFound(f"profile directory {where} does not exist (see ${PROFILES_ENV})")
    return [load_profile(p) for p in sorted(where.glob("*.toml"))]


def resolve_profile(
    name_or_path: str | None, root: Path = Path("/")
) -> tuple[DeviceProfile, tuple[str, ...]]:
    """The profile to run and why.

    A value ending in ``.toml`` or containing a slash is a file; any other value is the name of a
    shipped profile; ``None`` means detect the board under `root`.
    """
    if name_or_path is None:
        found = detect(root)
        return found.profile, found.reasons
    if name_or_path.endswith(".toml") or "/" in name_or_path or os.sep in name_or_path:
        path = Path(name_or_path)
        return load_profile(path), (f"profile file {path} given explicitly",)
    where = profiles_dir()
    path = where / f"{name_or_path}.toml"
    if not path.is_file():
        names = sorted(p.stem for p in where.glob("*.toml")) if where.is_dir() else []
        raise ProfileNotFound(
            f"no shipped profile named {name_or_path!r} in {where}; "
            f"available: {', '.join(names) or '(none)'}"
        )
    return load_profile(path), (f"profile {name_or_path!r} given explicitly ({path})",)


def log_reasons(name: str, reasons: Sequence[str], *, detected: bool) -> None:
    """Why `name` runs, one INFO line per reason, for a command that resolved it; `detected`:
    detection chose it and has logged its first reason (the choice) already."""
    for r in reasons[1 if detected else 0 :]:
        log.info("profile %s: %s", name, r)


# ---------------------------------------------------------------------------------------------
# Quantization


def quantization_preference(max_num_bytes: int, backend: str = "ai-edge-litert") -> tuple[str, ...]:
    """The order in which ``auto`` tries quantizations for a memory budget.

    Under 2 GiB int4 (block32, then 64, then 128), from 2 GiB up to and including 4 GiB int8,
    above 4 GiB mixed. After the preferred ones come the smaller-footprint ones (largest first),
    then the larger ones (smallest first). tflite-runtime runs only weight-only int8 and fp32
    (int4 fails to load, dynamic-range int8 computes zeros), so it gets exactly those.
    """
    if backend == "tflite-runtime":
        return LEGACY_ORDER
    if max_num_bytes < 2 * GiB:
        preferred: tuple[str, ...] = ("int4_block32", "int4_block64", "int4_block128")
    elif max_num_bytes <= 4 * GiB:
        preferred = ("int8",)
    else:
        preferred = ("mixed",)
    first = FOOTPRINT_ORDER.index(preferred[0])
    smaller = tuple(reversed(FOOTPRINT_ORDER[:first]))
    larger = FOOTPRINT_ORDER[first + 1 :]
    return preferred + tuple(q for q in smaller + larger if q not in preferred)


def choose_quantization(profile: DeviceProfile, available: Sequence[str]) -> str:
    """Pick the model variant to load from the quantizations a model directory offers."""
    wanted = profile.model.quantization
    key = "model.quantization"
    offered = ", ".join(available) if available else "(none: the model directory has no variants)"
    if wanted != AUTO:
        if wanted in available:
            return wanted
        raise ConfigError(str(profile.source), key, wanted, f"one of the available: {offered}")
    order = quantization_preference(profile.runtime.max_num_bytes, profile.runtime.backend)
    for quant in order:
        if quant in available:
            log.info(
                "profile %s: budget %s, auto quantization -> %s (order %s)",
                profile.name,
                _size_text(profile.runtime.max_num_bytes),
                quant,
                ",".join(order),
            )
            return quant
    raise ConfigError(
        str(profile.source),
        key,
        wanted,
        f"a profile whose backend {profile.runtime.backend!r} can run one of: {offered}",
    )


# ---------------------------------------------------------------------------------------------
# Detection


@dataclass(frozen=True, slots=True)
class HardwareFacts:
    """What detection read from the board (paths are relative to `root`)."""

    root: Path
    arch: str | None
    arch_source: str
    device_tree_model: str | None
    model_source: str
    cpu_model: str | None
    cpu_features: frozenset[str]
    cpu_count: int | None
    ram_mb: int | None
    npu_nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Detection:
    """The chosen profile, the reasons in plain words, and the facts they rest on."""

    profile: DeviceProfile
    reasons: tuple[str, ...]
    facts: HardwareFacts


_ARCH_ALIASES: Final = {
    "arm64": "aarch64",
    "aarch64_be": "aarch64",
    "amd64": "x86_64",
    "x64": "x86_64",
    "armv8l": "armv7l",  # a 32-bit userland on a 64-bit core reports this
    "armhf": "armv7l",
}


def _normalize_arch(value: str) -> str:
    v = value.strip().lower()
    return _ARCH_ALIASES.get(v, v)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class _CpuInfo:
    features: frozenset[str]
    count: int
    model_name: str | None
    board_model: str | None
    cpu_architecture: str | None
    has_x86_flags: bool


def _parse_cpuinfo(text: str) -> _CpuInfo:
    features: set[str] = set()
    count = 0
    model_name = board_model = cpu_arch = None
    x86 = False
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor" and value.isdigit():
            count += 1
        elif key == "flags":
            x86 = True
            features.update(value.split())
        elif key == "Features":
            features.update(value.split())
        elif key == "model name" and model_name is None:
            model_name = value
        elif key == "Model" and board_model is None:
            board_model = value  # Raspberry Pi kernels repeat the board model here
        elif key == "CPU architecture" and cpu_arch is None:
            cpu_arch = value
    return _CpuInfo(frozenset(features), count, model_name, board_model, cpu_arch, x86)


def _arch_from_cpuinfo(info: _CpuInfo) -> str | None:
    if info.has_x86_flags:
        return "x86_64" if "lm" in info.features else "i686"
    if info.cpu_architecture == "8" or "asimd" in info.features:
        return "aarch64"
    if info.cpu_architecture == "7" or "neon" in info.features:
        return "armv7l"
    return None


def _ram_mb(meminfo: str | None) -> int | None:
    if meminfo is None:
        return None
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) // 1024
    return None


def read_facts(root: Path = Path("/"), nodes: Sequence[str] = ()) -> HardwareFacts:
    """Read the hardware facts detection needs from the tree under `root`.

    `nodes` are the device nodes to look for (the union of the profiles' ``npu_nodes``).
    Host-only fallbacks (``platform.machine()``, ``os.cpu_count()``) apply only when `root`
    is ``/``, so fixture trees are never mixed with the machine running the tests.
    """
    is_host = Path(root) == Path("/")
    cpuinfo_text = _read_text(root / "proc/cpuinfo")
    info = _parse_cpuinfo(cpuinfo_text or "")

    raw_model: bytes | None = None
    with contextlib.suppress(OSError):
        raw_model = (root / "proc/device-tree/model").read_bytes()
    dt_model: str | None = None
    model_source = "none"
    if raw_model is not None:
        dt_model = raw_model.split(b"\0", 1)[0].decode("utf-8", errors="replace").strip() or None
        model_source = "/proc/device-tree/model"
    if dt_model is None and info.board_model:
        dt_model, model_source = info.board_model, "the Model line of /proc/cpuinfo"

    arch: str | None = None
    arch_source = "unknown"
    kernel_arch = _read_text(root / "proc/sys/kernel/arch")
    if kernel_arch and kernel_arch.strip():
        arch, arch_source = _normalize_arch(kernel_arch), "/proc/sys/kernel/arch"
    elif (hint := _arch_from_cpuinfo(info)) is not None:
        arch, arch_source = hint, "/proc/cpuinfo"
    elif is_host and platform.machine():
        arch, arch_source = _normalize_arch(platform.machine()), "platform.machine()"
    if is_host and arch == "aarch64" and sys.maxsize <= 2**32:
        # 64-bit kernel, 32-bit userland (Raspberry Pi OS 32-bit boots a 64-bit kernel on Pi
        # 4/5): wheels must match this Python, not the kernel.
        arch, arch_source = "armv7l", f"{arch_source} with a 32-bit Python userland"

    count: int | None = info.count or None
    if count is None and is_host:
        count = os.cpu_count()

    present = tuple(n for n in dict.fromkeys(nodes) if (root / n.lstrip("/")).exists())
    return HardwareFacts(
        root=Path(root),
        arch=arch,
        arch_source=arch_source,
        device_tree_model=dt_model,
        model_source=model_source,
        cpu_model=info.model_name,
        cpu_features=info.features,
        cpu_count=count,
        ram_mb=_ram_mb(_read_text(root / "proc/meminfo")),
        npu_nodes=present,
    )


@dataclass(frozen=True, slots=True)
class _Verdict:
    profile: DeviceProfile
    score: int
    fits: tuple[str, ...]
    misfits: tuple[str, ...]
    dt_matched: bool

    @property
    def qualified(self) -> bool:
        return not self.misfits


def _range_text(lo: int, hi: int | None, unit: str) -> str:
    return f"{lo}–{hi} {unit}" if hi is not None else f">= {lo} {unit}"


def _check_range(
    fits: list[str],
    misfits: list[str],
    what: str,
    unit: str,
    value: int | None,
    lo: int,
    hi: int | None,
    unknown: str,
    *,
    active: bool,
) -> None:
    """Note whether a measured quantity (RAM, cores) lies in a profile's [lo, hi] range."""
    if not active and hi is None:
        return
    wanted = _range_text(lo, hi, unit)
    if value is None:
        misfits.append(f"{unknown}, needs {wanted}")
    elif value < lo or (hi is not None and value > hi):
        misfits.append(f"{_quantity(what, value, unit)} is outside {wanted}")
    else:
        fits.append(f"{_quantity(what, value, unit)} within {wanted}")


def _quantity(what: str, value: int, unit: str) -> str:
    return f"{what} {value} {unit}" if what == "RAM" else f"{value} {unit}"


def _evaluate(profile: DeviceProfile, facts: HardwareFacts) -> _Verdict:
    b = profile.board
    fits: list[str] = []
    misfits: list[str] = []
    score = 0
    dt_matched = False
    if b.device_tree_model:
        model = facts.device_tree_model
        hit = next((p for p in b.device_tree_model if model and re.search(p, model)), None)
        if hit is not None:
            dt_matched = True
            score += SCORE_DEVICE_TREE
            fits.append(
                f"device-tree model {model!r} (from {facts.model_source}) matches {hit!r} "
                f"(+{SCORE_DEVICE_TREE})"
            )
        elif model is None:
            misfits.append("no device-tree model to match its board patterns")
        else:
            misfits.append(f"device-tree model {model!r} matches none of its board patterns")

    if facts.arch in b.arch:
        fits.append(f"architecture {facts.arch} (from {facts.arch_source})")
    else:
        misfits.append(f"architecture {facts.arch or 'unknown'} is not {' or '.join(b.arch)}")

    missing = [f for f in b.cpu_features if f not in facts.cpu_features]
    if missing:
        misfits.append(f"CPU lacks required feature(s) {', '.join(missing)}")
    elif b.cpu_features:
        fits.append(f"CPU has {', '.join(b.cpu_features)}")

    _check_range(
        fits,
        misfits,
        "RAM",
        "MiB",
        facts.ram_mb,
        b.ram_mb_min,
        b.ram_mb_max,
        "RAM unknown (no MemTotal in /proc/meminfo)",
        active=b.ram_mb_min > 0,
    )
    _check_range(
        fits,
        misfits,
        "cores",
        "cores",
        facts.cpu_count,
        b.cores_min,
        b.cores_max,
        "core count unknown",
        active=b.cores_min > 1,
    )

    for node in b.npu_nodes:
        if node in facts.npu_nodes:
            score += SCORE_NPU_NODE
            fits.append(f"NPU device node {node} present (+{SCORE_NPU_NODE})")

    return _Verdict(profile, score, tuple(fits), tuple(misfits), dt_matched)


def _facts_text(facts: HardwareFacts) -> str:
    parts = [
        f"arch {facts.arch or 'unknown'}",
        f"model {facts.device_tree_model!r}" if facts.device_tree_model else "no device-tree model",
        f"{facts.cpu_count} cores" if facts.cpu_count else "core count unknown",
        f"RAM {facts.ram_mb} MiB" if facts.ram_mb is not None else "RAM unknown",
    ]
    if facts.npu_nodes:
        parts.append("nodes " + ", ".join(facts.npu_nodes))
    return ", ".join(parts)


def _is_close(v: _Verdict, facts: HardwareFacts) -> bool:
    """A runner-up worth a reason: it matched the board itself, or is a class of the same arch."""
    if v.dt_matched:
        return True
    return not v.profile.board.device_tree_model and facts.arch in v.profile.board.arch


def detect(root: Path = Path("/"), profiles: Sequence[DeviceProfile] | None = None) -> Detection:
    """Pick the profile for the board under `root` (default: this machine).

    `profiles` defaults to `list_profiles()`. Raises ``ProfileNotFound`` only when nothing fits
    and there is no ``generic-<arch>`` profile to fall back to.
    """
    candidates = list(profiles) if profiles is not None else list_profiles()
    nodes = [n for p in candidates for n in p.board.npu_nodes]
    facts = read_facts(root, nodes)
    verdicts = [_evaluate(p, facts) for p in candidates]
    ranked = sorted(
        (v for v in verdicts if v.qualified),
        key=lambda v: (-v.score, -v.profile.board.priority, v.profile.name),
    )
    generic_name = f"generic-{facts.arch}" if facts.arch else None
    reasons: list[str] = []
    if ranked:
        best = ranked[0]
        reasons.append(f"picked {best.profile.name} (score {best.score}) for: {_facts_text(facts)}")
        reasons.extend(best.fits)
        if best.profile.name == generic_name:
            reasons.append(
                f"no board-specific profile matched; using the generic profile for {facts.arch}"
            )
    else:
        generic = next((v for v in verdicts if v.profile.name == generic_name), None)
        if generic is None:
            raise ProfileNotFound(_no_profile_message(facts, verdicts))
        best = generic
        reasons.append(
            f"no profile fits this board ({_facts_text(facts)}); falling back to "
            f"{generic.profile.name}, the generic profile for {facts.arch}, although "
            + "; ".join(generic.misfits)
        )
    for v in verdicts:
        if v is best or not _is_close(v, facts):
            continue
        if v.qualified:
            mine, theirs = v.profile.board.priority, best.profile.board.priority
            if v.score == best.score and mine < theirs:
                why = f"ties at score {v.score} but has a lower priority ({mine} < {theirs})"
            elif v.score == best.score:
                why = f"ties at score {v.score} and priority {mine}; the name decides"
            else:
                why = f"fits too but scores {v.score} < {best.score}"
            reasons.append(f"not {v.profile.name}: {why}")
        else:
            reasons.append(f"not {v.profile.name}: {'; '.join(v.misfits)}")
    for node in facts.npu_nodes:
        if node not in best.profile.board.npu_nodes:
            reasons.append(
                f"{node} is present but {best.profile.name} does not use it "
                f"(accelerators: {', '.join(best.profile.runtime.accelerators)})"
            )
    log.info("profile %s chosen: %s", best.profile.name, reasons[0])
    return Detection(profile=best.profile, reasons=tuple(reasons), facts=facts)


def _no_profile_message(facts: HardwareFacts, verdicts: Sequence[_Verdict]) -> str:
    lines = [
        f"no profile fits this board ({_facts_text(facts)}) and there is no "
        f"generic-{facts.arch or 'unknown'} profile to fall back to"
    ]
    lines.extend(f"{v.profile.name}: {'; '.join(v.misfits)}" for v in verdicts if v.dt_matched)
    if facts.arch == "armv7l":
        lines.append(
            "32-bit Arm OS images need the legacy tflite-runtime backend (ai-edge-litert has no "
            "armv7l wheel): boot a 64-bit image, or pass a profile file written for tflite-runtime"
        )
    else:
        lines.append("pass --profile NAME or --profile PATH.toml")
    return "; ".join(lines)


# ---------------------------------------------------------------------------------------------
# Rendering


def _json_value(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


def as_json(profile: DeviceProfile) -> dict[str, object]:
    """The profile as JSON-ready values under its TOML keys (``profile show|list --json``):
    `name`, `description`, `source`, and one object per table with every key of that table,
    defaults filled in (`npu` is null without one; its `options` an object)."""
    tables: dict[str, object] = {"name": profile.name, "description": profile.description}
    tables["source"] = str(profile.source)
    for table, keys in (
        ("board", BOARD_KEYS),
        ("runtime", RUNTIME_KEYS),
        ("model", MODEL_KEYS),
        ("generation", GENERATION_KEYS),
        ("kv", KV_KEYS),
    ):
        section = getattr(profile, table)
        tables[table] = {key: _json_value(getattr(section, key)) for key in keys}
    npu = profile.npu
    tables["npu"] = (
        None
        if npu is None
        else {"kind": npu.kind, "library": npu.library, "options": dict(npu.options)}
    )
    return tables


def describe(profile: DeviceProfile) -> str:
    """A readable multi-line rendering (``edge-agent profile show``)."""
    b, r, m, g, kv = profile.board, profile.runtime, profile.model, profile.generation, profile.kv

    def row(label: str, value: object) -> str:
        return f"  {label:<22}{value}"

    def listed(items: Sequence[str]) -> str:
        return ", ".join(items) if items else "-"

    quant = m.quantization
    if quant == AUTO:
        order = quantization_preference(r.max_num_bytes, r.backend)
        quant = f"auto (tries {', '.join(order)})"
    lines = [
        f"{profile.name}: {profile.description}",
        row("source", profile.source),
        "board",
        row("device-tree model", listed(b.device_tree_model)),
        row("arch", listed(b.arch)),
        row("cpu features", listed(b.cpu_features)),
        row("RAM", _range_text(b.ram_mb_min, b.ram_mb_max, "MiB")),
        row("cores", _range_text(b.cores_min, b.cores_max, "")),
        row("NPU nodes", listed(b.npu_nodes)),
        row("priority", b.priority),
        "runtime",
        row("backend", r.backend),
        row("accelerators", " -> ".join(r.accelerators)),
        row("threads", r.num_threads),
        row("memory budget", f"{_size_text(r.max_num_bytes)} ({r.max_num_bytes} bytes)"),
        row("arena growth", r.arena_extend_strategy),
        row("require fused ops", "yes" if r.require_fused else "no"),
        row("xnnpack weight cache", r.xnnpack_weight_cache_dir or "-"),
        row("KV windows at load", "yes" if r.kv_windows else "no"),
    ]
    if profile.npu is not None:
        opts = ", ".join(f"{k}={v}" for k, v in profile.npu.options_as_strings().items())
        lines += [
            "npu",
            row("kind", profile.npu.kind),
            row("library", profile.npu.library),
            row("options", opts or "-"),
        ]
    lines += [
        "model",
        row("quantization", quant),
        row("path", m.path or "(default)"),
        "generation",
        row("max tokens", g.max_tokens),
        row("temperature", f"{g.temperature:g}" + (" (greedy)" if g.temperature == 0 else "")),
        row("top-k", g.top_k or "off"),
        row("top-p", f"{g.top_p:g}"),
        row("prefill chunk", g.prefill_chunk),
        "kv",
        row("host tier", _size_text(kv.host_max_bytes) if kv.host_max_bytes else "off"),
        row("disk tier", _size_text(kv.disk_max_bytes) if kv.disk_max_bytes else "off"),
        row("prefix cache", _size_text(kv.prefix_max_bytes) if kv.prefix_max_bytes else "off"),
        row("preallocate", "yes" if kv.preallocate else "no"),
    ]
    return "\n".join(line.rstrip() for line in lines)
