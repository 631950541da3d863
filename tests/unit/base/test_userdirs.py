"""Where one-shot commands keep caches: the user's directories, never the daemon's /var ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.base.userdirs import cache_dir
from agent.profile import resolve_profile
from agent.profile.oneshot import one_shot_profile


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_cache_dir_default_is_the_users(home: Path) -> None:
    assert cache_dir() == home / ".cache" / "edge-agent"


def test_cache_dir_xdg_and_systemd(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/srv/xdg")
    assert cache_dir() == Path("/srv/xdg/edge-agent")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored (XDG spec)
    assert cache_dir() == home / ".cache" / "edge-agent"
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/edge-agent:/var/cache/other")
    assert cache_dir() == Path("/var/cache/edge-agent")  # under systemd: the unit's, first one


def test_board_profile_weight_cache_moves_to_the_users(home: Path) -> None:
    pi5, _ = resolve_profile("raspberry-pi-5")
    assert pi5.runtime.xnnpack_weight_cache_dir == Path("/var/cache/edge-agent/xnnpack")
    mine = one_shot_profile(pi5)
    assert mine.runtime.xnnpack_weight_cache_dir == home / ".cache" / "edge-agent" / "xnnpack"
    assert mine.runtime.max_num_bytes == pi5.runtime.max_num_bytes and mine.name == pi5.name


def test_profile_without_weight_cache_keeps_none(home: Path) -> None:
    dev, _ = resolve_profile("generic-x86_64")
    assert dev.runtime.xnnpack_weight_cache_dir is None
    assert one_shot_profile(dev) is dev
