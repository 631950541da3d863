"""The status's parts as protobuf: what `GetStatus` (gRPC) and health (MQTT) both carry."""

from __future__ import annotations

import dataclasses
import math

from agent.engine.types import TierStats
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.status.value import ModelState


def tiers_message(t: TierStats) -> pb.KVTiers:
    """Domain → wire: the fields have the same names on both sides."""
    return pb.KVTiers(**{f.name: getattr(t, f.name) for f in dataclasses.fields(t)})


def named_model_message(m: ModelState) -> pb.NamedModel:
    """Domain → wire: one of the daemon's named models (`keep_alive_s` forever is -1)."""
    return pb.NamedModel(
        name=m.name,
        version=m.version,
        quantization=m.quantization,
        context_length=m.context_length,
        default=m.default,
        loaded=m.loaded,
        pinned=m.pinned,
        keep_alive_s=-1.0 if math.isinf(m.keep_alive_s) else m.keep_alive_s,
        planned_bytes=m.planned_bytes,
        estimate_bytes=m.estimate_bytes,
        loads=m.loads,
        unloads=m.unloads,
        evictions=m.evictions,
        last_load_s=m.last_load_s,
        active=m.active,
    )
