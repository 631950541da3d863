"""Shared fixtures: tiny real models (toolchain), the demo model, and profiles built in tests."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Callable, Mapping
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
