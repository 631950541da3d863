"""What the updater needs from the daemon (`UpdateHost`): the daemon implements it and hands it
to `Updater.attach`, so the update machine never imports the daemon or the engine."""

from __future__ import annotations

from typing import Protocol

from agent.ota.artifact.manifest import InstallContext
from agent.ota.store import ModelRef
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb


class UpdateHost(Protocol):
    """What the updater needs from the daemon."""

    def install_context(self, installed: ModelRef) -> InstallContext: ...

    async def activate(self, ref: ModelRef, canary: opb.Canary | None) -> None:
        """Load `ref` beside the serving model, check it, switch to it; raise if it fails
        (the serving model keeps serving)."""

    async def check_serving(self, canary: opb.Canary | None) -> str | None:
        """None if the serving model is healthy, else why not (the trial's checks)."""

    def report(self, status: fpb.UpdateStatus, key: str = "") -> None:
        """Record a status report (durably, when there is a fleet link); a report with a `key`
        that was recorded before is not recorded again."""

    def remove_unused_caches(self) -> None:
        """Delete what loading models left that the serving model does not use (its prepared
        copies and packed weights): called once an update has ended."""
