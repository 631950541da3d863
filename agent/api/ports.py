"""Whether a loopback TCP address can be listened on, asked before the daemon loads anything.

Found only when the listener binds, a busy port would cost a whole model load (tens of seconds
on a board) and a bound unix socket first. `check` binds a probe socket the way
the servers bind theirs (SO_REUSEADDR: a connection in TIME_WAIT is no obstacle, a listener is)
and closes it at once. A port taken between this check and the real bind is still refused
there, with the same words.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

from agent.base.errors import HostError


def split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def check(addresses: Iterable[tuple[str, str | None]]) -> None:
    """(what, "HOST:PORT" or None) pairs: HostError naming the first that cannot be listened on,
    or the second that repeats an earlier one. Port 0 (any free port) always can."""
    seen: dict[tuple[str, int], str] = {}
    for what, hostport in addresses:
        if not hostport:
            continue
        host, port = split(hostport)
        if port and (host, port) in seen:
            raise HostError(f"{what} {hostport}: the same address as {seen[host, port]}")
        seen[host, port] = what
        if port:
            _probe(what, hostport, host, port)


def _probe(what: str, hostport: str, host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise HostError(f"{what} {hostport}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            why = (
                "the port is in use (another process listens on it)"
                if exc.errno == errno.EADDRINUSE
                else exc.strerror or str(exc)
            )
            raise HostError(f"cannot listen on {what} {hostport}: {why}") from None
