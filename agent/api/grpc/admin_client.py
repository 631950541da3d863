"""The admin socket's client (agent.api.grpc.admin): what `edge-agent update install|commit|
rollback|status` and the Mender Update Module use. Synchronous; each call has a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Final

import grpc

from agent.base.errors import AgentError
from agent.pb.edge_agent.admin.v1 import admin_pb2 as apb
from agent.pb.edge_agent.admin.v1 import admin_pb2_grpc
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb

Phase = fpb.UpdateStatus
ENDED: Final = (Phase.COMMITTED, Phase.ROLLED_BACK, Phase.REJECTED, Phase.FAILED)
POLL_S: Final = 0.2


class AdminError(AgentError):
    """A call the daemon refused (its gRPC status and message), or no daemon at the socket."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class AdminClient:
    def __init__(self, socket: Path, timeout_s: float = 120.0) -> None:
        self.socket = socket
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(f"unix:{socket}")
        self._stub = admin_pb2_grpc.UpdatesStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install(
        self, signed: bytes, payload: Iterable[bytes], args: Mapping[str, str]
    ) -> fpb.UpdateStatus:
        """Hand the daemon a signed bundle; its status once started (RECEIVED) or refused."""

        def chunks() -> Iterator[apb.InstallChunk]:
            yield apb.InstallChunk(signed_manifest=signed, args=dict(args))
            for block in payload:
                yield apb.InstallChunk(payload=block)

        return self._call(lambda: self._stub.Install(chunks(), timeout=self._timeout))

    def status(self, update_id: str = "") -> fpb.UpdateStatus:
        req = apb.StatusRequest(update_id=update_id)
        return self._call(lambda: self._stub.Status(req, timeout=self._timeout))

    def decide(self, update_id: str, commit: bool) -> fpb.UpdateStatus:
        """Commit or roll back an update installed with commit=external; its final status."""
        d = apb.DecideRequest.COMMIT if commit else apb.DecideRequest.ROLLBACK
        req = apb.DecideRequest(update_id=update_id, decision=d)
        return self._call(lambda: self._stub.Decide(req, timeout=self._timeout))

    def wait(
        self, update_id: str, done: Callable[[fpb.UpdateStatus], bool], timeout_s: float
    ) -> fpb.UpdateStatus:
        """Poll the update's status until `done` says so, it has ended, or `timeout_s` (then
        AdminError DEADLINE_EXCEEDED)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status(update_id)
            if done(st) or st.phase in ENDED:
                return st
            if time.monotonic() >= deadline:
                phase = Phase.Phase.Name(st.phase)
                raise AdminError(
                    "DEADLINE_EXCEEDED",
                    f"update {update_id} is still {phase} ({st.message}) after {timeout_s:g} s",
                )
            time.sleep(POLL_S)

    def _call(self, fn: Callable[[], fpb.UpdateStatus]) -> fpb.UpdateStatus:
        try:
            return fn()
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() is not None else "UNKNOWN"
            detail = exc.details() or ""
            if code == "UNAVAILABLE":
                detail = f"no edge-agent daemon answers at {self.socket} ({detail})"
            raise AdminError(code, detail) from None
