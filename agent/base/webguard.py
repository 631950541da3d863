"""Who may drive a loopback HTTP listener from a browser: a Host allow-list and an Origin
check. The daemon's HTTP API (`agent.api.http.server`) and the operator's web console
(`agent.operator.console`) apply the same rules; the messages name each one's own settings.

A web page can make the browser send requests to a loopback TCP port, directly (a form or
`fetch` to http://127.0.0.1:PORT) or through DNS rebinding (its own name resolving to
127.0.0.1, so that the browser's same-origin rule no longer stands in the way). Two checks,
before routing, refuse both with a 403:

* Host (TCP only): the request's host name must be a loopback name (localhost, 127.0.0.1,
  ::1), the listen address's own host, or one configured in `http.allowed_hosts`. A rebinding
  page's requests carry its own name. A request without Host (HTTP/1.0) passes: browsers
  always send one. On the unix socket, which no browser reaches, any Host or none passes.
* Origin: browsers send it on every cross-site POST; when present it must be this daemon's own
  origin (http://<allowed host>:<the port of this listener>; on the unix socket, any port) or
  one listed in `http.allowed_origins`. "null" (sandboxed frames, file: pages) is refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

LOOPBACK_HOSTS: Final = frozenset({"localhost", "127.0.0.1", "::1"})

Scope = dict[str, Any]


def host_name(value: str) -> str:
    """The host part of a Host header, lower case, without port or IPv6 brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def allowed_hosts(listen_hosts: Iterable[str], extra: Iterable[str]) -> frozenset[str]:
    return LOOPBACK_HOSTS | {host_name(h) for h in (*listen_hosts, *extra)}


@dataclass(frozen=True, slots=True)
class Wording:
    """How the refusals name the listener and the settings that widen it."""

    who: str = "this agent"
    more_hosts: str = "http.allowed_hosts adds names"
    more_origins: str = "http.allowed_origins adds origins"
    logger: str = "agent.api.http"


class RequestGuard:
    """ASGI middleware: the Host and Origin checks, then `app`."""

    def __init__(
        self,
        app: Any,
        hosts: frozenset[str],
        origins: frozenset[str],
        wording: Wording = Wording(),
    ) -> None:
        self._app = app
        self._hosts = hosts
        self._origins = frozenset(o.rstrip("/").lower() for o in origins)
        self._words = wording
        self._log = logging.getLogger(wording.logger)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                self._log.info("http %s %s refused: %s", scope["method"], scope["path"], refusal)
                await _send_403(send, refusal)
                return
        await self._app(scope, receive, send)

    def refusal(self, scope: Scope) -> str | None:
        """Why this request may not be served (None: it may)."""
        w = self._words
        server = scope.get("server")
        port = server[1] if server else None  # None: the unix socket
        host = origin = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
        if port is not None and host is not None and host_name(host) not in self._hosts:
            return (
                f"Host {host!r} is not one {w.who} answers to (allowed: "
                f"{', '.join(sorted(self._hosts))}; {w.more_hosts})"
            )
        if origin is not None and not self._own_origin(origin, port):
            return (
                f"Origin {origin!r} is not {w.who}'s own (cross-site requests are refused; "
                f"{w.more_origins})"
            )
        return None

    def _own_origin(self, origin: str, port: int | None) -> bool:
        origin = origin.strip().lower()
        if origin in self._origins:
            return True
        try:
            parts = urlsplit(origin)
            origin_port = parts.port
        except ValueError:
            return False
        if parts.scheme != "http" or parts.hostname is None:
            return False
        if parts.hostname not in self._hosts:
            return False
        return port is None or (origin_port or 80) == port


async def _send_403(send: Any, message: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "forbidden",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
