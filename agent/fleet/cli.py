"""`edge-agent fleet watch|send|publish-update|cancel-update`: the operator's commands
(docs/FLEET.md).

Connection settings come from the agent config's [fleet] section (`--config`, default
/etc/edge-agent/agent.toml, absent is fine); flags win. Exit codes: 0 done (send: the device
answered OK; publish-update: every device committed), 1 the device answered an error, did not
answer, did not commit, or the broker could not be reached, 2 usage or configuration errors
(publish-update: also a bundle that does not read).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from agent.config import (
    BROKER_FORMAT,
    DEVICE_ID_RE,
    MQTT_PROTOCOLS,
    FleetConfig,
    load_config,
    parse_broker,
)
from agent.errors import AgentError
from agent.fleet.digest import HealthInfo, health_info
from agent.fleet.mqtt import MqttOptions
from agent.fleet.render import render, summary, to_json
from agent.fleet.topics import COMMAND_RE
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Usage(AgentError):
    """A bad flag or a missing setting: printed, exit 2."""


def _fail(message: str) -> int:
    print(f"edge-agent: {message}", file=sys.stderr)
    return EXIT_USAGE


def _connection(args: argparse.Namespace) -> tuple[MqttOptions, FleetConfig]:
    """MqttOptions from the config's [fleet] section with the flags applied on top."""
    fleet = load_config(Path(args.config) if args.config else None).fleet
    broker = parse_broker("--broker", "--broker", args.broker) if args.broker else fleet.broker
    if broker is None:
        where = args.config or "/etc/edge-agent/agent.toml"
        raise _Usage(
            f"no MQTT broker: give --broker ({BROKER_FORMAT}) or set broker in the [fleet] "
            f"section of {where}"
        )

    def path(flag: str, default: Path | None) -> Path | None:
        value = getattr(args, flag)
        return Path(value) if value else default

    cert, key = path("cert_file", fleet.cert_file), path("key_file", fleet.key_file)
    if (cert is None) != (key is None):
        raise _Usage("--cert-file and --key-file go together (mutual TLS)")
    opts = MqttOptions(
        broker=broker,
        protocol=args.protocol or fleet.protocol,
        ca_file=path("ca_file", fleet.ca_file),
        cert_file=cert,
        key_file=key,
        username=args.username if args.username is not None else fleet.username,
        password_file=path("password_file", fleet.password_file),
        keepalive_s=fleet.keepalive_s,
    )
    return opts, fleet


def _good_prefix(prefix: str) -> bool:
    return bool(prefix) and not any(c in prefix for c in "+#") and prefix.strip("/") == prefix


def _connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (default: the [fleet] section of --config)")
    g.add_argument("--broker", help=BROKER_FORMAT)
    g.add_argument("--protocol", choices=MQTT_PROTOCOLS, help="MQTT version (default: 5)")
    g.add_argument("--ca-file", help="CA that signed the broker's certificate (mqtts)")
    g.add_argument("--cert-file", help="client certificate (mutual TLS)")
    g.add_argument("--key-file", help="client key (mutual TLS)")
    g.add_argument("--username")
    g.add_argument("--password-file", help="file holding the password")
    g.add_argument("--config", help="agent config (default: /etc/edge-agent/agent.toml)")
    g.add_argument("--prefix", help="topic prefix (default: the config's, else fleet/v1)")


# ----------------------------------------------------------------------------- watch


def cmd_fleet_watch(args: argparse.Namespace) -> int:
    from agent.fleet.operator import watch
    from agent.fleet.operator_link import FleetError

    try:
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
        print(json.dumps(to_json(view, now, args.filter), indent=2))
        if view.malformed or view.late_wills:
            print(f"edge-agent: {summary(view, now, args.filter)}", file=sys.stderr)
    else:
        print(render(view, now, shutil.get_terminal_size((160, 50)).columns, filter=args.filter))
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


def _name(enum: Any, value: int) -> str:
    """An enum value's name; the number for values this build does not know."""
    try:
        return str(enum.Name(value))
    except ValueError:
        return str(value)


def describe(resp: pb.CommandResponse, device: str) -> str:
    """A human summary of a response: the code and message, then the result."""
    code = _name(pb.CommandResponse.Code, resp.code)
    head = f"{device} {resp.command or '?'}: {code}" + (f": {resp.message}" if resp.message else "")
    lines = [head]
    which = resp.WhichOneof("result")
    if which == "pong":
        skew = time.time() - resp.pong.timestamp_unix
        lines.append(f"  pong: session {resp.pong.session}, clock {skew:+.1f} s behind ours")
    elif which == "status":
        lines += [f"  {line}" for line in _status_lines(health_info(resp.status))]
    elif which == "reload":
        r = resp.reload
        lines.append(f"  reload {'ok' if r.ok else 'FAILED'}: serving {r.model or '?'}")
        if r.message:
            lines.append(f"  {r.message}")
    elif which == "update":
        u = resp.update
        phase = _name(pb.UpdateStatus.Phase, u.phase)
        reason = f" ({u.reason_code})" if u.reason_code else ""
        lines.append(f"  update {u.update_id}: {phase}{reason} {u.from_version} -> {u.to_version}")
        if u.message:
            lines.append(f"  {u.message}")
    return "\n".join(lines)


def _status_lines(h: HealthInfo) -> list[str]:
    mib = 1 << 20
    return [
        f"agent {h.agent_version} {h.agent_state}, session {h.session}, up {h.uptime_s:.0f} s",
        f"model {h.model or '?'}, profile {h.profile or '?'}, "
        f"{h.accelerator or '?'} {h.execution_path}".rstrip(),
        f"memory {h.rss_bytes / mib:.0f} MiB of {h.budget_bytes / mib:.0f} MiB budget",
        f"requests {h.requests_total} ({h.requests_failed} failed, {h.requests_rejected} "
        f"rejected), ttft p50 {h.ttft_p50_ms:.0f} ms, decode p50 {h.decode_tok_s_p50:.1f} tok/s",
        ("temperature none" if h.max_celsius is None else f"temperature {h.max_celsius:.0f} C")
        + (", THROTTLED" if h.throttled_now else "")
        + (", UNDER-VOLTAGE" if h.under_voltage else "")
        + (", throttled since boot" if h.throttled_since_boot else ""),
        f"disk {h.disk_free_bytes / mib:.0f} MiB free of {h.disk_total_bytes / mib:.0f} MiB",
    ] + (
        [f"last update {h.update_phase} {h.update_to_version} {h.update_message}".rstrip()]
        if h.update_phase
        else []
    )


def cmd_fleet_send(args: argparse.Namespace) -> int:
    from agent.fleet.operator import send
    from agent.fleet.operator_link import FleetError

    try:
        opts, fleet = _connection(args)
        if not DEVICE_ID_RE.fullmatch(args.device):
            raise _Usage(f"device id {args.device!r} is not valid (A-Z a-z 0-9 _ . : -)")
        if not COMMAND_RE.fullmatch(args.cmd):
            raise _Usage(f"command {args.cmd!r} is not valid (e.g. ping, status, reload)")
        prefix = args.prefix or fleet.topic_prefix
        if not _good_prefix(prefix):
            raise _Usage(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
        cmd_args = _parse_args(args.arg)
        body = _read_body(args.body_file)
    except _Usage as exc:
        return _fail(str(exc))
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
    from agent.fleet.operator_link import FleetError
    from agent.fleet.publish import online_devices, publish_update, read_offer
    from agent.ota.bundle import BundleError

    try:
        opts, fleet = _connection(args)
        prefix = args.prefix or fleet.topic_prefix
        if not _good_prefix(prefix):
            raise _Usage(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
        if bool(args.device) == bool(args.all):
            raise _Usage("give --device ID (repeatable) or --all")
        for d in args.device:
            if not DEVICE_ID_RE.fullmatch(d):
                raise _Usage(f"device id {d!r} is not valid (A-Z a-z 0-9 _ . : -)")
        read_offer(Path(args.bundle))  # a bad bundle is refused before anything is sent
    except (_Usage, BundleError) as exc:
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
            opts, prefix, Path(args.bundle), devices, timeout_s=args.timeout, on_status=show
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
    from agent.fleet.operator import send
    from agent.fleet.operator_link import FleetError
    from agent.ota.cancel import sign_cancel
    from agent.ota.cli import parse_duration
    from agent.ota.keys import load_private

    try:
        opts, fleet = _connection(args)
        prefix = args.prefix or fleet.topic_prefix
        for d in args.device:
            if not DEVICE_ID_RE.fullmatch(d):
                raise _Usage(f"device id {d!r} is not valid (A-Z a-z 0-9 _ . : -)")
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

    p = sub.add_parser("send", help="send a command to one device and print its answer")
    p.add_argument("device", metavar="DEVICE", help="device id")
    p.add_argument(
        "cmd",
        metavar="CMD",
        help="command: ping, status, reload, update (--body-file: a SignedManifest, the "
        "manifest.pb of a bundle; `publish-update` sends it and serves the payload) or cancel "
        "(--body-file: a SignedCancel of the update in progress)",
    )
    p.add_argument(
        "--arg", action="append", default=[], metavar="KEY=VALUE", help="argument (repeatable)"
    )
    p.add_argument("--body-file", metavar="F", help="the command's body (- for stdin)")
    p.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="wait this long (default: 10)"
    )
    p.add_argument("--json", action="store_true", help="print the CommandResponse as JSON")
    _connection_args(p)
    p.set_defaults(func=cmd_fleet_send)

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
