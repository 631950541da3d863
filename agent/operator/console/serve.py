"""Serve the console: parse where to listen, bind, run uvicorn until SIGINT/SIGTERM.

Where (`--listen HOST:PORT`, a literal IP, port 0 for any free one): a loopback address unless
the console has a key (`--console-key-file`), as the daemon keeps its TCP listeners on loopback
unless told otherwise; a page reachable from other machines without a key would show the fleet
to anyone on the network. The bound address and the address to open (with the key, as Jupyter
prints it) are printed on one line each, so that scripts and tests can read them.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
from collections.abc import Callable, Iterable
from typing import Final

import uvicorn

from agent.base.errors import AgentError
from agent.base.webguard import RequestGuard, Wording, allowed_hosts

log = logging.getLogger(__name__)

DEFAULT_LISTEN: Final = "127.0.0.1:8780"
MAX_CONNECTIONS: Final = 64
KEEP_ALIVE_S: Final = 5
MAX_HEADER_BYTES: Final = 16 << 10
WORDING: Final = Wording(
    who="this console",
    more_hosts="--allow-host adds names",
    more_origins="the console takes requests from its own pages only",
    logger="agent.operator.console",
)


class ListenError(AgentError):
    """A --listen value that does not parse or may not be used; the message says why."""


def parse_listen(value: str, has_key: bool) -> tuple[str, int]:
    """`HOST:PORT` → (host, port); non-loopback only with a key."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    allowed = "HOST:PORT with a literal IP address and a port 0-65535, e.g. 127.0.0.1:8780"
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ListenError(f"--listen {value!r}: {allowed}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ListenError(f"--listen {value!r}: {allowed}") from None
    if not ip.is_loopback and not has_key:
        raise ListenError(
            f"--listen {value!r}: a loopback address (127.0.0.0/8 or ::1) unless the console "
            "has a key: give --console-key-file to listen beyond this machine"
        )
    return host, int(port)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def guarded(app: object, sock: socket.socket, extra_hosts: Iterable[str]) -> RequestGuard:
    """`app` behind the Host/Origin guard of the HTTP API, for this socket's address."""
    host = sock.getsockname()[0]
    return RequestGuard(app, allowed_hosts([host], extra_hosts), frozenset(), WORDING)


def serve(app: object, sock: socket.socket, on_started: Callable[[], None]) -> None:
    """Run until SIGINT or SIGTERM; `on_started` once it accepts. uvicorn stops gracefully on
    either, then raises the signal again for the handler it found: SIGTERM's here is a no-op
    (a clean stop, exit 0), SIGINT's the CLI's (KeyboardInterrupt: exit 130, as every
    command)."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        lifespan="off",
        log_level="warning",
        access_log=False,
        limit_concurrency=MAX_CONNECTIONS,
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        server_header=False,
    )
    server = uvicorn.Server(config)
    original = server.startup

    async def startup(sockets: list[socket.socket] | None = None) -> None:
        await original(sockets=sockets)
        on_started()

    server.startup = startup  # type: ignore[method-assign]
    previous = signal.signal(signal.SIGTERM, lambda _s, _f: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
