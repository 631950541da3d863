"""`edge-agent profile list|show|detect`: the shipped device profiles, which one fits and why."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent.cli.common import _profile_arg, _profile_name


def cmd_profile_list(args: argparse.Namespace) -> int:
    from agent.profile import as_json, list_profiles

    profiles = list_profiles()
    if args.json:
        print(json.dumps({"profiles": [as_json(p) for p in profiles]}, indent=2))
        return 0
    for p in profiles:
        r = p.runtime
        print(
            f"{p.name:24} {r.max_num_bytes / (1 << 20):8.0f} MiB  {r.num_threads} thr  "
            f"{'>'.join(r.accelerators):20} {p.description}"
        )
    return 0


def cmd_profile_show(args: argparse.Namespace) -> int:
    """The profile (NAME|PATH, --profile, $EDGE_AGENT_PROFILE, else detected) and why."""
    from agent.profile import as_json, describe, resolve_profile

    profile, reasons = resolve_profile(args.name or _profile_name(args), Path(args.root))
    if args.json:
        print(json.dumps({**as_json(profile), "reasons": list(reasons)}, indent=2))
        return 0
    print(describe(profile))
    print("why")
    for r in reasons:
        print(f"  - {r}")
    return 0


def cmd_profile_detect(args: argparse.Namespace) -> int:
    from agent.profile import detect

    d = detect(Path(args.root))
    if args.json:
        print(json.dumps({"profile": d.profile.name, "reasons": list(d.reasons)}, indent=2))
        return 0
    print(f"profile: {d.profile.name}")
    for r in d.reasons:
        print(f"  - {r}")
    return 0


def add_profile_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``profile list|show|detect`` to the CLI's subparsers (each sets `func`)."""
    prof = subparsers.add_parser("profile", help="device profiles")
    psub = prof.add_subparsers(dest="profile_command", required=True)
    p = psub.add_parser("list", help="list shipped profiles")
    p.add_argument("--json", action="store_true", help="every profile's keys (docs/PROFILES.md)")
    p.set_defaults(func=cmd_profile_list)
    p = psub.add_parser("show", help="show one profile and why it is the one")
    p.add_argument("name", nargs="?", help="profile name or path (default: --profile, detect)")
    _profile_arg(p)
    p.add_argument("--root", default="/", help="root of the /proc, /dev tree to detect from")
    p.add_argument("--json", action="store_true", help="the profile's keys and the reasons")
    p.set_defaults(func=cmd_profile_show)
    p = psub.add_parser("detect", help="detect the board and say which profile fits and why")
    p.add_argument("--root", default="/", help="root of the /proc, /dev tree to read")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile_detect)
