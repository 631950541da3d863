"""What `edge-agent client` reads and shows people: the prompt from an argument or from stdin
(`-`), the daemon's socket (flag, `$EDGE_AGENT_SOCKET`, the config's `[server] socket`), and
`info` / `status` as a readable summary (numbers as numbers, durations and sizes rounded, times
as ages) — `--json` keeps protobuf's canonical JSON mapping for scripts."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SOCKET_ENV = "EDGE_AGENT_SOCKET"


def text_arg(value: str) -> str:
    """A prompt or message as given; ``-`` reads it from stdin (a file, a pipe, a heredoc)."""
    return sys.stdin.read() if value == "-" else value


def socket_of(args: argparse.Namespace) -> str:
    """--socket, else $EDGE_AGENT_SOCKET, else `[server] socket` of --config (or of the
    daemon's /etc/edge-agent/agent.toml when this user may read it), else the default."""
    from agent.config.file import DEFAULT_PATH, DEFAULT_SOCKET, load_config

    if args.socket:
        return str(args.socket)
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    config = getattr(args, "config", None)
    if config:
        return str(load_config(Path(config)).server.socket)  # a named file must read
    if os.access(DEFAULT_PATH, os.R_OK):
        return str(load_config(None).server.socket)
    return str(DEFAULT_SOCKET)


def _number(value: Any) -> Any:
    """protobuf's JSON mapping writes 64-bit integers as strings: numbers again."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


_UNITS = ("_unix", "_bytes", "_ms", "_s")


def _unit(key: str) -> str:
    if key.endswith("tok_s"):  # a rate: tokens per second
        return ""
    return next((u for u in _UNITS if key.endswith(u)), "")


def _label(key: str) -> str:
    """``uptime_s`` -> ``uptime``: the unit goes with the value (``decode_tok_s``: tok/s)."""
    if key.endswith("tok_s"):
        return key.removesuffix("tok_s").replace("_", " ") + "tok/s"
    return key.removesuffix(_unit(key)).replace("_", " ")


def _value(key: str, value: Any, now: float) -> str:
    value = _number(value)
    if value == "":
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if key.endswith("_unix"):
        if value <= 0:
            return "never"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
        return f"{stamp} ({ago(now - value)})" if now >= value else stamp
    if key.endswith("_bytes"):
        return f"{value / (1 << 20):,.1f} MiB" if value >= 1 << 20 else f"{value:,} B"
    if key.endswith("_s"):
        return _duration(float(value))
    if key.endswith("_ms"):
        return f"{value:,.1f} ms"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}"


def ago(seconds: float) -> str:
    """How long ago, in whole units: ``12 s ago``, ``5 min ago``, ``3 h ago``, ``2 d ago``."""
    if seconds < 120:
        return f"{max(0, round(seconds))} s ago"
    if seconds < 7200:
        return f"{round(seconds / 60)} min ago"
    if seconds < 172800:
        return f"{round(seconds / 3600)} h ago"
    return f"{round(seconds / 86400)} d ago"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    if seconds < 172800:
        return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"
    return f"{seconds / 86400:.1f} d"


def summary(
    doc: Mapping[str, Any], now: float | None = None, indent: str = "", unit: str = ""
) -> str:
    """A dict from `info` or `status` as indented ``label: value`` lines; `unit`: the suffix
    of the key that holds `doc` (``ttft_ms: {p50, p95}``: both in ms)."""
    now = time.time() if now is None else now
    width = max((len(_label(k)) for k in doc), default=0)
    lines = []
    for key, value in doc.items():
        label, as_key = _label(key), (key if _unit(key) else key + unit)
        if isinstance(value, Mapping):
            lines.append(f"{indent}{label}:")
            lines.append(summary(value, now, indent + "  ", _unit(as_key)))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            lines.append(f"{indent}{label}:")
            lines.extend(summary(item, now, indent + "  ", _unit(as_key)) for item in value)
        elif isinstance(value, list):
            shown = ", ".join(_value(as_key, v, now) for v in value) or "none"
            lines.append(f"{indent}{label + ':':<{width + 1}} {shown}")
        else:
            lines.append(f"{indent}{label + ':':<{width + 1}} {_value(as_key, value, now)}")
    return "\n".join(line for line in lines if line)
