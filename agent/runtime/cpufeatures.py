"""What the CPU this process runs on can execute, as the kernel reports it (``getauxval``).

ai-edge-litert 2.3.0's aarch64 wheel ships ``libLiteRtWebGpuAccelerator.so`` built with the
Armv8.1 LSE atomics and a fail-fast check: creating a ``CompiledModel`` environment loads it,
and on a CPU without LSE (Cortex-A72 and A53: Raspberry Pi 4, Pi 3, Zero 2 W) the process
aborts with SIGILL ("This binary was compiled with lse enabled, but this feature is not
available on this processor"), seen under ``qemu-aarch64-static -cpu cortex-a72``
(tests/system/test_arm.py). The ``Interpreter`` path does not load it.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Final

AT_HWCAP: Final = 16
HWCAP_ATOMICS: Final = 1 << 8  # arch/arm64/include/uapi/asm/hwcap.h


@functools.cache
def aarch64_without_lse() -> bool:
    """True on an aarch64 CPU whose kernel reports no LSE atomics (``HWCAP_ATOMICS``)."""
    if platform.machine() != "aarch64":
        return False
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):  # not glibc/musl: nothing to read, assume a modern core
        return False
    getauxval.restype = ctypes.c_ulong
    getauxval.argtypes = [ctypes.c_ulong]
    return not getauxval(AT_HWCAP) & HWCAP_ATOMICS
