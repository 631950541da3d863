"""Topic names of the fleet link (which message each carries: `agent.fleet.codec.TOPIC_TYPES`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from agent.config.fleet import check_device_id as check_device_id
from agent.config.fleet import is_device_id

DEFAULT_PREFIX: Final = "fleet/v1"
COMMAND_RE: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")
KINDS: Final = ("state", "health", "event", "cmd", "resp", "update")
UPDATE_TOPICS: Final = ("status", "block", "data")


@dataclass(frozen=True, slots=True)
class Topics:
    """The topics of one device under `prefix`."""

    prefix: str
    device: str

    @property
    def base(self) -> str:
        return f"{self.prefix}/{self.device}"

    @property
    def state(self) -> str:
        return f"{self.base}/state"

    @property
    def health(self) -> str:
        return f"{self.base}/health"

    @property
    def event(self) -> str:
        return f"{self.base}/event"

    @property
    def commands(self) -> str:
        """The filter the device subscribes to."""
        return f"{self.base}/cmd/+"

    def command(self, name: str) -> str:
        return f"{self.base}/cmd/{name}"

    @property
    def update_status(self) -> str:
        """Update state machine reports (Event with an UpdateStatus)."""
        return f"{self.base}/update/status"

    @property
    def block_request(self) -> str:
        """The device asks for a payload block (BlockRequest) when an update comes over MQTT."""
        return f"{self.base}/update/block"

    @property
    def block_data(self) -> str:
        """Where the block server answers (Block)."""
        return f"{self.base}/update/data"

    def response(self, requester: str) -> str:
        """Where `requester` wants answers: under the device's own prefix, so that a broker
        ACL of `pattern readwrite <prefix>/%u/#` lets the device publish it."""
        return f"{self.base}/resp/{requester}"


@dataclass(frozen=True, slots=True)
class Parsed:
    device: str
    kind: str  # one of KINDS
    name: str  # the command name or requester for cmd/resp, else ""


def parse(prefix: str, topic: str) -> Parsed | None:
    """Split a topic under `prefix`; None for anything that is not a fleet topic."""
    if not topic.startswith(prefix + "/"):
        return None
    parts = topic[len(prefix) + 1 :].split("/")
    if len(parts) < 2 or parts[1] not in KINDS or not is_device_id(parts[0]):
        return None
    if parts[1] in ("cmd", "resp"):
        return Parsed(parts[0], parts[1], parts[2]) if len(parts) == 3 else None
    if parts[1] == "update":
        ok = len(parts) == 3 and parts[2] in UPDATE_TOPICS
        return Parsed(parts[0], parts[1], parts[2]) if ok else None
    return Parsed(parts[0], parts[1], "") if len(parts) == 2 else None
