"""`edge-agent fleet watch|send|inventory|publish-update|cancel-update|decode`: the operator's
commands (docs/FLEET.md).

Connection settings come from the agent config's [fleet] section (`--config`, default
/etc/edge-agent/agent.toml, absent is fine); flags win. Exit codes: 0 done (send: the device,
or every device of the group, answered OK; publish-update: every device committed), 1 a device
answered an error, did not answer, was offline (`send --group`), did not commit, or the broker
could not be reached, 2 usage or configuration errors (publish-update: also a bundle that does
not read).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from agent.cli.common import _fail
from agent.cli.fleet.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    _connection,
    _connection_args,
    _device_id,
    _good_prefix,
    _group,
    _group_arg,
    _Usage,
    describe,
)
from agent.cli.fleet.console import add_console_command
from agent.cli.fleet.decode import add_decode_command
from agent.cli.fleet.inventory import add_inventory_command, send_to_group
from agent.cli.fleet.rollout import add_rollout_commands
from agent.cli.fleet.update import add_update_commands
from agent.fleet.topics import COMMAND_RE
from agent.operator.render import render, summary, to_json
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

# ----------------------------------------------------------------------------- watch


def cmd_fleet_watch(args: argparse.Namespace) -> int:
    from agent.operator.client import watch
    from agent.operator.link import FleetError

    try:
        group = _group(args)
        opts, fleet = _connection(args)
    except _Usage as exc:
        return _fail(str(exc))
    prefix = args.prefix or fleet.topic_prefix
    if not _good_prefix(prefix):
        return _fail(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
    stale = args.stale_after if args.stale_after is not None else 3 * fleet.health_interval_s
    once = args.once or args.json
    try:
        view = watch(
            opts,
            prefix,
            once=once,
            settle_s=args.settle,
            timeout_s=args.timeout,
            stale_after_s=stale,
            filter=args.filter,
            group=group,
        )
    except FleetError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if not once:
        return 0
    now = time.time()
    if args.json:
        print(json.dumps(to_json(view, now, args.filter, group), indent=2))
        if view.malformed or view.late_wills:
            print(f"edge-agent: {summary(view, now, args.filter, group)}", file=sys.stderr)
    else:
        width = shutil.get_terminal_size((160, 50)).columns
        print(render(view, now, width, filter=args.filter, group=group))
    return 0


# ----------------------------------------------------------------------------- send


def _parse_args(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _Usage(f"--arg {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _read_body(name: str | None) -> bytes:
    if not name:
        return b""
    if name == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise _Usage(f"--body-file {name}: {exc.strerror}") from exc


def cmd_fleet_send(args: argparse.Namespace) -> int:
    from agent.operator.client import send
    from agent.operator.link import FleetError

    try:
        group = _group(args)
        if group is not None:  # `send --group G CMD`: the one positional is the command
            if args.cmd is not None:
                raise _Usage(f"--group {group} sends to the group: give CMD, not a device id")
            args.cmd, args.device = args.device, None
        if args.cmd is None:
            raise _Usage("give DEVICE CMD, or --group G CMD")
        opts, fleet = _connection(args)
        if group is None:
            _device_id(args.device)
        if not COMMAND_RE.fullmatch(args.cmd):
            raise _Usage(f"command {args.cmd!r} is not valid (e.g. ping, status, reload)")
        prefix = args.prefix or fleet.topic_prefix
        if not _good_prefix(prefix):
            raise _Usage(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
        cmd_args = _parse_args(args.arg)
        body = _read_body(args.body_file)
    except _Usage as exc:
        return _fail(str(exc))
    if group is not None:
        return send_to_group(args, opts, prefix, group, cmd_args, body)
    try:
        resp = send(
            opts,
            prefix,
            args.device,
            args.cmd,
            cmd_args,
            body,
            timeout_s=args.timeout,
        )
    except FleetError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if args.json:
        doc = MessageToDict(
            resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        print(json.dumps(doc, indent=2))
    else:
        print(describe(resp, args.device))
    return 0 if resp.code == pb.CommandResponse.OK else EXIT_FAILED


# ----------------------------------------------------------------------------- parser


def add_fleet_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``fleet watch`` and ``fleet send`` to the CLI's subparsers (each sets `func`)."""
    top = subparsers.add_parser("fleet", help="watch the fleet over MQTT, send commands")
    sub = top.add_subparsers(dest="fleet_command", required=True)

    p = sub.add_parser(
        "watch",
        help="a live table of devices: state, model, health, last seen",
        description="Problems first: lost, then online with issues (stale, throttled, "
        "errors), then offline, then the rest.",
    )
    _connection_args(p)
    p.add_argument(
        "--once", action="store_true", help="print the table once the retained messages are in"
    )
    p.add_argument("--json", action="store_true", help="one JSON list of devices (implies --once)")
    p.add_argument(
        "--filter", metavar="SUBSTR", help="only devices whose id, model or profile contains this"
    )
    _group_arg(p, "only devices")
    p.add_argument(
        "--stale-after",
        type=float,
        metavar="S",
        help="online devices without health for S seconds are stale "
        "(default: 3 x the config's health_interval_s = 180)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=1.0,
        metavar="S",
        help="--once: done when no retained message came for S seconds (default: 1)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="give up connecting, and with --once waiting for the retained messages, after S "
        "seconds (default: 30)",
    )
    p.set_defaults(func=cmd_fleet_watch)

    p = sub.add_parser(
        "send",
        help="send a command to one device (or every device of a group) and print the answers",
        usage="%(prog)s (DEVICE | --group G) CMD [options]",
    )
    p.add_argument("device", metavar="DEVICE", nargs="?", help="device id (not with --group)")
    p.add_argument(
        "cmd",
        metavar="CMD",
        nargs="?",
        help="command: ping, status, reload, update (--body-file: a SignedManifest, the "
        "manifest.pb of a bundle; `publish-update` sends it and serves the payload) or cancel "
        "(--body-file: a SignedCancel of the update in progress)",
    )
    p.add_argument(
        "--arg", action="append", default=[], metavar="KEY=VALUE", help="argument (repeatable)"
    )
    p.add_argument("--body-file", metavar="F", help="the command's body (- for stdin)")
    _group_arg(p, "send to every online device")
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="wait this long (default: 10); with --group, for each device from when its "
        "command went out",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the CommandResponse as JSON (--group: one JSON object a line per device, "
        "then a summary)",
    )
    _connection_args(p)
    p.set_defaults(func=cmd_fleet_send)

    add_inventory_command(sub)
    add_update_commands(sub)
    add_rollout_commands(sub)
    add_decode_command(sub)
    add_console_command(sub)
