"""Disk room for a model's first load: what the runtime writes into the weight cache directory
the first time it loads a model file, as a bound from the file's size, and the free bytes of a
directory's filesystem.

A first load writes a prepared copy (the original's weights after a rewritten flatbuffer:
composites inlined, KV windows' graphs added; `agent.runtime.prepare.inline`) and XNNPACK's
packed weights (~2% above the weights, docs/PERFORMANCE.md), each at most the file's size plus
a sixteenth plus 1 MiB. XNNPACK aborts the process when its weight cache file cannot be written,
so the runtime packs in memory when the directory lacks `packed_bound` (agent/runtime/prepare/
cachefiles.py), and the updater refuses an update `no_space` without room for `first_load_bound`
(agent/ota/space.py).
"""

from __future__ import annotations

import os
from pathlib import Path

SLACK = 1 << 20  # headers, alignment, the readings (`.parse.json`), a small model's new graphs


def packed_bound(model_bytes: int) -> int:
    """At most the bytes of XNNPACK's packed weights of a model file of `model_bytes`."""
    return model_bytes + model_bytes // 16 + SLACK


def first_load_bound(model_bytes: int) -> int:
    """At most the bytes a first load writes for a model file of `model_bytes`: its prepared
    copy and its packed weights."""
    return 2 * packed_bound(model_bytes)


def free_bytes(path: Path) -> int | None:
    """Bytes available to the agent on the filesystem of `path` (or its nearest existing
    parent); None when nothing can be measured."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except (OSError, ValueError):
            continue
        return st.f_bavail * st.f_frsize
    return None


def device_of(path: Path) -> int | None:
    """The filesystem (st_dev) of `path` or its nearest existing parent; None if none exists."""
    for candidate in (path, *path.parents):
        try:
            return os.stat(candidate).st_dev
        except (OSError, ValueError):
            continue
    return None
