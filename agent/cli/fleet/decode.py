"""`edge-agent fleet decode`: a filter from `mosquitto_sub -F '%t %x'` output (a topic, a space,
the payload in hex; one message a line) to one readable line a message: the topic, the message
type and the message as compact JSON (the protobuf JSON mapping; docs/FLEET.md, "Payloads").

Either encoding reads: the type follows from the topic (`agent.fleet.codec.TOPIC_TYPES`), the
encoding from the payload. A line that does not read is one line on stderr naming its number
and why, and the filter goes on. Exit 0 if every line read, 1 otherwise, 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from agent.base.errors import AgentError
from agent.cli.common import _fail
from agent.cli.fleet.common import EXIT_FAILED, EXIT_INTERRUPTED, _good_prefix
from agent.config.file import load_config
from agent.fleet.codec import PayloadError, decode, render, topic_type
from agent.fleet.topics import parse


class _Unreadable(AgentError):
    """One input line that is not a fleet message."""


def decode_line(prefix: str, line: str) -> str:
    """The readable line for one `%t %x` line; raises _Unreadable saying why."""
    topic, _, hexed = line.rstrip("\r\n").rstrip(" ").partition(" ")
    if not topic:
        raise _Unreadable("empty line")
    parsed = parse(prefix, topic)
    if parsed is None:
        raise _Unreadable(f"{topic!r} is not a fleet topic under {prefix}")
    try:
        payload = bytes.fromhex(hexed)
    except ValueError as exc:
        raise _Unreadable(f"the payload is not hex ({exc}); use mosquitto_sub -F '%t %x'") from exc
    cls = topic_type(parsed)
    if not payload:  # a cleared retained topic
        return f"{topic} {cls.DESCRIPTOR.full_name} null"
    try:
        msg = decode(cls, payload)
    except PayloadError as exc:
        raise _Unreadable(str(exc)) from exc
    doc = json.dumps(render(parsed, msg), separators=(",", ":"), ensure_ascii=False)
    return f"{topic} {cls.DESCRIPTOR.full_name} {doc}"


def run_decode(prefix: str, lines: TextIO, out: TextIO, err: TextIO) -> int:
    """Decode every line of `lines`; 0 if all read, else 1."""
    bad = 0
    for number, line in enumerate(lines, 1):
        try:
            print(decode_line(prefix, line), file=out, flush=True)
        except _Unreadable as exc:
            bad += 1
            print(f"edge-agent: fleet decode: line {number}: {exc}", file=err, flush=True)
    return EXIT_FAILED if bad else 0


def cmd_fleet_decode(args: argparse.Namespace) -> int:
    try:
        fleet = load_config(Path(args.config) if args.config else None).fleet
    except AgentError as exc:
        return _fail(str(exc))
    prefix = args.prefix or fleet.topic_prefix
    if not _good_prefix(prefix):
        return _fail(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
    stdin = open(sys.stdin.fileno(), encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    try:
        return run_decode(prefix, stdin, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `| head`: the reader went away
        return 0


def add_decode_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``decode`` to the ``fleet`` command's subparsers."""
    p = sub.add_parser(
        "decode",
        help="turn `mosquitto_sub -F '%%t %%x'` output into readable lines (topic, type, JSON)",
        description="Reads `mosquitto_sub -F '%%t %%x'` output on stdin (topic, space, hex "
        "payload; protobuf or JSON payloads) and writes one line a message: the topic, the "
        "message type and the message as compact JSON (protobuf JSON mapping). Exit 0 if "
        "every line read, 1 if some did not (each named on stderr), 2 usage errors.",
    )
    p.add_argument("--prefix", help="topic prefix (default: the config's, else fleet/v1)")
    p.add_argument("--config", help="agent config (default: /etc/edge-agent/agent.toml)")
    p.set_defaults(func=cmd_fleet_decode)
