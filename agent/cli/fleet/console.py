"""`edge-agent fleet console`: the fleet, its rollouts and each device's health as a read-only
web page served by this process (docs/ROLLOUTS.md "The console").

It connects to the broker as `fleet watch` does (the same connection flags and [fleet]
settings) and reads the rollouts directory of `fleet rollout` without writing to it. Exit codes:
0 stopped by SIGTERM, 1 the broker could not be reached at the start, 2 usage, a key file that
does not read, an address that cannot be listened on, or plotly not installed, 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from agent.base.errors import AgentError
from agent.cli.common import _fail
from agent.cli.fleet.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    _connection,
    _connection_args,
    _good_prefix,
    _Usage,
)

EXTRA_HINT = "pip install 'edge-agent[console]'"


def _plotly_js() -> Path | None:
    """plotly.js as the `plotly` package ships it (None: not installed)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    return None


def default_rollouts_dir() -> Path:
    """The directory `fleet rollout` uses by default (not created here: the console only reads)."""
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if base.startswith("/") else Path.home() / ".local" / "state"
    return root / "edge-agent" / "rollouts"


def _count(flag: str, text: str, low: int, high: int) -> int:
    if not text.isdigit() or not low <= int(text) <= high:
        raise _Usage(f"{flag} {text!r}: a whole number from {low} to {high}")
    return int(text)


def cmd_fleet_console(args: argparse.Namespace) -> int:
    plotly_js = _plotly_js()
    if plotly_js is None:
        return _fail(
            f"fleet console draws its charts with plotly, which is not installed: {EXTRA_HINT}"
        )
    from agent.base.keyfile import read_key
    from agent.operator.console.app import Console, build_app
    from agent.operator.console.feed import LiveFleet
    from agent.operator.console.history import HealthHistory
    from agent.operator.console.serve import bind, guarded, parse_listen, serve, url_of
    from agent.operator.link import FleetError
    from agent.operator.view import DEFAULT_STALE_AFTER_S

    started = time.time()
    try:
        points = _count("--history-points", args.history_points, 1, 100_000)
        kept = _count("--history-devices", args.history_devices, 1, 1_000_000)
        key = None
        if args.console_key_file:
            key = read_key(Path(args.console_key_file), "--console-key-file")
        host, port = parse_listen(args.listen, key is not None)
        fleet = None
        if not args.no_broker:
            opts, fleet_cfg = _connection(args)
            prefix = args.prefix or fleet_cfg.topic_prefix
            if not _good_prefix(prefix):
                raise _Usage(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
            stale = (
                args.stale_after
                if args.stale_after is not None
                else 3 * fleet_cfg.health_interval_s
            )
            history = HealthHistory(started, points, kept)
            fleet = LiveFleet(opts, prefix, history, stale or DEFAULT_STALE_AFTER_S)
        sock = bind(host, port)
    except AgentError as exc:
        return _fail(str(exc))
    rollouts = Path(args.rollouts_dir) if args.rollouts_dir else default_rollouts_dir()
    try:
        if fleet is not None:
            fleet.connect()
    except FleetError as exc:
        sock.close()
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    app = build_app(Console(fleet, rollouts, plotly_js, started), key)
    url = url_of(sock)

    def started_serving() -> None:
        print(f"edge-agent fleet console: serving {url}/ (rollouts from {rollouts})", flush=True)
        if key is not None:
            print(f"open {url}/?key={key}", flush=True)
        else:
            print(f"open {url}/", flush=True)

    try:
        serve(guarded(app, sock, args.allow_host), sock, started_serving)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        if fleet is not None:
            fleet.stop()
        sock.close()
    return 0


def add_console_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "console",
        help="a read-only web page of the fleet, its rollouts (gate charts) and device health",
        description="Serves the fleet by group, profile and version; rollouts with their waves, "
        "gate figures (before vs after per board class, as charts) and halts; each device's "
        "health since the console started. Loopback only unless --console-key-file is given; "
        "the Host and Origin rules of the HTTP API apply. Needs the console extra: "
        f'{EXTRA_HINT}. docs/ROLLOUTS.md "The console".',
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:8780",
        metavar="HOST:PORT",
        help="where to serve (default: 127.0.0.1:8780; port 0: any free port, printed)",
    )
    p.add_argument(
        "--console-key-file",
        metavar="F",
        help="the key (the file's first line, as http.key_file): every request needs "
        "Authorization: Bearer KEY or the cookie that opening /?key=KEY sets; needed to listen "
        "beyond loopback",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name browsers may use besides loopback names and the listen address",
    )
    p.add_argument(
        "--rollouts-dir",
        metavar="DIR",
        help="the rollouts of `fleet rollout`, read only (default: "
        "$XDG_STATE_HOME/edge-agent/rollouts)",
    )
    p.add_argument(
        "--no-broker", action="store_true", help="serve the rollouts only; no fleet connection"
    )
    p.add_argument(
        "--stale-after",
        type=float,
        metavar="S",
        help="online devices without health for S seconds are stale (default: 3 x the "
        "config's health_interval_s)",
    )
    p.add_argument(
        "--history-points",
        default="240",
        metavar="N",
        help="health reports kept per device (default: 240, 4 h at a 60 s interval)",
    )
    p.add_argument(
        "--history-devices",
        default="10000",
        metavar="N",
        help="devices with a health history; those heard after N get none (default: 10000)",
    )
    _connection_args(p)
    p.set_defaults(func=cmd_fleet_console)
