"""`edge-agent systemd dropin|install`: print a profile's drop-in, or install the unit, the
drop-in and the socket group (`agent.systemd.units` renders and writes them)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from agent.base.errors import AgentError
from agent.profile import DeviceProfile, log_reasons, resolve_profile
from agent.systemd.units import (
    DEFAULT_EXEC_START,
    DEFAULT_SOCKET_GROUP,
    DROPIN_NAME,
    UNIT_NAME,
    install,
    memory_limits,
    render_dropin,
)


def _profile_of(args: argparse.Namespace) -> DeviceProfile:
    name = getattr(args, "sub_profile", None) or getattr(args, "profile", None)
    profile, reasons = resolve_profile(name)
    log_reasons(profile.name, reasons, detected=name is None)
    return profile


def cmd_dropin(args: argparse.Namespace) -> int:
    """``edge-agent systemd dropin``: print the drop-in for the profile (``--json``: with the
    numbers in it, docs/SYSTEMD.md)."""
    profile = _profile_of(args)
    text = render_dropin(profile, exec_start=args.exec_start, socket_group=args.socket_group)
    if not args.json:
        sys.stdout.write(text)
        return 0
    high, hard = memory_limits(profile.runtime.max_num_bytes)
    doc = {
        "profile": profile.name,
        "path": f"etc/systemd/system/{UNIT_NAME}.d/{DROPIN_NAME}",
        "memory_high_bytes": high,
        "memory_max_bytes": hard,
        "device_allow": list(profile.board.npu_nodes),
        "group": args.socket_group,
        "exec_start": args.exec_start,
        "text": text,
    }
    print(json.dumps(doc, indent=2))
    return 0


def _default_exec_start() -> tuple[str, str]:
    """ExecStart when none is given: the running environment's own script (a venv install has
    no /usr/bin/edge-agent), else the one on PATH, else the unit's; with where it came from."""
    script = Path(sys.prefix) / "bin" / "edge-agent"
    if script.is_file():
        return f"{script} run", f"the running environment, {sys.prefix}"
    found = shutil.which("edge-agent")
    if found:
        return f"{found} run", "the edge-agent on PATH"
    return DEFAULT_EXEC_START, "the unit's default; no edge-agent script was found"


def cmd_install(args: argparse.Namespace) -> int:
    """``edge-agent systemd install``: write unit, drop-in and sysusers entry; reload systemd."""
    profile = _profile_of(args)
    root = Path(args.root)
    exec_start, source = args.exec_start, "--exec-start"
    if exec_start is None:
        exec_start, source = _default_exec_start()
    print(f"ExecStart: {exec_start} (from {source}; --exec-start changes it)")
    try:
        paths = install(
            profile,
            root=root,
            exec_start=exec_start,
            socket_group=args.socket_group,
            reload=not args.no_reload,
        )
    except OSError as exc:
        raise AgentError(f"cannot install the unit under {root}: {exc}") from exc
    for path in paths:
        print(path)
    return 0


def add_systemd_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``systemd dropin`` and ``systemd install`` to the CLI's subparsers."""
    top = subparsers.add_parser("systemd", help="systemd unit and drop-in")
    sub = top.add_subparsers(dest="systemd_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--profile",
            dest="sub_profile",
            help="profile name or path to a .toml (default: detect)",
        )
        p.add_argument("--exec-start", help="ExecStart command line (default: the unit's)")
        p.add_argument(
            "--socket-group",
            help=f"group allowed to use the socket (default: {DEFAULT_SOCKET_GROUP})",
        )

    p = sub.add_parser("dropin", help="print the profile drop-in (10-profile.conf)")
    common(p)
    p.add_argument("--json", action="store_true", help="the drop-in and its numbers as JSON")
    p.set_defaults(func=cmd_dropin)
    p = sub.add_parser("install", help="install unit, drop-in and socket group; reload systemd")
    common(p)
    p.add_argument("--root", default="/", help="install under this root (default: /)")
    p.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    p.set_defaults(func=cmd_install)
