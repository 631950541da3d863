"""What follows an ended update: its id finished on the device (replay protection), its
payload removed, and the model directories nothing names any more deleted. Idempotent: the
updater runs it when the record ends and again at the next start (a crash may have come
between the record and its cleanup)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from agent.ota.reports import manifest_of
from agent.ota.store import Installed, Store
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

R = opb.UpdateRecord


class Cleanup:
    def __init__(self, store: Store, installed: Callable[[], Installed]) -> None:
        self.store = store
        self.installed = installed  # the pointer as it is now (the shipped model if none)

    def complete(self, rec: opb.UpdateRecord) -> None:
        """What follows an ended record, idempotent (run again at the next start): the id is
        finished (replay protection), the payload and the model directories nothing names any
        more are removed."""
        m = manifest_of(rec)
        inst = self.installed()
        if rec.state in (R.REJECTED, R.ROLLED_BACK) and m.update_id not in inst.finished:
            self.store.switch(dataclasses.replace(inst, finished=(*inst.finished, m.update_id)))
        self.store.payload_path(m.update_id).unlink(missing_ok=True)
        if rec.state == R.COMMITTED:
            keep = [Path(inst.current.model_dir)]
            if inst.last_good is not None:
                keep.append(Path(inst.last_good.model_dir))
            self.store.remove_unused(keep)
        else:
            self.remove_built(rec)

    def remove_built(self, rec: opb.UpdateRecord) -> None:
        """Delete the model directory this update built once nothing names it: not the serving
        model, the last known good or the one the update started from."""
        if rec.staged_model_dir:
            inst = self.installed()
            keep = [inst.current.model_dir, rec.previous_model_dir]
            keep += [inst.last_good.model_dir] if inst.last_good is not None else []
            self.store.remove_built(Path(rec.staged_model_dir), [Path(k) for k in keep if k])
