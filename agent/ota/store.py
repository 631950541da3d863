"""Which model serves, and the last known good one: the model store's pointer, replaced
atomically, so that after a crash it names either the old model or the new one; and the update
record, written before every side effect. Layout: `Store`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.base.errors import AgentError
from agent.base.fsutil import atomic_write_bytes, make_dirs
from agent.model.directory import load_model_dir, sha256_file
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A model directory and the variant that serves from it."""

    model_dir: str
    quantization: str
    sha256: str  # of the serving variant's file
    version: int  # the update version that installed it (0: as shipped)
    label: str = ""  # the human version

    def verify(self) -> str | None:
        """None if the variant's file is there with its recorded sha256, else what is wrong."""
        try:
            meta = load_model_dir(Path(self.model_dir))
            path = meta.path_of(meta.variant(self.quantization))
            actual = sha256_file(path)
        except Exception as exc:  # a missing or unreadable directory: not usable
            return f"{self.model_dir} is not a usable model directory: {exc}"
        if actual != self.sha256:
            return f"{path} has sha256 {actual[:12]}…, the record says {self.sha256[:12]}…"
        return None


@dataclass(frozen=True, slots=True)
class Installed:
    current: ModelRef
    last_good: ModelRef | None = None
    finished: tuple[str, ...] = field(default=())  # update ids that reached a final state


def _write_bytes(path: Path, data: bytes) -> None:
    make_dirs(path.parent)  # synced into the state directory: a cut must not take ota/
    atomic_write_bytes(path, data)


class Store:
    """The pointer and the update record. Layout under the state directory::

        models/<version>-<sha256[:16]>/  model directories built by updates (never modified
                                         after staging; `.staging` suffix while being built)
        ota/installed.json               the pointer: the serving model and the last known good
        ota/record.pb                    the update in progress (UpdateRecord), or the last one
        ota/payload/<update_id>.part     a download in progress

    The pointer file *is* the switch: it is replaced with `atomic_write` (temp file, fsync, rename,
    fsync the directory), so after a crash it names either the old model or the new one.
    """

    MAX_FINISHED = 256  # replay protection remembers this many update ids

    def __init__(self, state_dir: Path) -> None:
        self.models = state_dir / "models"
        self.dir = state_dir / "ota"
        self.pointer = self.dir / "installed.json"
        self.record_path = self.dir / "record.pb"
        self.payloads = self.dir / "payload"

    # ------------------------------------------------------------------ pointer

    def installed(self) -> Installed | None:
        try:
            doc: dict[str, Any] = json.loads(self.pointer.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error(
                "update pointer %s unreadable (%s); using the shipped model", self.pointer, exc
            )
            return None
        good = doc.get("last_good")
        return Installed(
            ModelRef(**doc["current"]),
            ModelRef(**good) if good else None,
            tuple(doc.get("finished", ())),
        )

    def switch(self, installed: Installed) -> None:
        """Atomically make `installed` the truth (this is the activation and the rollback)."""
        doc = {
            "current": asdict(installed.current),
            "last_good": asdict(installed.last_good) if installed.last_good else None,
            "finished": list(installed.finished[-self.MAX_FINISHED :]),
        }
        _write_bytes(self.pointer, (json.dumps(doc, indent=2) + "\n").encode())
        log.info(
            "model pointer: %s (%s), last good %s",
            installed.current.model_dir,
            installed.current.label or installed.current.version,
            installed.last_good.model_dir if installed.last_good else "-",
        )

    # ------------------------------------------------------------------ record

    def usable(
        self, inst: Installed, shipped: ModelRef, refused: Callable[[str], None]
    ) -> ModelRef:
        """At a start: the installed model if its files check out, else the last good one or
        the shipped one (pointed at, `refused` told why); AgentError when none is usable."""
        problem = inst.current.verify()
        if problem is None:
            return inst.current
        log.error("the active model is not what was installed: %s", problem)
        for fallback in (inst.last_good, shipped if inst.current != shipped else None):
            if fallback is not None and fallback.verify() is None:
                self.switch(Installed(fallback, None, inst.finished))
                refused(f"active model refused: {problem}")
                return fallback
        raise AgentError(f"no usable model: {problem}")

    def record(self) -> opb.UpdateRecord | None:
        try:
            data = self.record_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            record: opb.UpdateRecord = opb.UpdateRecord.FromString(data)
        except Exception as exc:  # a record we cannot read is treated as no update at all
            log.error("update record %s unreadable: %s", self.record_path, exc)
            return None
        return record

    def save(self, record: opb.UpdateRecord) -> None:
        """Persist the record (fsync) — before the side effect it announces."""
        record.updated_unix = time.time()
        _write_bytes(self.record_path, record.SerializeToString())

    # ------------------------------------------------------------------ files

    def model_dir_for(self, version: int, sha256: str) -> Path:
        return self.models / f"{version}-{sha256[:16]}"

    def payload_path(self, update_id: str) -> Path:
        return self.payloads / f"{update_id}.part"

    def remove_built(self, built: Path, keep: list[Path]) -> None:
        """Delete `built` (and a partial `built.staging`) if it is a model directory of this
        store and not one of `keep`: what an update that did not commit leaves."""
        if built.parent != self.models or any(k.resolve() == built.resolve() for k in keep):
            return
        for d in (built, built.with_name(built.name + ".staging")):
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)
                log.info("model store: removed %s (the update ended)", d.name)

    def remove_unused(self, keep: list[Path]) -> None:
        """Delete model directories and payloads nothing refers to any more."""
        keep_set = {p.resolve() for p in keep}
        if self.models.is_dir():
            for d in self.models.iterdir():
                if d.resolve() not in keep_set:
                    shutil.rmtree(d, ignore_errors=True)
                    log.info("model store: removed %s", d.name)
