"""`edge-agent update install|commit|rollback|status`: a signed bundle installed from this
machine over the daemon's admin socket (agent.api.grpc.admin; docs/UPDATES.md, "Installing from
this machine"), and the commit or rollback of one installed with `--commit external`.

Exit: 0 when the update got where it was asked to (see `--until`), 1 when it ended otherwise
(rejected, rolled back: the message says why), 2 for a bad argument or a refused call, 3 when
`--timeout` passed first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Final

from agent.base.errors import AgentError
from agent.cli.common import _fail
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb

Phase = fpb.UpdateStatus
EXIT_ENDED: Final = 1
EXIT_TIMEOUT: Final = 3
UNTIL: Final = ("received", "trial", "end")


def admin_socket_of(args: argparse.Namespace) -> Path:
    """--admin-socket, else the one beside the daemon's apps' socket (as `client` finds it)."""
    from agent.api.grpc.admin import admin_socket
    from agent.cli.client_text import socket_of

    if args.admin_socket:
        return Path(args.admin_socket)
    return admin_socket(Path(socket_of(args)))


def reached(st: fpb.UpdateStatus, until: str) -> bool:
    """Whether `st` is as far as `until` asks: "received" (started), "trial" (the new model
    serves: in its trial or waiting for the commit, or committed), "end" (committed)."""
    if until == "received":
        return st.phase not in (Phase.REJECTED, Phase.FAILED, Phase.PHASE_UNSPECIFIED)
    if until == "trial":
        return st.phase in (Phase.TRIAL, Phase.COMMITTED)
    return st.phase == Phase.COMMITTED


def _print(st: fpb.UpdateStatus, as_json: bool) -> None:
    if as_json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(st, preserving_proto_field_name=True), indent=2))
    else:
        print(f"update {st.update_id or '-'}: {Phase.Phase.Name(st.phase)}: {st.message}")


def _outcome(st: fpb.UpdateStatus, until: str, as_json: bool) -> int:
    _print(st, as_json)
    return 0 if reached(st, until) else EXIT_ENDED


def cmd_install(args: argparse.Namespace) -> int:
    from agent.api.grpc.admin_client import AdminClient, AdminError
    from agent.ota.artifact.bundle import read_bundle
    from agent.ota.orders import WAITING

    until = args.until or ("trial" if args.commit == "external" else "end")
    install_args = {"commit": args.commit}
    if args.activate:
        install_args["activate"] = args.activate
    try:
        signed, payload = read_bundle(Path(args.bundle))
        with AdminClient(admin_socket_of(args)) as c:
            st = c.install(signed.SerializeToString(), payload.chunks(), install_args)
            if st.phase in (Phase.REJECTED, Phase.FAILED) or until == "received":
                return _outcome(st, until, args.json)

            def done(s: fpb.UpdateStatus) -> bool:
                waiting = s.phase == Phase.TRIAL and s.message == WAITING
                return s.phase == Phase.COMMITTED or (until == "trial" and waiting)

            st = c.wait(st.update_id, done, args.timeout)
    except AdminError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT if exc.code == "DEADLINE_EXCEEDED" else 2
    except (AgentError, OSError) as exc:
        return _fail(str(exc))
    return _outcome(st, until, args.json)


def _decide(args: argparse.Namespace, commit: bool) -> int:
    from agent.api.grpc.admin_client import AdminClient, AdminError

    try:
        with AdminClient(admin_socket_of(args), timeout_s=args.timeout) as c:
            st = c.decide(args.update_id or "", commit)
    except AdminError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT if exc.code == "DEADLINE_EXCEEDED" else 2
    want = Phase.COMMITTED if commit else Phase.ROLLED_BACK
    _print(st, args.json)
    return 0 if st.phase == want or (not commit and st.phase == Phase.REJECTED) else EXIT_ENDED


def cmd_status(args: argparse.Namespace) -> int:
    from agent.api.grpc.admin_client import AdminClient, AdminError

    try:
        with AdminClient(admin_socket_of(args), timeout_s=args.timeout) as c:
            st = c.status(args.update_id or "")
    except AdminError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 2
    _print(st, args.json)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-socket",
        metavar="PATH",
        help="the daemon's admin socket (default: beside its [server] socket, e.g. "
        "/run/edge-agent/agent-admin.sock; root or the daemon's user only)",
    )
    p.add_argument("--socket", help=argparse.SUPPRESS)  # (socket_of reads it)
    p.add_argument("--config", help="the daemon's config file, for its [server] socket")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (default: 600)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def add_local_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`update install`, `update commit`, `update rollback`, `update status`."""
    p = sub.add_parser(
        "install", help="install a signed bundle on the daemon of this machine (admin socket)"
    )
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument(
        "--commit",
        choices=("auto", "external"),
        default="auto",
        help="auto: the trial commits (default); external: the new model serves, waiting "
        "for `update commit` or `update rollback`",
    )
    p.add_argument("--activate", help="when to switch: now, idle, window[:CRON] (default: config)")
    p.add_argument(
        "--until",
        choices=UNTIL,
        help="return once it started (received), serves (trial) or committed (end; the "
        "default, or trial with --commit external)",
    )
    _common(p)
    p.set_defaults(func=cmd_install)
    for name, commit in (("commit", True), ("rollback", False)):
        p = sub.add_parser(
            name, help=f"{name} the update installed with --commit external (its final status)"
        )
        p.add_argument("update_id", nargs="?", metavar="UPDATE_ID", help="default: the latest")
        _common(p)
        p.set_defaults(func=lambda a, c=commit: _decide(a, c))
    p = sub.add_parser("status", help="the latest update's status (or UPDATE_ID's)")
    p.add_argument("update_id", nargs="?", metavar="UPDATE_ID")
    _common(p)
    p.set_defaults(func=cmd_status)
