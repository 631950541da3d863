"""`edge-agent fleet inventory [--group G] [--json]` and `edge-agent fleet send --group G CMD`:
the fleet by device (what runs where, docs/FLEET.md "Groups, tags and inventory"), and one
command to every online device of a group.

Both read the retained state and health first (`watch --once`); exit codes as the other fleet
commands: 0 done (send: every device of the group answered OK), 1 a device answered an error,
did not answer or was offline, no device is in the group, or the broker could not be reached,
2 usage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Mapping

from google.protobuf.json_format import MessageToDict

from agent.cli.common import _fail
from agent.cli.fleet.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    _connection,
    _connection_args,
    _good_prefix,
    _group,
    _group_arg,
    _Usage,
    describe,
)
from agent.fleet.mqtt import MqttOptions

SETTLE_S = 0.5  # send --group: the retained state is in when nothing came for this long
COLLECT_TIMEOUT_S = 30.0


def cmd_fleet_inventory(args: argparse.Namespace) -> int:
    from agent.operator.client import watch
    from agent.operator.inventory import inventory
    from agent.operator.link import FleetError
    from agent.operator.render import inventory_json, inventory_table

    try:
        group = _group(args)
        opts, fleet = _connection(args)
        prefix = args.prefix or fleet.topic_prefix
        if not _good_prefix(prefix):
            raise _Usage(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
    except _Usage as exc:
        return _fail(str(exc))
    try:
        view = watch(opts, prefix, once=True, settle_s=args.settle, timeout_s=args.timeout)
    except FleetError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    rows, now = inventory(view, group), time.time()
    if args.json:
        print(json.dumps(inventory_json(rows, now), indent=2))
    else:
        print(inventory_table(rows, now, shutil.get_terminal_size((160, 50)).columns))
    if view.malformed:
        print(f"edge-agent: ignored {view.malformed} malformed messages", file=sys.stderr)
    return 0


def send_to_group(
    args: argparse.Namespace,
    opts: MqttOptions,
    prefix: str,
    group: str,
    cmd_args: Mapping[str, str],
    body: bytes,
) -> int:
    """`send --group G CMD` once the flags are checked: a line (or JSON object) per device as
    its result comes, then a summary; 0 only if every device of the group answered OK."""
    from agent.operator.client import watch
    from agent.operator.fanout import Outcome, Result, send_many
    from agent.operator.inventory import inventory
    from agent.operator.link import FleetError

    def show(r: Result) -> None:
        if args.json:
            response = None
            if r.response is not None:
                response = MessageToDict(
                    r.response,
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                )
            doc = {"device": r.device_id, "outcome": str(r.outcome), "message": r.message}
            print(json.dumps({**doc, "response": response}), flush=True)
        elif r.response is not None:
            print(describe(r.response, r.device_id).split("\n")[0], flush=True)
        else:
            what = "not sent" if r.outcome in (Outcome.OFFLINE, Outcome.NOT_SENT) else "failed"
            print(f"{r.device_id} {args.cmd}: {what}: {r.message}", flush=True)

    try:
        view = watch(opts, prefix, once=True, settle_s=SETTLE_S, timeout_s=COLLECT_TIMEOUT_S)
        targets = inventory(view, group)
        if not targets:
            print(f"edge-agent: no device of group {group!r} under {prefix}", file=sys.stderr)
            return EXIT_FAILED
        results = send_many(
            opts, prefix, targets, args.cmd, cmd_args, body, timeout_s=args.timeout, on_result=show
        )
    except FleetError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    ok = sorted(d for d, r in results.items() if r.outcome is Outcome.OK)
    failed = {d: str(r.outcome) for d, r in sorted(results.items()) if r.outcome is not Outcome.OK}
    if args.json:
        summary = {"group": group, "devices": len(results), "ok": ok, "failed": failed}
        print(json.dumps({"summary": summary}))
    else:
        print(f"{len(ok)} of {len(results)} devices of group {group!r} answered OK")
    return 0 if not failed else EXIT_FAILED


def add_inventory_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inventory",
        help="one row per device: group, tags, model, version, sha256, profile, arch, agent "
        "version, presence, last seen",
        description="Built from the devices' retained state and health; sorted by device id.",
    )
    _group_arg(p, "only devices")
    p.add_argument("--json", action="store_true", help="a JSON list, one object per device")
    p.add_argument(
        "--settle",
        type=float,
        default=1.0,
        metavar="S",
        help="done when no retained message came for S seconds (default: 1)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="give up connecting and waiting for the retained messages after S s (default: 30)",
    )
    _connection_args(p)
    p.set_defaults(func=cmd_fleet_inventory)
