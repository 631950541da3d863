"""The status's parts as protobuf: what `GetStatus` (gRPC) and health (MQTT) both carry."""

from __future__ import annotations

import dataclasses

from agent.engine.types import TierStats
from agent.pb.edge_agent.v1 import agent_pb2 as pb


def tiers_message(t: TierStats) -> pb.KVTiers:
    """Domain → wire: the fields have the same names on both sides."""
    return pb.KVTiers(**{f.name: getattr(t, f.name) for f in dataclasses.fields(t)})
