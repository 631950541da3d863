"""The gRPC listener closes what would hold a descriptor for ever: a connection that never
completes its HTTP/2 handshake (slowloris on the unix socket) after
`server.handshake_timeout_s`, and one with no call after `server.idle_timeout_s` — gRPC's own
defaults are 120 s and never. A real daemon, raw sockets, and a real client served meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.support.daemon_harness import Daemon

CONFIG = "[server]\nhandshake_timeout_s = 1\nidle_timeout_s = 2\n"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # HTTP/2's client connection preface
EMPTY_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # a SETTINGS frame with no settings


def closed_by_peer(s: socket.socket, limit_s: float = 60.0) -> bool:
    """Whether the daemon closes `s` (reads EOF) within `limit_s`: a limit, not a timing, and
    under gRPC's own 120 s handshake default, so that default alone would fail it."""
    s.settimeout(limit_s)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    return s


def test_silent_and_idle_grpc_connections_are_closed(tmp_path: Path, tiny_model_dir: Path) -> None:
    d = Daemon(tmp_path, tiny_model_dir, CONFIG)
    held: list[socket.socket] = []
    try:
        held += [connect(d.socket) for _ in range(20)]  # connected, never a byte of HTTP/2
        c = d.client()
        try:
            assert c.health() == "SERVING"  # served while they hang on
        finally:
            c.close()
        assert all(closed_by_peer(s) for s in held)
        # a client that completed its handshake and then idles: closed after idle_timeout_s
        idle = connect(d.socket)
        held.append(idle)
        idle.sendall(PREFACE + EMPTY_SETTINGS)
        assert closed_by_peer(idle)
    finally:
        for s in held:
            s.close()
        assert d.stop() == 0, d.read_log()
