"""Hardware facts: what detection reads from a /proc-like tree under a root (the real one by
default, fixture trees in tests)."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final


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
