"""Device profiles: parsing, validation messages, quantization choice, hardware detection."""

from __future__ import annotations

import dataclasses
import re
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.base.errors import ConfigError, ProfileNotFound
from agent.base.tomltable import MISSING
from agent.model.directory import QUANTIZATIONS
from agent.profile import (
    PROFILES_ENV,
    DeviceProfile,
    KVConfig,
    choose_quantization,
    describe,
    detect,
    list_profiles,
    load_profile,
    parse_profile,
    profiles_dir,
    quantization_preference,
    resolve_profile,
)
from tests.support.paths import FIXTURES, ROOT

MiB = 1 << 20
GiB = 1 << 30
REPO = ROOT
SHIPPED_DIR = REPO / "firmware_profiles"
BOARDS = FIXTURES / "boards"
SOURCE = "/etc/edge-agent/profiles/testboard.toml"

REQUIRED_PROFILES = {
    "generic-x86_64",
    "generic-aarch64",
    "raspberry-pi-5",
    "raspberry-pi-4",
    "raspberry-pi-zero-2w",
    "coral-dev-board",
    "nxp-imx8mp",
    "wearable-1g",
}

BASE_TOML = """
name = "testboard"
description = "a test board"

[board]
device_tree_model = ['^Test Board\\b']
arch = ["aarch64"]
cpu_features = ["asimd"]
ram_mb_min = 1024
npu_nodes = ["/dev/apex_0"]

[runtime]
backend = "ai-edge-litert"
accelerators = ["npu", "xnnpack", "cpu"]
num_threads = 2
arena_extend_strategy = "kSameAsRequested"
max_num_bytes = 268_435_456
require_fused = true

[npu]
kind = "external_delegate"
library = "libedgetpu.so.1"

[npu.options]
device = "pci:0"
verbose = true
retries = 3

[model]
quantization = "auto"

[generation]
max_tokens = 256
temperature = 0.8
top_k = 40
top_p = 0.95
prefill_chunk = 256
"""


@pytest.fixture(autouse=True)
def _shipped_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROFILES_ENV, str(SHIPPED_DIR))


def base() -> dict[str, Any]:
    return tomllib.loads(BASE_TOML)


@pytest.fixture(scope="module")
def shipped() -> dict[str, DeviceProfile]:
    return {p.name: p for p in list_profiles(SHIPPED_DIR)}


# ---------------------------------------------------------------------------------------------
# Shipped profiles


def test_all_required_profiles_are_shipped(shipped: dict[str, DeviceProfile]) -> None:
    assert set(shipped) >= REQUIRED_PROFILES


@pytest.mark.parametrize("path", sorted(SHIPPED_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_profile_loads(path: Path) -> None:
    profile = load_profile(path)
    assert profile.name == path.stem
    assert profile.source == path
    assert profile.runtime.accelerators[-1] == "cpu"
    assert (profile.npu is not None) == ("npu" in profile.runtime.accelerators)
    text = describe(profile)
    assert text.splitlines()[0].startswith(f"{profile.name}: ")
    assert " -> ".join(profile.runtime.accelerators) in text


def test_shipped_numbers(shipped: dict[str, DeviceProfile]) -> None:
    budgets = {n: p.runtime.max_num_bytes for n, p in shipped.items()}
    assert budgets["raspberry-pi-zero-2w"] == 192 * MiB
    assert 256 * MiB <= budgets["wearable-1g"] <= 384 * MiB
    assert budgets["raspberry-pi-5"] == 2 * GiB
    assert shipped["generic-x86_64"].runtime.num_threads == 2
    assert shipped["generic-x86_64"].runtime.accelerators == ("xnnpack", "cpu")
    coral = shipped["coral-dev-board"]
    assert coral.npu is not None and coral.npu.library == "libedgetpu.so.1"
    assert coral.runtime.accelerators == ("npu", "xnnpack", "cpu")
    imx = shipped["nxp-imx8mp"]
    assert imx.npu is not None and imx.npu.library == "/usr/lib/libvx_delegate.so"
    assert imx.board.npu_nodes == ("/dev/galcore",)
    zero = shipped["raspberry-pi-zero-2w"]
    assert zero.board.arch == ("aarch64",) and zero.runtime.backend == "ai-edge-litert"
    # A generic profile must lose every tie against a board profile.
    generic_priority = max(shipped[n].board.priority for n in shipped if n.startswith("generic-"))
    assert all(
        p.board.priority > generic_priority
        for n, p in shipped.items()
        if not n.startswith("generic-")
    )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("Raspberry Pi 5 Model B Rev 1.0", {"raspberry-pi-5"}),
        ("Raspberry Pi 500 Rev 1.0", {"raspberry-pi-5"}),
        ("Raspberry Pi Compute Module 5 Rev 1.0", {"raspberry-pi-5"}),
        ("Raspberry Pi 4 Model B Rev 1.4", {"raspberry-pi-4"}),
        ("Raspberry Pi 400 Rev 1.0", {"raspberry-pi-4"}),
        ("Raspberry Pi Compute Module 4 Rev 1.0", {"raspberry-pi-4"}),
        ("Raspberry Pi Zero 2 W Rev 1.0", {"raspberry-pi-zero-2w", "raspberry-pi-3-32bit"}),
        ("Raspberry Pi 3 Model B Plus Rev 1.3", {"raspberry-pi-3-32bit"}),
        ("Raspberry Pi Zero W Rev 1.1", set()),
        ("Freescale i.MX8MQ Phanbell", {"coral-dev-board"}),
        ("Google i.MX8MQ Phanbell", {"coral-dev-board"}),
        ("NXP i.MX8MQ EVK", set()),
        ("NXP i.MX8MPlus EVK board", {"nxp-imx8mp"}),
        ("Toradex Verdin iMX8M Plus WB on Dahlia Board", {"nxp-imx8mp"}),
        ("NXP i.MX8MM EVK board", set()),
    ],
)
def test_device_tree_patterns(
    shipped: dict[str, DeviceProfile], model: str, expected: set[str]
) -> None:
    matched = {
        name
        for name, p in shipped.items()
        if any(re.search(pat, model) for pat in p.board.device_tree_model)
    }
    assert matched == expected


# ---------------------------------------------------------------------------------------------
# Parsing


def test_base_parses_with_defaults() -> None:
    p = parse_profile(base(), SOURCE)
    assert p.name == "testboard"
    assert p.source == Path(SOURCE)
    assert p.kv == KVConfig(host_max_bytes=0, disk_max_bytes=0, preallocate=False)
    assert p.board.ram_mb_max is None and p.board.cores_min == 1 and p.board.priority == 0
    assert p.runtime.xnnpack_weight_cache_dir is None and p.model.path is None
    assert p.npu is not None
    assert p.npu.options == (("device", "pci:0"), ("verbose", True), ("retries", 3))
    assert p.npu.options_as_strings() == {"device": "pci:0", "verbose": "true", "retries": "3"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "x"  # type: ignore[misc]


def test_kv_section_and_integer_floats() -> None:
    d = base()
    d["kv"] = {"host_max_bytes": 64 * MiB, "disk_max_bytes": 1 << 33, "preallocate": True}
    d["generation"]["temperature"] = 1  # an integer is a valid number
    p = parse_profile(d, SOURCE)
    assert p.kv == KVConfig(host_max_bytes=64 * MiB, disk_max_bytes=1 << 33, preallocate=True)
    assert p.generation.temperature == 1.0 and isinstance(p.generation.temperature, float)


def _set(section: str | None, key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        (d if section is None else d.setdefault(section, {}))[key] = value

    return mutate


def _del(section: str | None, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        del (d if section is None else d[section])[key]

    return mutate


def _both(*fs: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        for f in fs:
            f(d)

    return mutate


TFLITE = _both(
    _set("runtime", "backend", "tflite-runtime"), _set("runtime", "require_fused", False)
)

BAD_PROFILES: list[tuple[str, Callable[[dict[str, Any]], None], str, object, str]] = [
    # (id, mutation, key, value, part of "allowed")
    ("unknown-top", _set(None, "colour", "red"), "colour", "red", "keys of the top level"),
    (
        "unknown-runtime",
        _set("runtime", "num_thread", 2),
        "runtime.num_thread",
        2,
        "did you mean 'num_threads'?",
    ),
    ("unknown-board", _set("board", "ram_gb", 1), "board.ram_gb", 1, "keys of [board]: "),
    ("unknown-npu", _set("npu", "path", "/x.so"), "npu.path", "/x.so", "keys of [npu]"),
    ("unknown-kv", _set("kv", "host_bytes", 1), "kv.host_bytes", 1, "keys of [kv]"),
    ("missing-key", _del("runtime", "backend"), "runtime.backend", MISSING, "(required)"),
    ("missing-section", _del(None, "generation"), "generation", MISSING, "[generation]"),
    ("section-type", _set(None, "board", "pi"), "board", "pi", "a table [board]"),
    ("threads-type", _set("runtime", "num_threads", "4"), "runtime.num_threads", "4", "1 to 64"),
    ("threads-bool", _set("runtime", "num_threads", True), "runtime.num_threads", True, "1 to 64"),
    ("threads-low", _set("runtime", "num_threads", 0), "runtime.num_threads", 0, "1 to 64"),
    ("threads-high", _set("runtime", "num_threads", 65), "runtime.num_threads", 65, "1 to 64"),
    (
        "budget-low",
        _set("runtime", "max_num_bytes", 8 * MiB),
        "runtime.max_num_bytes",
        8 * MiB,
        "from 16777216 (16 MiB)",
    ),
    (
        "budget-float",
        _set("runtime", "max_num_bytes", 2.5e8),
        "runtime.max_num_bytes",
        2.5e8,
        "an integer number of bytes",
    ),
    (
        "backend-enum",
        _set("runtime", "backend", "tflite"),
        "runtime.backend",
        "tflite",
        "one of 'ai-edge-litert', 'tflite-runtime'",
    ),
    (
        "arena-enum",
        _set("runtime", "arena_extend_strategy", "kPowerOfTwo"),
        "runtime.arena_extend_strategy",
        "kPowerOfTwo",
        "'kNextPowerOfTwo', 'kSameAsRequested'",
    ),
    (
        "fused-type",
        _set("runtime", "require_fused", "yes"),
        "runtime.require_fused",
        "yes",
        "true or false",
    ),
    (
        "kv-windows-type",
        _set("runtime", "kv_windows", 1),
        "runtime.kv_windows",
        1,
        "true or false",
    ),
    (
        "accel-enum",
        _set("runtime", "accelerators", ["tpu", "cpu"]),
        "runtime.accelerators[0]",
        "tpu",
        "'npu', 'gpu', 'xnnpack', 'cpu'",
    ),
    (
        "accel-no-cpu",
        _set("runtime", "accelerators", ["npu", "xnnpack"]),
        "runtime.accelerators",
        ["npu", "xnnpack"],
        "ends with 'cpu'",
    ),
    (
        "accel-dup",
        _set("runtime", "accelerators", ["npu", "xnnpack", "xnnpack", "cpu"]),
        "runtime.accelerators",
        ["npu", "xnnpack", "xnnpack", "cpu"],
        "without duplicates",
    ),
    (
        "accel-order",
        _set("runtime", "accelerators", ["xnnpack", "npu", "cpu"]),
        "runtime.accelerators",
        ["xnnpack", "npu", "cpu"],
        "'npu' before 'xnnpack'",
    ),
    (
        "accel-type",
        _set("runtime", "accelerators", "cpu"),
        "runtime.accelerators",
        "cpu",
        "a list of strings",
    ),
    ("npu-missing", _del(None, "npu"), "npu", MISSING, "runtime.accelerators includes 'npu'"),
    (
        "npu-unused",
        _set("runtime", "accelerators", ["xnnpack", "cpu"]),
        "npu",
        tomllib.loads(BASE_TOML)["npu"],
        "no [npu] table unless",
    ),
    (
        "npu-kind",
        _set("npu", "kind", "delegate"),
        "npu.kind",
        "delegate",
        "'external_delegate', 'dispatch'",
    ),
    ("npu-library", _set("npu", "library", "edgetpu"), "npu.library", "edgetpu", "soname"),
    (
        "npu-dispatch-relative",
        _both(_set("npu", "kind", "dispatch"), _set("npu", "library", "x")),
        "npu.library",
        "x",
        "absolute path",
    ),
    (
        "npu-option-table",
        _set("npu", "options", {"device": {"x": 1}}),
        "npu.options.device",
        {"x": 1},
        "a string, integer, float or boolean",
    ),
    ("name-stem", _set(None, "name", "other"), "name", "other", "the file's stem 'testboard'"),
    ("name-chars", _set(None, "name", "Test Board"), "name", "Test Board", "lower-case"),
    ("description-empty", _set(None, "description", " "), "description", " ", "non-empty"),
    (
        "quant-enum",
        _set("model", "quantization", "int3"),
        "model.quantization",
        "int3",
        "'auto', 'fp32', 'fp16', 'int8', 'int4_block32'",
    ),
    (
        "model-path-relative",
        _set("model", "path", "models/demo"),
        "model.path",
        "models/demo",
        "an absolute path",
    ),
    (
        "cache-dir-relative",
        _set("runtime", "xnnpack_weight_cache_dir", "cache"),
        "runtime.xnnpack_weight_cache_dir",
        "cache",
        "an absolute path",
    ),
    (
        "max-tokens",
        _set("generation", "max_tokens", 40000),
        "generation.max_tokens",
        40000,
        "from 1 to 32768",
    ),
    (
        "temperature",
        _set("generation", "temperature", 2.5),
        "generation.temperature",
        2.5,
        "from 0 to 2",
    ),
    (
        "temperature-neg",
        _set("generation", "temperature", -0.1),
        "generation.temperature",
        -0.1,
        "from 0 to 2",
    ),
    ("top-k", _set("generation", "top_k", -1), "generation.top_k", -1, "from 0 to 262144"),
    (
        "top-p-zero",
        _set("generation", "top_p", 0),
        "generation.top_p",
        0,
        "greater than 0 and at most 1",
    ),
    (
        "top-p-high",
        _set("generation", "top_p", 1.01),
        "generation.top_p",
        1.01,
        "greater than 0 and at most 1",
    ),
    (
        "prefill-low",
        _set("generation", "prefill_chunk", 8),
        "generation.prefill_chunk",
        8,
        "from 16 to 4096",
    ),
    (
        "arch-enum",
        _set("board", "arch", ["arm64"]),
        "board.arch[0]",
        "arm64",
        "'aarch64', 'armv7l', 'x86_64'",
    ),
    ("arch-empty", _set("board", "arch", []), "board.arch", [], "a non-empty list"),
    (
        "dt-regex",
        _set("board", "device_tree_model", ["ok", "("]),
        "board.device_tree_model[1]",
        "(",
        "a Python regular expression",
    ),
    (
        "feature-case",
        _set("board", "cpu_features", ["ASIMD"]),
        "board.cpu_features[0]",
        "ASIMD",
        "lower-case flag",
    ),
    (
        "node-path",
        _set("board", "npu_nodes", ["apex_0"]),
        "board.npu_nodes[0]",
        "apex_0",
        "under /dev/",
    ),
    (
        "ram-range",
        _set("board", "ram_mb_max", 512),
        "board.ram_mb_max",
        512,
        ">= board.ram_mb_min (1024)",
    ),
    (
        "budget-over-ram",
        _set("runtime", "max_num_bytes", 2 * GiB),
        "runtime.max_num_bytes",
        2 * GiB,
        "at most board.ram_mb_min (1024 MiB",
    ),
    (
        "kv-host-over-budget",
        _set("kv", "host_max_bytes", 512 * MiB),
        "kv.host_max_bytes",
        512 * MiB,
        "at most runtime.max_num_bytes (268435456)",
    ),
    ("kv-bool", _set("kv", "preallocate", "yes"), "kv.preallocate", "yes", "true or false"),
    ("kv-negative", _set("kv", "disk_max_bytes", -1), "kv.disk_max_bytes", -1, ">= 0"),
    (
        "armv7l-litert",
        _set("board", "arch", ["armv7l"]),
        "runtime.backend",
        "ai-edge-litert",
        "'tflite-runtime' when board.arch includes 'armv7l'",
    ),
    (
        "tflite-fused",
        _set("runtime", "backend", "tflite-runtime"),
        "runtime.require_fused",
        True,
        "cannot load STABLEHLO_COMPOSITE",
    ),
    (
        "tflite-int4",
        _both(TFLITE, _set("model", "quantization", "int4_block32")),
        "model.quantization",
        "int4_block32",
        "cannot run int4",
    ),
    (
        "tflite-dispatch",
        _both(TFLITE, _set("npu", "kind", "dispatch"), _set("npu", "library", "/x")),
        "npu.kind",
        "dispatch",
        "dispatch needs ai-edge-litert",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "key", "value", "allowed"),
    [case[1:] for case in BAD_PROFILES],
    ids=[case[0] for case in BAD_PROFILES],
)
def test_bad_profile(
    mutate: Callable[[dict[str, Any]], None], key: str, value: object, allowed: str
) -> None:
    d = base()
    mutate(d)
    with pytest.raises(ConfigError) as info:
        parse_profile(d, SOURCE)
    err = info.value
    assert err.source == SOURCE
    assert err.key == key
    if value is MISSING:
        assert err.value is MISSING
    else:
        assert err.value == value and type(err.value) is type(value)
    assert allowed in err.allowed
    message = str(err)
    assert message.startswith(f"{SOURCE}: {key} = {value!r} ")
    assert allowed in message


def test_bad_cases_are_each_valid_without_their_mutation() -> None:
    # Guard against a table entry that fails for a reason other than the one it names.
    parse_profile(base(), SOURCE)
    d = base()
    TFLITE(d)
    parse_profile(d, SOURCE)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_num_threads_range(n: int) -> None:
    d = base()
    d["runtime"]["num_threads"] = n
    if 1 <= n <= 64:
        assert parse_profile(d, SOURCE).runtime.num_threads == n
    else:
        with pytest.raises(ConfigError, match=r"runtime\.num_threads"):
            parse_profile(d, SOURCE)


@settings(max_examples=60, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_top_p_range(p: float) -> None:
    d = base()
    d["generation"]["top_p"] = p
    if 0 < p <= 1:
        assert parse_profile(d, SOURCE).generation.top_p == p
    else:
        with pytest.raises(ConfigError, match=r"generation\.top_p"):
            parse_profile(d, SOURCE)


def test_load_profile_checks_name_against_file(tmp_path: Path) -> None:
    path = tmp_path / "my-board.toml"
    path.write_text(BASE_TOML)
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert (info.value.source, info.value.key, info.value.value) == (str(path), "name", "testboard")
    assert "'my-board'" in info.value.allowed


def test_load_profile_syntax_error_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("name = \n")
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert info.value.source == str(path) and info.value.key == "(syntax)"
    with pytest.raises(ProfileNotFound):
        load_profile(tmp_path / "nope.toml")


# ---------------------------------------------------------------------------------------------
# Quantization


def _profile(budget: int, quant: str = "auto", backend: str = "ai-edge-litert") -> DeviceProfile:
    p = parse_profile(base(), SOURCE)
    runtime = dataclasses.replace(
        p.runtime, max_num_bytes=budget, backend=backend, require_fused=False
    )
    model = dataclasses.replace(p.model, quantization=quant)
    return dataclasses.replace(p, runtime=runtime, model=model)


ALL = list(QUANTIZATIONS)


@pytest.mark.parametrize(
    ("budget", "quant", "backend", "available", "expected"),
    [
        (1 * GiB, "auto", "ai-edge-litert", ALL, "int4_block32"),
        (
            1 * GiB,
            "auto",
            "ai-edge-litert",
            ["int4_block128", "int4_block64", "int8"],
            "int4_block64",
        ),
        (1 * GiB, "auto", "ai-edge-litert", ["int4_block128", "int8"], "int4_block128"),
        (1 * GiB, "auto", "ai-edge-litert", ["fp32", "int8"], "int8"),
        (1 * GiB, "auto", "ai-edge-litert", ["fp32", "mixed"], "mixed"),
        (2 * GiB - 1, "auto", "ai-edge-litert", ALL, "int4_block32"),
        (2 * GiB, "auto", "ai-edge-litert", ALL, "int8"),
        (4 * GiB, "auto", "ai-edge-litert", ALL, "int8"),
        (4 * GiB + 1, "auto", "ai-edge-litert", ALL, "mixed"),
        (
            3 * GiB,
            "auto",
            "ai-edge-litert",
            ["int4_block64", "int4_block32", "mixed"],
            "int4_block32",
        ),
        (3 * GiB, "auto", "ai-edge-litert", ["mixed", "fp32"], "mixed"),
        (8 * GiB, "auto", "ai-edge-litert", ["int4_block32", "int8"], "int8"),
        (8 * GiB, "auto", "ai-edge-litert", ["fp32"], "fp32"),
        (1 * GiB, "int8", "ai-edge-litert", ["mixed", "int8"], "int8"),
        (
            1 * GiB,
            "auto",
            "tflite-runtime",
            ["int4_block32", "int8", "int8_weight_only"],
            "int8_weight_only",
        ),
        (1 * GiB, "auto", "tflite-runtime", ["int8", "fp32"], "fp32"),
    ],
)
def test_choose_quantization(
    budget: int, quant: str, backend: str, available: list[str], expected: str
) -> None:
    assert choose_quantization(_profile(budget, quant, backend), available) == expected


def test_choose_quantization_explicit_not_available() -> None:
    profile = _profile(1 * GiB, "int4_block64")
    with pytest.raises(ConfigError) as info:
        choose_quantization(profile, ["int8", "int4_block32"])
    err = info.value
    assert (err.source, err.key, err.value) == (SOURCE, "model.quantization", "int4_block64")
    assert "int8, int4_block32" in err.allowed


@pytest.mark.parametrize(
    ("backend", "available"),
    [("ai-edge-litert", []), ("tflite-runtime", ["int4_block32", "int8", "mixed"])],
)
def test_choose_quantization_nothing_usable(backend: str, available: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        choose_quantization(_profile(1 * GiB, "auto", backend), available)
    assert info.value.key == "model.quantization" and info.value.source == SOURCE


def test_preference_order_is_documented_order() -> None:
    assert quantization_preference(1 * GiB) == (
        "int4_block32",
        "int4_block64",
        "int4_block128",
        "int8",
        "mixed",
        "int8_weight_only",
        "fp16",
        "fp32",
    )
    assert quantization_preference(3 * GiB) == (
        "int8",
        "int4_block32",
        "int4_block64",
        "int4_block128",
        "mixed",
        "int8_weight_only",
        "fp16",
        "fp32",
    )
    assert quantization_preference(5 * GiB) == (
        "mixed",
        "int8",
        "int4_block32",
        "int4_block64",
        "int4_block128",
        "int8_weight_only",
        "fp16",
        "fp32",
    )
    assert quantization_preference(1 * GiB, "tflite-runtime") == ("int8_weight_only", "fp32")


@settings(max_examples=80, deadline=None)
@given(
    st.integers(min_value=16 * MiB, max_value=64 * GiB),
    st.lists(st.sampled_from(QUANTIZATIONS), min_size=1, unique=True),
)
def test_choose_quantization_properties(budget: int, available: list[str]) -> None:
    got = choose_quantization(_profile(budget), available)
    assert got in available
    if budget < 2 * GiB and any(q.startswith("int4_") for q in available):
        assert got.startswith("int4_")
    elif 2 * GiB <= budget <= 4 * GiB and "int8" in available:
        assert got == "int8"
    elif budget > 4 * GiB and "mixed" in available:
        assert got == "mixed"
    if got == "fp32":
        assert available == ["fp32"]


# ---------------------------------------------------------------------------------------------
# Detection


@pytest.mark.parametrize(
    ("board", "expected", "fact"),
    [
        ("raspberry-pi-5", "raspberry-pi-5", "'Raspberry Pi 5 Model B Rev 1.0'"),
        ("raspberry-pi-4", "raspberry-pi-4", "'Raspberry Pi 4 Model B Rev 1.4'"),
        ("raspberry-pi-zero-2w", "raspberry-pi-zero-2w", "'Raspberry Pi Zero 2 W Rev 1.0'"),
        ("coral-dev-board", "coral-dev-board", "NPU device node /dev/apex_0 present"),
        ("nxp-imx8mp-evk", "nxp-imx8mp", "NPU device node /dev/galcore present"),
        ("x86-devbox", "generic-x86_64", "CPU has avx2"),
        ("unknown-aarch64", "generic-aarch64", "no board-specific profile matched"),
        ("wearable-2core", "wearable-1g", "2 cores within 1–2 cores"),
    ],
)
def test_detect_fixture_boards(board: str, expected: str, fact: str) -> None:
    found = detect(BOARDS / board)
    assert found.profile.name == expected, found.reasons
    assert any(fact in r for r in found.reasons), found.reasons
    assert found.reasons[0].startswith(f"picked {expected} ")


def test_detect_reads_facts() -> None:
    pi5 = detect(BOARDS / "raspberry-pi-5").facts
    assert pi5.device_tree_model == "Raspberry Pi 5 Model B Rev 1.0"  # NUL stripped
    assert pi5.model_source == "/proc/device-tree/model"
    assert (pi5.arch, pi5.arch_source) == ("aarch64", "/proc/cpuinfo")
    assert pi5.cpu_count == 4 and pi5.ram_mb == 8245088 // 1024
    assert {"asimd", "asimddp"} <= pi5.cpu_features
    x86 = detect(BOARDS / "x86-devbox").facts
    assert (x86.arch, x86.arch_source) == ("x86_64", "/proc/sys/kernel/arch")
    assert x86.device_tree_model is None and x86.cpu_count == 8
    assert x86.cpu_model == "Intel(R) Core(TM) i7-8565U CPU @ 1.80GHz"
    rock = detect(BOARDS / "unknown-aarch64").facts
    assert rock.cpu_count == 8 and rock.device_tree_model == "Radxa ROCK 5B"


def test_detect_explains_runners_up() -> None:
    pi5 = detect(BOARDS / "raspberry-pi-5")
    assert "not generic-aarch64: fits too but scores 0 < 1000" in pi5.reasons
    unknown = detect(BOARDS / "unknown-aarch64")
    why_not_wearable = [r for r in unknown.reasons if r.startswith("not wearable-1g: ")]
    assert len(why_not_wearable) == 1 and "8 cores is outside 1–2 cores" in why_not_wearable[0]
    # Profiles that failed on their own board patterns are not "close" and not listed.
    assert not any(r.startswith("not raspberry-pi-4") for r in pi5.reasons)


def _copy_board(board: str, tmp_path: Path) -> Path:
    root = tmp_path / board
    shutil.copytree(BOARDS / board, root)
    return root


def test_small_pi5_falls_back_and_says_why(tmp_path: Path) -> None:
    root = _copy_board("raspberry-pi-5", tmp_path)
    (root / "proc/meminfo").write_text("MemTotal:        2000000 kB\n")
    found = detect(root)
    assert found.profile.name == "generic-aarch64"
    assert any(
        r.startswith("not raspberry-pi-5: ") and "RAM 1953 MiB is outside >= 3584 MiB" in r
        for r in found.reasons
    ), found.reasons


def test_npu_node_adds_score_but_board_match_dominates(tmp_path: Path) -> None:
    root = _copy_board("coral-dev-board", tmp_path)
    (root / "dev/apex_0").unlink()
    found = detect(root)
    assert found.profile.name == "coral-dev-board"
    assert not any("apex_0" in r for r in found.reasons)
    assert found.reasons[0].startswith("picked coral-dev-board (score 1000)")
    assert (
        detect(BOARDS / "coral-dev-board")
        .reasons[0]
        .startswith("picked coral-dev-board (score 1100)")
    )

    pi5 = _copy_board("raspberry-pi-5", tmp_path)
    (pi5 / "dev").mkdir()
    (pi5 / "dev/apex_0").write_bytes(b"")  # a Coral M.2 card on a Pi 5
    found = detect(pi5)
    assert found.profile.name == "raspberry-pi-5"
    assert any(
        r.startswith("/dev/apex_0 is present but raspberry-pi-5 does not use it")
        for r in found.reasons
    )


def test_model_line_of_cpuinfo_stands_in_for_device_tree(tmp_path: Path) -> None:
    root = _copy_board("raspberry-pi-4", tmp_path)
    shutil.rmtree(root / "proc/device-tree")
    found = detect(root)
    assert found.profile.name == "raspberry-pi-4"
    assert any("the Model line of /proc/cpuinfo" in r for r in found.reasons)


def test_nothing_fits_falls_back_to_generic_of_the_arch(tmp_path: Path) -> None:
    root = _copy_board("unknown-aarch64", tmp_path)
    (root / "proc/meminfo").write_text("MemTotal:         524288 kB\n")  # 512 MiB, 8 cores
    found = detect(root)
    assert found.profile.name == "generic-aarch64"
    assert found.reasons[0].startswith("no profile fits this board")
    assert "RAM 512 MiB is outside >= 896 MiB" in found.reasons[0]


def test_32bit_zero_2w_gets_the_legacy_backend_profile() -> None:
    found = detect(BOARDS / "raspberry-pi-zero-2w-32bit")
    assert found.profile.name == "raspberry-pi-3-32bit"
    assert found.profile.runtime.backend == "tflite-runtime"
    assert found.profile.runtime.require_fused is False
    text = " ".join(found.reasons)
    assert "armv7l" in text


def test_priority_breaks_ties(shipped: dict[str, DeviceProfile]) -> None:
    generic = shipped["generic-aarch64"]
    a = dataclasses.replace(
        generic, name="a-board", board=dataclasses.replace(generic.board, priority=0)
    )
    z = dataclasses.replace(
        generic, name="z-board", board=dataclasses.replace(generic.board, priority=5)
    )
    found = detect(BOARDS / "unknown-aarch64", profiles=[a, z])
    assert found.profile.name == "z-board"
    assert "not a-board: ties at score 0 but has a lower priority (0 < 5)" in found.reasons


# ---------------------------------------------------------------------------------------------
# Resolution


def test_profiles_dir_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(PROFILES_ENV)
    assert profiles_dir() == SHIPPED_DIR
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    assert profiles_dir() == tmp_path


def test_resolve_profile(tmp_path: Path) -> None:
    by_name, why = resolve_profile("raspberry-pi-4")
    assert by_name.name == "raspberry-pi-4" and "given explicitly" in why[0]
    path = tmp_path / "testboard.toml"
    path.write_text(BASE_TOML)
    by_path, _ = resolve_profile(str(path))
    assert by_path.name == "testboard" and by_path.source == path
    detected, reasons = resolve_profile(None, root=BOARDS / "coral-dev-board")
    assert detected.name == "coral-dev-board" and reasons[0].startswith("picked coral-dev-board")
    with pytest.raises(ProfileNotFound, match=r"available: .*raspberry-pi-5"):
        resolve_profile("raspberry-pi-6")


def test_describe_shows_key_numbers(shipped: dict[str, DeviceProfile]) -> None:
    text = describe(shipped["coral-dev-board"])
    for part in (
        "npu -> xnnpack -> cpu",
        "384 MiB (402653184 bytes)",
        "libedgetpu.so.1",
        "device=pci:0",
        "auto (tries int4_block32",
    ):
        assert part in text
    assert "greedy" in describe(_profile_with_temperature(shipped["wearable-1g"], 0.0))


def _profile_with_temperature(p: DeviceProfile, t: float) -> DeviceProfile:
    return dataclasses.replace(p, generation=dataclasses.replace(p.generation, temperature=t))
