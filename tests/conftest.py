"""Shared fixtures: tiny real models (toolchain), the demo model, and profiles built in tests;
and the markers that say what a test needs from the machine (tests/README.md, "Running part of
the suite"), put on each test at collection so that `-m "not rabbitmq"` and the like select."""

from __future__ import annotations

import copy
import tomllib
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.profile import DeviceProfile, parse_profile, profiles_dir
from tests.support.tiny_models import (  # noqa: F401  (pytest fixtures)
    LEGACY,
    tiny_model,
    tiny_model_dir,
    tiny_model_factory,
    tiny_tokenizer,
)
from tests.support.tmpfs import one_mib_fs  # noqa: F401  (a pytest fixture)

ProfileMaker = Callable[..., DeviceProfile]


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="session")
def dev_profile_data() -> dict[str, Any]:
    with open(profiles_dir() / "generic-x86_64.toml", "rb") as f:
        data = tomllib.load(f)
    if LEGACY:  # the runtime and engine tests on the tflite-runtime backend (scripts/test)
        data["runtime"]["backend"] = "tflite-runtime"
    return data


@pytest.fixture
def make_profile(dev_profile_data: dict[str, Any], tmp_path: Path) -> ProfileMaker:
    """`make_profile(runtime={"max_num_bytes": ...})`: the dev profile with overrides."""

    def make(**over: Any) -> DeviceProfile:
        data = _merge(dev_profile_data, over)
        return parse_profile(data, tmp_path / f"{data['name']}.toml")

    return make


@pytest.fixture
def dev_profile(make_profile: ProfileMaker) -> DeviceProfile:
    return make_profile()


@pytest.fixture
def empty_config(tmp_path: Path) -> str:
    """An agent config file with nothing in it (the fleet commands' `--config`)."""
    path = tmp_path / "agent.toml"
    path.write_text("")
    return str(path)


# ---------------------------------------------------------------------------------------------
# Markers by what a test needs (registered in pyproject.toml; nothing is skipped by them)

# a test starts a broker when its function, a fixture it uses, or a tests.* function that one
# of those calls names the class that starts it
STARTS = {"Mosquitto": "broker", "RabbitMQ": "rabbitmq", "RabbitCluster": "rabbitmq"}
# whole files: the Debian roots (debootstrap), qemu-user, systemd-nspawn, all as root
BY_FILE = {
    "tests/system/test_arm.py": ("emulation", "root", "slow"),
    "tests/system/test_systemd_boot.py": ("emulation", "nspawn", "root", "slow"),
    "tests/system/test_mender.py": ("root",),  # mount namespaces for Mender's fixed paths
}
# files that take more than 60 s on a 2-core machine with the tiny models cached (--durations)
SLOW_FILES = frozenset(
    {
        "tests/system/test_client_dist.py",
        "tests/system/test_daemon.py",
        "tests/system/test_fleet_rabbitmq.py",
        "tests/system/test_power_cut_daemon.py",
        "tests/system/test_updates.py",
        "tests/system/test_wheel.py",
        "tests/unit/operator/test_fleet_scale.py",
        "tests/unit/ota/test_update_clock.py",
        "tests/unit/ota/test_update_reports.py",
        "tests/unit/runtime/test_prepared_power_cut.py",
    }
)


# The files that take longest (seconds of one worker, measured in a whole run), longest first:
# scripts/test hands whole files to two workers in collection order (pytest-xdist's loadfile,
# its reordering by test count off), and starting with the longest keeps one worker from
# finishing a five-minute file alone at the end. Other files follow in their usual order.
LONGEST_FIRST = (
    "tests/system/test_arm.py",  # 339 s
    "tests/unit/operator/test_fleet_scale.py",  # 281 s
    "tests/system/test_power_cut_daemon.py",  # 204 s
    "tests/system/test_updates.py",  # 119 s
    "tests/unit/ota/test_update_clock.py",  # 112 s
    "tests/system/test_systemd_boot.py",  # 87 s
    "tests/unit/runtime/test_prepared_power_cut.py",  # 75 s
    "tests/unit/ota/test_update_reports.py",  # 69 s
    "tests/system/test_broker_failover.py",  # 56 s
)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _needs(fn: Any, seen: set[Any]) -> set[str]:
    """The markers of STARTS that `fn`'s code, or a tests.* function it names, calls for."""
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or fn in seen:
        return set()
    seen.add(fn)
    found: set[str] = set()
    scope = getattr(fn, "__globals__", {})
    for c in _codes(code):
        for name in c.co_names:
            if name in STARTS:
                found.add(STARTS[name])
            other = scope.get(name)
            if isinstance(other, types.FunctionType) and other.__module__.startswith("tests."):
                found |= _needs(other, seen)
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    cache: dict[Any, set[str]] = {}

    def needs(fn: Any) -> set[str]:
        if fn not in cache:
            cache[fn] = _needs(fn, set())
        return cache[fn]

    for item in items:
        marks: set[str] = set()
        path = Path(str(item.path))
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        marks.update(BY_FILE.get(rel, ()))
        if rel in SLOW_FILES:
            marks.add("slow")
        function = getattr(item, "function", None)
        if function is not None:
            marks |= needs(function)
        info = getattr(item, "_fixtureinfo", None)
        for defs in info.name2fixturedefs.values() if info is not None else ():
            marks |= needs(defs[-1].func)
        for mark in sorted(marks):
            item.add_marker(mark)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> int:
        path = Path(str(item.path))
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        return rank.get(rel, len(rank))

    items.sort(key=order)  # stable: each file's own order, and the others', stay
