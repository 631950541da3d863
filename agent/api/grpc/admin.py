"""The admin socket: the Updates service (proto/edge_agent/admin/v1/admin.proto) on a unix socket
of its own, mode 0600, beside the apps' socket (`admin_socket`). A local installer (the Mender
Update Module, `edge-agent update install`) hands the daemon a signed bundle there, and commits
or rolls back an update installed with commit=external.

Not on the apps' socket: grpcio cannot tell a unix-socket caller's uid (agent.api.identity), so
who may decide a commit is the socket file's permissions: the daemon's user, and root. What may
install is still the bundle's signatures, checked by the updater as for a fleet update.
The payload streams into the update store's directory (`Backend.incoming`), bounded by the size
the manifest names, and moves into place once the manifest is accepted; what is not accepted
is removed, and a start removes what a killed install left (`INCOMING_PREFIX`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final, Protocol

import grpc

from agent.api import unixsocket
from agent.base.errors import ERROR_TRAILER, AgentError, HostError, grpc_status_name
from agent.pb.edge_agent.admin.v1 import admin_pb2 as apb
from agent.pb.edge_agent.admin.v1 import admin_pb2_grpc
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger("agent.api.admin")

INCOMING_PREFIX: Final = ".incoming-"
MODE: Final = 0o600
DECISIONS: Final = {apb.DecideRequest.COMMIT: "commit", apb.DecideRequest.ROLLBACK: "rollback"}


def admin_socket(api_socket: Path) -> Path:
    """Where the admin socket is: beside the apps' gRPC socket (`agent.sock` ->
    `agent-admin.sock`)."""
    return api_socket.with_name(f"{api_socket.stem}-admin.sock")


class Backend(Protocol):
    """What the admin service drives (the daemon, over its updater)."""

    def incoming(self) -> Path:
        """The directory an install's payload streams into (the update store's)."""
        ...

    async def install(
        self, signed: bytes, args: dict[str, str], payload: Path
    ) -> fpb.UpdateStatus: ...

    def update_status(self, update_id: str) -> fpb.UpdateStatus: ...

    async def decide(self, update_id: str, decision: str) -> fpb.UpdateStatus: ...


class UpdatesService(admin_pb2_grpc.UpdatesServicer):
    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    async def Install(
        self, request_iterator: AsyncIterator[apb.InstallChunk], context: Any
    ) -> fpb.UpdateStatus:
        part = self._backend.incoming() / f"{INCOMING_PREFIX}{uuid.uuid4().hex}"
        try:
            signed, size = b"", 0
            args: dict[str, str] = {}
            limit: int | None = None
            with open(part, "wb") as out:
                async for chunk in request_iterator:
                    if limit is None:
                        signed, args, limit = _first(chunk)
                    size += len(chunk.payload)
                    if size > limit:
                        raise _Refused(f"the payload is longer than the manifest's {limit} bytes")
                    out.write(chunk.payload)
                out.flush()
                await asyncio.to_thread(os.fsync, out.fileno())  # not on the daemon's loop
            if limit is None:
                raise _Refused("no chunk: the first carries the signed manifest")
            status = await self._backend.install(signed, args, part)
            log.info(
                "admin: install of update %s: %s %s",
                status.update_id or "?",
                fpb.UpdateStatus.Phase.Name(status.phase),
                status.message,
            )
            return status
        except _Refused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from None
        except AgentError as exc:
            await _abort(context, exc)
            raise AssertionError("unreachable") from None
        except OSError as exc:  # the update store's disk (full, read-only)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot store the payload: {exc}")
            raise AssertionError("unreachable") from None
        finally:
            part.unlink(missing_ok=True)  # accepted: moved into place already

    async def Status(self, request: apb.StatusRequest, context: Any) -> fpb.UpdateStatus:
        try:
            return self._backend.update_status(request.update_id)
        except AgentError as exc:
            await _abort(context, exc)
            raise AssertionError("unreachable") from None

    async def Decide(self, request: apb.DecideRequest, context: Any) -> fpb.UpdateStatus:
        decision = DECISIONS.get(request.decision)
        if decision is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "decision: allowed: COMMIT, ROLLBACK"
            )
        assert decision is not None
        try:
            status = await self._backend.decide(request.update_id, decision)
        except AgentError as exc:
            await _abort(context, exc)
            raise AssertionError("unreachable") from None
        log.info("admin: %s of update %s: %s", decision, status.update_id, status.message)
        return status


class _Refused(Exception):
    """A malformed install stream (INVALID_ARGUMENT)."""


def _first(chunk: apb.InstallChunk) -> tuple[bytes, dict[str, str], int]:
    """The first chunk's manifest, arguments and the payload size its manifest names (the
    bound of what is accepted; the signatures are the updater's to check)."""
    if not chunk.signed_manifest:
        raise _Refused("the first chunk carries the signed manifest (signed_manifest)")
    try:
        signed = opb.SignedManifest.FromString(chunk.signed_manifest)
        m = opb.Manifest.FromString(signed.manifest)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise _Refused(f"signed_manifest is not a SignedManifest: {exc}") from None
    return chunk.signed_manifest, dict(chunk.args), m.payload_size


async def _abort(context: Any, exc: AgentError) -> None:
    code = getattr(grpc.StatusCode, grpc_status_name(exc))
    await context.abort(code, str(exc), trailing_metadata=((ERROR_TRAILER, type(exc).__name__),))


class AdminServer:
    """The admin socket's gRPC server: `start` binds (0600) and serves, `stop` closes."""

    def __init__(self, backend: Backend, path: Path) -> None:
        self.path = path
        self._backend = backend
        self._server = grpc.aio.server()
        service = UpdatesService(backend)
        admin_pb2_grpc.add_UpdatesServicer_to_server(service, self._server)  # type: ignore[no-untyped-call]
        self._bound: unixsocket.BoundSocket | None = None

    async def start(self) -> None:
        for stale in self._backend.incoming().glob(f"{INCOMING_PREFIX}*"):
            stale.unlink(missing_ok=True)  # a killed install's (only ever ours: the prefix)
        with unixsocket.bind_guard(self.path):
            old = os.umask(0o777 ^ MODE)
            try:
                self._server.add_insecure_port(f"unix:{self.path}")
            except RuntimeError as exc:
                raise HostError(f"cannot bind the admin socket {self.path}") from exc
            finally:
                os.umask(old)
            self._bound = unixsocket.bound(self.path)
        await self._server.start()
        log.info("admin: listening on unix:%s (mode 0600)", self.path)

    async def stop(self, grace: float = 5.0) -> None:
        await self._server.stop(grace)
        if self._bound is not None:
            with contextlib.suppress(OSError):
                unixsocket.remove_if_ours(self._bound)
