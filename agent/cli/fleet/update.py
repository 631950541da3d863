"""`edge-agent fleet publish-update|cancel-update`: offer a signed update bundle to devices and
follow them, or stop an update in progress with a signed cancel (docs/UPDATES.md).

Exit codes: 0 every device committed (cancel: every device answered OK), 1 a device did not
commit or answer, or the broker could not be reached, 2 usage or configuration errors, also a
bundle that does not read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from agent.base.errors import AgentError
from agent.cli.common import _fail
from agent.cli.fleet.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    _connection,
    _connection_args,
    _device_id,
    _good_prefix,
    _name,
    _Usage,
    describe,
)
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb


def status_line(device: str, st: pb.UpdateStatus) -> str:
    """One update status for people: `dev-1: REJECTED (rollback) version 2 is not ...`."""
    phase = _name(pb.UpdateStatus.Phase, st.phase)
    reason = f" ({st.reason_code})" if st.reason_code else ""
    size = f" {st.downloaded_bytes}/{st.total_bytes} B" if st.total_bytes else ""
    return f"{device}: {phase}{reason}{size} {st.message}".rstrip()


def status_json(device: str, st: pb.UpdateStatus) -> dict[str, Any]:
    """One update status for scripts: the device and every UpdateStatus field (protobuf JSON
    mapping, proto field names, 64-bit integers as strings)."""
    doc = MessageToDict(
        st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return {"device": device, **doc}


def cmd_fleet_publish_update(args: argparse.Namespace) -> int:
    from agent.operator.link import FleetError
    from agent.operator.publish import online_devices, publish_update, read_offer, switch_args
    from agent.ota.artifact.bundle import BundleError

    try:
        opts, fleet = _connection(args)
        prefix = args.prefix or fleet.topic_prefix
        if not _good_prefix(prefix):
            raise _Usage(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
        if bool(args.device) == bool(args.all):
            raise _Usage("give --device ID (repeatable) or --all")
        for d in args.device:
            _device_id(d)
        read_offer(Path(args.bundle))  # a bad bundle is refused before anything is sent
        command_args = switch_args(args.activate, args.allow_metered)
    except (_Usage, BundleError, ValueError) as exc:
        return _fail(str(exc))

    def show(device: str, st: pb.UpdateStatus) -> None:
        if args.json:
            print(json.dumps(status_json(device, st)), flush=True)
        else:
            print(status_line(device, st), flush=True)

    try:
        devices = list(args.device) or online_devices(opts, prefix)
        if not devices:
            print(f"edge-agent: no online devices under {prefix}", file=sys.stderr)
            return EXIT_FAILED
        result = publish_update(
            opts,
            prefix,
            Path(args.bundle),
            devices,
            timeout_s=args.timeout,
            on_status=show,
            args=command_args,
        )
    except FleetError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BundleError as exc:  # the bundle changed under us
        return _fail(str(exc))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    done = {d: p.status for d, p in result.items()}
    committed = [d for d, st in done.items() if st and st.phase == pb.UpdateStatus.COMMITTED]
    if args.json:
        last = {d: _name(pb.UpdateStatus.Phase, st.phase) if st else None for d, st in done.items()}
        summary = {"devices": len(done), "committed": committed, "last": last}
        print(json.dumps({"summary": summary}))
    else:
        print(f"{len(committed)} of {len(done)} devices committed the update")
    return 0 if len(committed) == len(done) else EXIT_FAILED


def cmd_fleet_cancel_update(args: argparse.Namespace) -> int:
    """Sign a cancel of update `args.update_id` and send it to each device (docs/UPDATES.md)."""
    from agent.cli.common import parse_duration
    from agent.operator.client import send
    from agent.operator.link import FleetError
    from agent.ota.artifact.cancel import sign_cancel
    from agent.ota.artifact.keys import load_private

    try:
        opts, fleet = _connection(args)
        prefix = args.prefix or fleet.topic_prefix
        for d in args.device:
            _device_id(d)
        try:
            expires_in = parse_duration(args.expires_in)
        except ValueError as exc:
            raise _Usage(f"--expires-in: {exc}") from exc
        try:
            keys = [load_private(Path(k)) for k in args.key]
            body = sign_cancel(
                args.update_id, keys, reason=args.reason, expires_in_s=expires_in
            ).SerializeToString()
        except ValueError as exc:
            raise _Usage(str(exc)) from exc
    except (_Usage, AgentError) as exc:
        return _fail(str(exc))
    ok = True
    for device in args.device:
        try:
            resp = send(opts, prefix, device, "cancel", {}, body, timeout_s=args.timeout)
        except FleetError as exc:
            print(f"edge-agent: {device}: {exc}", file=sys.stderr)
            ok = False
            continue
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        ok = ok and resp.code == pb.CommandResponse.OK
        print(describe(resp, device), flush=True)
    return 0 if ok else EXIT_FAILED


def add_switch_args(p: argparse.ArgumentParser) -> None:
    """--activate and --allow-metered (also `fleet rollout start`'s: pass them to
    `agent.operator.publish.switch_args`)."""
    p.add_argument(
        "--activate",
        default="",
        metavar="POLICY",
        help="when devices switch to the downloaded model: now, idle, window (the device's) or "
        '"window:CRON DURATION", e.g. "window:0 2 * * * 3h" (default: each device\'s '
        "[updates] activate)",
    )
    p.add_argument(
        "--allow-metered",
        action="store_true",
        help="download on devices whose link is metered ([updates] metered = true)",
    )


def add_update_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``publish-update`` and ``cancel-update`` to the ``fleet`` command's subparsers."""
    p = sub.add_parser(
        "publish-update",
        help="offer a signed update bundle to devices, serve it over MQTT if it has no URL, "
        "and follow them until committed / rolled back / rejected",
    )
    p.add_argument("bundle", help="a bundle from `edge-agent update make`")
    p.add_argument("--device", action="append", default=[], metavar="ID", help="(repeatable)")
    p.add_argument("--all", action="store_true", help="every device whose state is online")
    p.add_argument(
        "--timeout", type=float, default=1800.0, metavar="S", help="give up after S (1800)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line: each status ({device, update_id, phase, reason_code, "
        "message, ...}), then {summary: {devices, committed, last}}",
    )
    add_switch_args(p)
    _connection_args(p)
    p.set_defaults(func=cmd_fleet_publish_update)

    p = sub.add_parser(
        "cancel-update",
        help="stop an update in progress: a cancel signed with the update key, sent to devices",
    )
    p.add_argument("update_id", metavar="UPDATE_ID", help="the update's id (update inspect)")
    p.add_argument(
        "--key", action="append", required=True, metavar="K", help="signing key (repeatable)"
    )
    p.add_argument("--device", action="append", required=True, metavar="ID", help="(repeatable)")
    p.add_argument("--reason", default="", help="reported with the cancelled update")
    p.add_argument("--expires-in", default="1h", help="the cancel's validity (default: 1h)")
    p.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="per device (default: 60)"
    )
    _connection_args(p)
    p.set_defaults(func=cmd_fleet_cancel_update)
