"""A client that stops reading cannot hold a running slot, and so every other client, forever:
after `limits.consumer_stall_s` with nothing read, its paused request is cancelled and the slot
goes to the next one. A real daemon with one slot, a gRPC client whose HTTP/2 window is one
byte (it reads one message, then nothing), and a second client whose request waits for the
slot; the demo model without a stop token, so the held request could never end by itself."""

from __future__ import annotations

from pathlib import Path

import grpc

from agent.api.grpc.client import build_request
from agent.pb.edge_agent.v1 import agent_pb2_grpc as pb_grpc
from tests.support.daemon_harness import Daemon
from tests.support.endless import endless_model_dir
from tests.system.test_drain import ONE_BYTE_WINDOW

CONFIG = (
    "[limits]\nmax_active = 1\nmax_pending_events = 2\nconsumer_stall_s = 1\nmax_tokens = 1000\n"
)


def _request(max_tokens: int):  # type: ignore[no-untyped-def]
    r = build_request(
        "def f(x):", None, max_tokens=max_tokens, temperature=0.0, top_k=None, top_p=None,
        seed=None, stop=[],
    )  # fmt: skip
    r.speculation = "off"
    return r


def test_a_client_that_stops_reading_loses_its_slot(tmp_path: Path) -> None:
    d = Daemon(tmp_path, endless_model_dir(tmp_path / "model"), CONFIG)
    slow = grpc.insecure_channel(f"unix:{d.socket}", options=ONE_BYTE_WINDOW)
    try:
        held = pb_grpc.AgentStub(slow).Generate(_request(1000), timeout=300)  # type: ignore[no-untyped-call]
        next(held)  # it runs (the only slot), then its client reads nothing more
        c = d.client(timeout=300)
        try:
            other = c.generate(_request(8))  # waits for the slot; a limit, not a timing
            assert other.finish_reason == "length" and len(other.tokens) == 8
        finally:
            c.close()
        d.wait_log("read nothing for 1 s; cancelled")
    finally:
        slow.close()
        assert d.stop() == 0, d.read_log()
