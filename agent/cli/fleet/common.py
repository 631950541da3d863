"""What the `edge-agent fleet` commands share: the MQTT connection from the agent config's
[fleet] section with the flags on top, the usage error, and a device's answer for people.

Exit codes: 0 done, 1 the device answered an error, did not answer, or the broker could not be
reached, 2 usage or configuration errors, 130 interrupted (docs/FLEET.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from agent.base.errors import AgentError
from agent.config.file import (
    BROKER_FORMAT,
    GROUP_RE,
    MQTT_PROTOCOLS,
    Broker,
    FleetConfig,
    load_config,
)
from agent.config.fleet import check_device_id, parse_brokers
from agent.fleet.mqtt import MqttOptions
from agent.operator.digest import HealthInfo, health_info
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


class _Usage(AgentError):
    """A bad flag or a missing setting: printed, exit 2."""


def _connection(args: argparse.Namespace) -> tuple[MqttOptions, FleetConfig]:
    """MqttOptions from the config's [fleet] section with the flags applied on top."""
    fleet = load_config(Path(args.config) if args.config else None).fleet
    broker: Broker | None
    if args.broker:  # given once or more: these replace the config's list whole
        brokers = parse_brokers("--broker", "--broker", list(args.broker))
        broker, others = brokers[0], brokers[1:]
    else:
        broker, others = fleet.broker, fleet.other_brokers
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
        other_brokers=others,
        protocol=args.protocol or fleet.protocol,
        ca_file=path("ca_file", fleet.ca_file),
        cert_file=cert,
        key_file=key,
        username=args.username if args.username is not None else fleet.username,
        password_file=path("password_file", fleet.password_file),
        keepalive_s=fleet.keepalive_s,
        encoding=fleet.encoding,
    )
    return opts, fleet


def _group(args: argparse.Namespace) -> str | None:
    """The `--group` flag, checked like the config's `[fleet] group`; None if not given."""
    group: str | None = getattr(args, "group", None)
    if group is not None and not GROUP_RE.fullmatch(group):
        raise _Usage(
            f"--group {group!r} is not valid: 1-64 of A-Z a-z 0-9 _ . : - (a letter or digit first)"
        )
    return group


def _device_id(text: str) -> str:
    """A device id given on the command line (`agent.config.fleet.check_device_id`)."""
    try:
        return check_device_id(text)
    except ValueError as exc:
        raise _Usage(str(exc)) from None


def _group_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--group", metavar="G", help=f"{what} whose [fleet] group is G (as they announce it)"
    )


def _good_prefix(prefix: str) -> bool:
    return bool(prefix) and not any(c in prefix for c in "+#") and prefix.strip("/") == prefix


def _connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (default: the [fleet] section of --config)")
    g.add_argument(
        "--broker",
        action="append",
        help=f"{BROKER_FORMAT}; again for each node of a broker cluster, tried in order",
    )
    g.add_argument("--protocol", choices=MQTT_PROTOCOLS, help="MQTT version (default: 5)")
    g.add_argument("--ca-file", help="CA that signed the broker's certificate (mqtts)")
    g.add_argument("--cert-file", help="client certificate (mutual TLS)")
    g.add_argument("--key-file", help="client key (mutual TLS)")
    g.add_argument("--username")
    g.add_argument("--password-file", help="file holding the password")
    g.add_argument("--config", help="agent config (default: /etc/edge-agent/agent.toml)")
    g.add_argument("--prefix", help="topic prefix (default: the config's, else fleet/v1)")


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
