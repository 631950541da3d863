"""`edge-agent mender module|install-module`: edge-agent's Update Module for Mender (protocol v3;
docs/UPDATES.md, "Deploying with Mender").

Mender's client runs the module (`/usr/share/mender/modules/v3/edge-agent-model`, a two-line
script that execs `edge-agent mender module`) for each state of a deployment of an artifact of
type edge-agent-model (`update make --mender`). The module drives the daemon over its admin
socket; the daemon keeps its own checks (signatures, delta, canary, trial, hot swap):

* Download: nothing (Mender stores the bundle in the payload tree's files/);
* ArtifactInstall: install it with commit=external; success once the new model serves and its
  trial has passed, failure when the daemon rejected it or rolled it back;
* ArtifactCommit / ArtifactRollback: the daemon's commit or rollback of that update;
* NeedsArtifactReboot: No; SupportsRollback: Yes; every other state: nothing, success.

The update id lives in the payload tree's tmp/ between states (Mender keeps the tree until
Cleanup). A state that fails prints one line to stderr, which Mender's log keeps.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import Final

from agent.base.errors import AgentError
from agent.cli.common import _fail
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb

Phase = fpb.UpdateStatus
MODULE_NAME: Final = "edge-agent-model"  # = agent.ota.mender.artifact.PAYLOAD_TYPE
MODULES_DIR: Final = Path("/usr/share/mender/modules/v3")
ID_FILE: Final = "edge-agent-update-id"
MARK: Final = "# edge-agent's Update Module for Mender"


def _update_id(tree: Path) -> str:
    try:
        return (tree / "tmp" / ID_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def _install(tree: Path, socket: Path, timeout_s: float) -> int:
    from agent.api.grpc.admin_client import AdminClient
    from agent.ota.artifact.bundle import read_bundle
    from agent.ota.orders import WAITING

    files = sorted(p for p in (tree / "files").iterdir() if p.is_file())
    if len(files) != 1:
        return _fail(f"{tree / 'files'}: expected one edge-agent bundle, found {len(files)} files")
    signed, payload = read_bundle(files[0])
    with AdminClient(socket) as c:
        st = c.install(signed.SerializeToString(), payload.chunks(), {"commit": "external"})
        if st.update_id:
            (tree / "tmp").mkdir(exist_ok=True)
            (tree / "tmp" / ID_FILE).write_text(st.update_id)
        if st.phase not in (Phase.REJECTED, Phase.FAILED):
            st = c.wait(
                st.update_id, lambda s: s.phase == Phase.TRIAL and s.message == WAITING, timeout_s
            )
    ok = st.phase == Phase.TRIAL
    print(
        f"edge-agent: update {st.update_id}: {Phase.Phase.Name(st.phase)}: {st.message}",
        file=sys.stderr,
    )
    return 0 if ok else 1


def _decide(tree: Path, socket: Path, commit: bool) -> int:
    from agent.api.grpc.admin_client import AdminClient

    update_id = _update_id(tree)
    if not update_id:
        if commit:
            return _fail(f"{tree / 'tmp' / ID_FILE}: no update was installed in this deployment")
        return 0  # ArtifactInstall never reached the daemon: nothing to roll back
    with AdminClient(socket) as c:
        st = c.decide(update_id, commit)
    print(
        f"edge-agent: update {update_id}: {Phase.Phase.Name(st.phase)}: {st.message}",
        file=sys.stderr,
    )
    if commit:
        return 0 if st.phase == Phase.COMMITTED else 1
    return 0 if st.phase in (Phase.ROLLED_BACK, Phase.REJECTED) else 1


def cmd_module(args: argparse.Namespace) -> int:
    state, tree, socket = args.state, Path(args.tree), Path(args.admin_socket)
    if state == "SupportsRollback":
        print("Yes")
        return 0
    if state == "NeedsArtifactReboot":
        print("No")
        return 0
    try:
        if state == "ArtifactInstall":
            return _install(tree, socket, args.timeout)
        if state in ("ArtifactCommit", "ArtifactRollback"):
            return _decide(tree, socket, commit=state == "ArtifactCommit")
    except (AgentError, OSError) as exc:
        print(f"edge-agent: {state}: {exc}", file=sys.stderr)
        return 1
    return 0  # Download, ArtifactFailure, Cleanup, ...: nothing to do


def module_script(admin_socket: Path, python: str = sys.executable) -> str:
    return (
        f"#!/bin/sh\n{MARK} (edge-agent mender install-module)\n"
        f'exec {python} -m agent mender module --admin-socket {admin_socket} "$@"\n'
    )


def cmd_install_module(args: argparse.Namespace) -> int:
    """Write the module script; an existing file is replaced only if it is ours (its mark)."""
    from agent.api.grpc.admin import admin_socket
    from agent.cli.update_local import admin_socket_of

    socket = admin_socket_of(args) if (args.admin_socket or args.config) else None
    if socket is None:
        from agent.cli.client_text import socket_of

        socket = admin_socket(Path(socket_of(args)))
    target = Path(args.modules_dir) / MODULE_NAME
    try:
        if target.exists() and MARK not in target.read_text(errors="replace"):
            return _fail(f"{target}: exists and is not edge-agent's module; not replaced")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(module_script(socket))
        tmp.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        os.replace(tmp, target)
    except OSError as exc:
        return _fail(f"{target}: {exc}")
    print(f"installed {target} (admin socket {socket})")
    return 0


def add_mender_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = subparsers.add_parser("mender", help="deploy models with Mender: the Update Module")
    sub = top.add_subparsers(dest="mender_command", required=True)
    p = sub.add_parser(
        "install-module",
        help=f"install the Update Module for artifacts of type {MODULE_NAME} (as root)",
    )
    p.add_argument("--modules-dir", default=str(MODULES_DIR), help=f"default: {MODULES_DIR}")
    p.add_argument("--admin-socket", help="the daemon's admin socket (default: from its config)")
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--config", help="the daemon's config file, for its [server] socket")
    p.set_defaults(func=cmd_install_module)
    p = sub.add_parser("module", help="the Update Module itself (Mender's client runs it)")
    p.add_argument("state", metavar="STATE")
    p.add_argument("tree", metavar="FILES_DIR", nargs="?", default=".")
    p.add_argument("--admin-socket", required=True)
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds ArtifactInstall waits (default: 3600)",
    )
    p.set_defaults(func=cmd_module)
