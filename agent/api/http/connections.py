"""Bounds on the HTTP listener's connections: what uvicorn's h11 protocol lacks.

uvicorn (0.55) closes a connection only after a keep-alive timeout that starts once a response
is complete; a connection that never sends a whole request is held forever, and its
`limit_concurrency` answers 503 only after a request's headers arrive, so idle sockets still
use up file descriptors. `protocol_class` gives uvicorn a subclass of its `H11Protocol` with:

* a connection limit checked when a connection is accepted. At the limit, the connection that
  has waited longest without a complete request (an idle keep-alive one, or one trickling its
  headers or body) is closed to make room, as nginx drains idle connections; only when every
  connection has a request being served is the new one refused (503 and close). So slow
  clients cannot lock out a prompt one such as a health check.
* a header deadline (the whole request head within `header_timeout_s` of the first byte, or of
  the connection) and a body deadline (the whole body within `body_timeout_s` of the head):
  past them a 408 and close. h11 already bounds the head's size (16 KiB: a 400).

Each drop is counted by reason (`ConnectionStats`, exported as metrics by
`stats_collector`) and logged, at most once per `LOG_EVERY_S` per reason with a count.
`fit_to_fd_limit` checks the limit against RLIMIT_NOFILE at start, so that accepted HTTP
connections can never take the descriptors gRPC and the engine need.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import h11
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from uvicorn.protocols.http.h11_impl import H11Protocol

from agent.base.errors import HostError

log = logging.getLogger("agent.api.http")

REASONS: Final = ("refused", "evicted", "header_timeout", "body_timeout")
LOG_EVERY_S: Final = 10.0
# Descriptors kept free beside the HTTP connections and what was open at start: gRPC's
# connections and the files opened while serving (session spill, a model reload, /proc reads).
FD_RESERVE: Final = 64
MIN_CONNECTIONS: Final = 4
# Each listener's kernel queue of pending connections, and how many of them asyncio accepts in
# one go before any protocol runs (so before an eviction can close one): descriptors that are
# briefly open beyond the connection limit.
BACKLOG: Final = 64


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


class ConnectionStats:
    """Open connections and drops by reason (event loop only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.dropped = dict.fromkeys(REASONS, 0)
        self._unlogged = dict.fromkeys(REASONS, 0)
        self._logged_at = dict.fromkeys(REASONS, -LOG_EVERY_S)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        self._unlogged[reason] += 1
        now = time.monotonic()
        if now - self._logged_at[reason] >= LOG_EVERY_S:
            log.warning(
                "http: connection %s (%d since the last report; limit %d, open %d)",
                reason.replace("_", " "),
                self._unlogged[reason],
                self.limit,
                self.open,
            )
            self._logged_at[reason] = now
            self._unlogged[reason] = 0


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole response written past h11 (the request may not have been read): JSON in
    OpenAI's error shape, then the connection closes."""
    body = json.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


_WAITING: Final = (h11.IDLE, h11.SEND_BODY)  # their side: no whole request in hand yet


class _Bounded(H11Protocol):
    limits: ConnectionLimits
    stats: ConnectionStats

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""  # "header" | "body" while a deadline runs
        self._waiting_since = time.monotonic()
        self._counted = False
        self._heard = False  # bytes of the current request have arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            victim = _longest_waiting(self.connections)
            if victim is None:
                self.transport = transport
                self.stats.drop("refused")
                transport.write(
                    _raw_response(
                        503,
                        "Service Unavailable",
                        f"too many connections (at most {self.limits.max_connections})",
                    )
                )
                transport.close()
                return
            victim.drop("evicted", 503, "Service Unavailable", "closed for a new connection")
        super().connection_made(transport)
        self._counted = True
        self.stats.open += 1
        self._arm("header", self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._counted:  # refused in connection_made
            return
        self._counted = False
        self.stats.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._counted and self.conn.their_state is h11.IDLE and self._deadline is None:
            self._arm("header", self.limits.header_timeout_s)  # a keep-alive's next request
        self._heard = True
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._waiting_since = time.monotonic()
        self._heard = False
        if self.conn.their_state is not h11.IDLE:  # a pipelined request went on
            self._track()

    # ------------------------------------------------------------------

    def waiting_since(self) -> float | None:
        """When it began to wait for a request, if it has none in hand (else None)."""
        if self.transport is None or self.transport.is_closing():
            return None
        return self._waiting_since if self.conn.their_state in _WAITING else None

    def drop(self, reason: str, status: int, phrase: str, message: str) -> None:
        self._disarm()
        self.stats.drop(reason)
        self.connections.discard(self)
        if not self.transport.is_closing():
            # an answer only to a request begun and not yet answered (SEND_RESPONSE: nothing of
            # ours sent yet); an idle connection just closes
            if self._heard and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                self.transport.write(_raw_response(status, phrase, message))
            self.transport.close()

    def _track(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body", self.limits.body_timeout_s)
        elif state is not h11.IDLE:
            self._disarm()  # the whole request is in: no deadline while it is served

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = ""

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline = None
        what = "the request head" if phase == "header" else "the request body"
        message = f"{what} did not arrive within {seconds:g} s"
        self.drop(f"{phase}_timeout", 408, "Request Timeout", message)


def _longest_waiting(connections: set[Any]) -> _Bounded | None:
    best: _Bounded | None = None
    best_since = 0.0
    for c in connections:
        since = c.waiting_since() if isinstance(c, _Bounded) else None
        if since is not None and (best is None or since < best_since):
            best, best_since = c, since
    return best


def protocol_class(limits: ConnectionLimits, stats: ConnectionStats) -> type[asyncio.Protocol]:
    """uvicorn's `http=`: its h11 protocol with these limits, reporting to `stats`."""
    return type("BoundedH11Protocol", (_Bounded,), {"limits": limits, "stats": stats})


def open_fds() -> int:
    """Descriptors this process has open (0 where there is no /proc to count them in)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def fd_headroom(listeners: int) -> int:
    """Descriptors kept free beside the HTTP connections: gRPC and files, and each listener's
    accept burst."""
    return FD_RESERVE + listeners * BACKLOG


def fit_to_fd_limit(configured: int, listeners: int) -> int:
    """The connection limit that leaves `fd_headroom` descriptors free under RLIMIT_NOFILE:
    the configured one, or less (a warning); fewer than `MIN_CONNECTIONS` is a HostError."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    in_use = open_fds()
    headroom = fd_headroom(listeners)
    room = soft - in_use - headroom
    if room >= configured:
        return configured
    if room < MIN_CONNECTIONS:
        raise HostError(
            f"the open-file limit (RLIMIT_NOFILE {soft}) leaves room for {max(room, 0)} HTTP "
            f"connections ({in_use} descriptors open, {headroom} kept for gRPC, files and "
            "accepting); "
            f"raise LimitNOFILE= in the unit, or turn the HTTP API off"
        )
    log.warning(
        "http: connection limit %d lowered to %d: RLIMIT_NOFILE is %d, %d descriptors are open "
        "and %d are kept for gRPC, files and accepting (raise LimitNOFILE= in the unit)",
        configured,
        room,
        soft,
        in_use,
        headroom,
    )
    return room


def stats_collector(stats: ConnectionStats) -> Collector:
    """A prometheus_client collector of `stats` (read at scrape time)."""

    class _Collector(Collector):
        def collect(self) -> Iterator[Metric]:
            dropped = CounterMetricFamily(
                "edge_agent_http_connections_dropped",
                "HTTP connections refused at the limit, evicted for a new one, or closed at "
                "a header/body deadline",
                labels=("reason",),
            )
            for reason in REASONS:
                dropped.add_metric((reason,), stats.dropped[reason])
            yield dropped
            yield GaugeMetricFamily(
                "edge_agent_http_connections", "Open HTTP connections", value=stats.open
            )
            yield GaugeMetricFamily(
                "edge_agent_http_connection_limit",
                "The HTTP connection limit in force (after the RLIMIT_NOFILE check)",
                value=stats.limit,
            )

    return _Collector()
