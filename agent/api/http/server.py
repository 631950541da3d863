"""The HTTP server: uvicorn (its pure-Python h11 protocol) on the daemon's own event loop, on
sockets bound here: a unix socket beside the gRPC one, with the same mode and group and the
same rules for what may be removed at its path (`agent.api.unixsocket`), and loopback TCP when
configured. No second process, no thread per request, no signal handlers of its own (the
daemon's stay in charge): `start` binds and serves, `stop` closes.

Bounds (docs/API.md "Limits"): a connection limit and header/body/keep-alive deadlines
(`agent.api.http.connections`), Host and Origin checks (`agent.base.webguard`), a JSON content type
and nesting depth (`agent.api.http.body`).

Why uvicorn + starlette and not aiohttp: docs/PERFORMANCE.md "HTTP stack".
"""

from __future__ import annotations

import grp
import logging
import os
import socket
from pathlib import Path
from typing import Final

import uvicorn
from prometheus_client.registry import Collector

from agent.api import unixsocket
from agent.api.http import connections
from agent.api.http.ollama import Ollama
from agent.api.http.openai import Api, Backend, Counter
from agent.base.errors import HostError
from agent.base.keyfile import read_key
from agent.base.webguard import RequestGuard, allowed_hosts
from agent.config.file import AgentConfig, http_socket

log = logging.getLogger("agent.api.http")

BACKLOG: Final = connections.BACKLOG


class HttpServer:
    """The OpenAI-compatible API: bind, serve, stop."""

    def __init__(
        self,
        backend: Backend,
        config: AgentConfig,
        max_tokens_limit: int,
        metrics: Counter | None = None,
    ) -> None:
        self._config = config
        self._backend = backend
        self._max_tokens = max_tokens_limit
        self._metrics = metrics
        self.addresses: list[str] = []
        self._sockets: list[socket.socket] = []
        self._bound: unixsocket.BoundSocket | None = None
        self._server: uvicorn.Server | None = None
        self._collector: Collector | None = None

    @property
    def socket_path(self) -> Path:
        return http_socket(self._config)

    async def start(self) -> None:
        """Bind the unix socket (and TCP if configured) and serve. Refuses (HostError,
        AlreadyRunning) what `agent.api.unixsocket` refuses, having changed nothing."""
        cfg = self._config
        key = read_key(cfg.http.key_file) if cfg.http.key_file is not None else None
        api = Api(self._backend, self._max_tokens, key, self._metrics)
        listeners = 2 if cfg.http.tcp else 1
        limit = connections.fit_to_fd_limit(cfg.http.max_connections, listeners)
        stats = connections.ConnectionStats(limit)
        protocol = connections.protocol_class(
            connections.ConnectionLimits(limit, cfg.http.header_timeout_s, cfg.http.body_timeout_s),
            stats,
        )
        listen = [cfg.http.tcp.rpartition(":")[0]] if cfg.http.tcp else []
        starlette = api.app()
        starlette.router.routes.extend(Ollama(api).routes())  # Ollama's API beside it
        app = RequestGuard(
            starlette,
            allowed_hosts(listen, cfg.http.allowed_hosts),
            frozenset(cfg.http.allowed_origins),
        )
        try:
            self._bind_unix()
            if cfg.http.tcp:
                self._bind_tcp(cfg.http.tcp)
            if self._metrics is not None:
                self._collector = connections.stats_collector(stats)
                self._metrics.registry.register(self._collector)
            config = uvicorn.Config(
                app,
                # uvicorn's pure-Python h11 protocol (httptools has no armv7l wheel), bounded
                http=protocol,
                ws="none",
                lifespan="off",
                log_config=None,  # the daemon's logging stays as it is
                access_log=False,
                server_header=False,
                date_header=False,
                proxy_headers=False,
                timeout_keep_alive=cfg.http.keep_alive_s,
                timeout_graceful_shutdown=2,
                backlog=BACKLOG,
            )
            config.load()
            server = uvicorn.Server(config)
            # what Server.serve() would do, without its signal handlers and its main loop
            server.lifespan = config.lifespan_class(config)
            await server.startup(sockets=self._sockets)
            self._server = server
        except BaseException:
            await self.stop()
            raise
        log.info(
            "http: OpenAI-compatible API on %s%s (at most %d connections; head %gs, body %gs, "
            "keep-alive %ds)",
            ", ".join(self.addresses),
            " (bearer key required)" if key else "",
            limit,
            cfg.http.header_timeout_s,
            cfg.http.body_timeout_s,
            cfg.http.keep_alive_s,
        )

    def _bind_unix(self) -> None:
        path = self.socket_path
        server = self._config.server
        try:
            gid = grp.getgrnam(server.socket_group).gr_gid if server.socket_group else -1
        except KeyError:
            raise HostError(
                f"server.socket_group = {server.socket_group!r}: no such group on this machine"
            ) from None
        with unixsocket.bind_guard(path):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            old = os.umask(0o777 ^ server.socket_mode)
            try:
                sock.bind(os.fsencode(path))
            except OSError as exc:
                sock.close()
                raise HostError(f"cannot bind the unix socket {path}: {exc.strerror}") from exc
            finally:
                os.umask(old)
            self._bound = unixsocket.bound(path)
        self._sockets.append(sock)
        sock.listen(BACKLOG)
        os.chmod(path, server.socket_mode)
        if gid != -1:
            os.chown(path, -1, gid)
        self.addresses.append(f"unix:{path}")

    def _bind_tcp(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError as exc:
            sock.close()
            raise HostError(
                f"cannot listen on {address}: the port is in use or the address is not one of "
                f"this machine's ({exc.strerror})"
            ) from exc
        sock.listen(BACKLOG)
        self._sockets.append(sock)
        bound = sock.getsockname()[1]
        self.addresses.append(
            f"[{host}]:{bound}" if family == socket.AF_INET6 else f"{host}:{bound}"
        )

    async def stop(self) -> None:
        """Stop accepting, let open responses end (2 s at most), close; remove the socket only
        if it is still the one `start` bound."""
        server, self._server = self._server, None
        if server is not None:
            await server.shutdown()
        collector, self._collector = self._collector, None
        if collector is not None and self._metrics is not None:
            self._metrics.registry.unregister(collector)
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        if self._bound is not None:
            unixsocket.remove_if_ours(self._bound)
            self._bound = None
