"""Parsing: a TOML document (already a dict) becomes a validated `DeviceProfile`, or a
`ConfigError` naming the file, the dotted key, the bad value and what is allowed. Pure: no I/O."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from agent.base.errors import ConfigError
from agent.base.tomltable import MISSING, MiB, TiB
from agent.base.tomltable import Table as _Table
from agent.model.directory import QUANTIZATIONS
from agent.profile.quantization import LEGACY_ORDER
from agent.profile.schema import (
    ACCELERATORS,
    ARCHES,
    ARENA_STRATEGIES,
    AUTO,
    BACKENDS,
    BOARD_KEYS,
    GENERATION_KEYS,
    KV_KEYS,
    MODEL_KEYS,
    NPU_KEYS,
    NPU_KINDS,
    RUNTIME_KEYS,
    SPECULATION_MODES,
    SPECULATION_UNAVAILABLE,
    TOP_KEYS,
    BoardMatch,
    DeviceProfile,
    GenerationDefaults,
    KVConfig,
    ModelChoice,
    NpuConfig,
    NpuOptionValue,
    RuntimeConfig,
)

MIN_MAX_NUM_BYTES: Final = 16 * MiB
MAX_MAX_NUM_BYTES: Final = TiB
# The largest vocabulary among the public LiteRT LLMs (Gemma 3: 262,144 entries). The runtime
# clamps top_k to the loaded model's vocabulary; this bound only catches typos.
MAX_TOP_K: Final = 262_144

_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]*")
_FEATURE_RE: Final = re.compile(r"[a-z0-9_]+")
_SONAME_RE: Final = re.compile(r"lib[A-Za-z0-9_.+-]*\.so(\.[0-9]+)*")


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
        speculation=_speculation(t),
    )


def _speculation(t: _Table) -> str:
    if "speculation" not in t.raw:
        return "ngram"
    if t.raw["speculation"] == SPECULATION_UNAVAILABLE:
        allowed = ", ".join(repr(o) for o in SPECULATION_MODES)
        raise t.error(
            "speculation",
            SPECULATION_UNAVAILABLE,
            f"one of {allowed} (a draft model is not available in this version)",
        )
    return t.choice("speculation", SPECULATION_MODES)


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
