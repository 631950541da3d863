"""A typed Python client for the edge-agent daemon's gRPC API (docs/API.md, "Python client").

    from edge_agent_client import Client

    with Client("/run/edge-agent/agent.sock") as c:
        for chunk in c.generate("def f():", max_tokens=16):
            print(chunk.text, end="")

`Client` is synchronous, `AsyncClient` the same for asyncio; both return frozen dataclasses
(`edge_agent_client.types`) and raise `edge_agent_client.errors.EdgeAgentError` subclasses.
It needs only grpcio and protobuf. The .proto files are in ``edge_agent_client/proto/`` (see
`PROTO_DIR`), for other languages' stock ``protoc``.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from pathlib import Path

from edge_agent_client.aio import AsyncClient, AsyncGeneration
from edge_agent_client.client import Client, Generation
from edge_agent_client.errors import (
    Cancelled,
    ContextOverflow,
    DeadlineExceeded,
    EdgeAgentError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    Overloaded,
    SessionBusy,
    SessionLost,
    Unavailable,
)
from edge_agent_client.types import (
    Chunk,
    Completion,
    FinishReason,
    KVTiers,
    Message,
    ModelFigures,
    ModelInfo,
    NamedModel,
    Percentiles,
    ProbeFigures,
    SessionInfo,
    Stats,
    Status,
)

try:
    __version__ = _metadata.version("edge-agent-client")
except _metadata.PackageNotFoundError:  # run from a source tree, not installed
    __version__ = "0+unknown"

PROTO_DIR = Path(__file__).resolve().parent / "proto"  # edge_agent/v1/agent.proto, ...

__all__ = [
    "PROTO_DIR",
    "AsyncClient",
    "AsyncGeneration",
    "Cancelled",
    "Chunk",
    "Client",
    "Completion",
    "ContextOverflow",
    "DeadlineExceeded",
    "EdgeAgentError",
    "FailedPrecondition",
    "FinishReason",
    "Generation",
    "Internal",
    "InvalidArgument",
    "KVTiers",
    "Message",
    "ModelFigures",
    "ModelInfo",
    "NamedModel",
    "NotFound",
    "Overloaded",
    "Percentiles",
    "ProbeFigures",
    "SessionBusy",
    "SessionInfo",
    "SessionLost",
    "Stats",
    "Status",
    "Unavailable",
    "__version__",
]
