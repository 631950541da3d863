"""What every worker measures with: peak RSS, the prompt texts, a stream's timing. Below
`workers` and `workers_spec`, which both use it, so neither imports the other for it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

PROMPT_TEXTS: dict[str, str] = {}  # a worker's prompt texts by token count, from `prompts_file`


def peak_rss_mib(pid: int | str = "self") -> float:
    """The process's RSS high-water mark. Not `ru_maxrss`: that survives exec, so a worker would
    report its parent's peak (the bandwidth test's buffer)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prompt_text(n: int | str) -> str:
    """Text of about `n` tokens (the BOS the engine adds included): source code of this repo;
    or the prompt of that key (the speculation sections' prompts)."""
    return PROMPT_TEXTS[str(n)]


def stream_timing(stream: Any) -> tuple[float, float, int, list[int], Any]:
    """(time to first token ms, decode tok/s after it, tokens, ids, last message) of a stream
    of messages or events that carry `token_ids`, measured where they arrive."""
    t0 = time.perf_counter()
    first = last = 0.0
    ids: list[int] = []
    first_n = 0
    msg = None
    for msg in stream:
        if msg.token_ids:
            last = time.perf_counter()
            if not ids:
                first, first_n = last, len(msg.token_ids)
            ids.extend(msg.token_ids)
    rate = (len(ids) - first_n) / (last - first) if last > first else 0.0
    return (first - t0) * 1e3, rate, len(ids), ids, msg
