"""grpc.aio server on a unix socket: the Agent service (`agent.api.grpc.service`), grpc.health.v1
and reflection (v1 and v1alpha, `agent.api.grpc.reflection`). What may be removed at the socket's
path, before binding and after serving, is `agent.api.unixsocket`'s to decide.

Wire messages become domain values in `agent.api.grpc.convert` and never travel inward; domain
errors become gRPC status codes in `agent.api.grpc.service`. The engine runs on its own thread; its
events reach the stream through `agent.api.bridge`.
"""

from __future__ import annotations

import grp
import logging
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from agent.api import unixsocket
from agent.api.grpc import reflection
from agent.api.grpc.service import SERVICE, AgentService, Backend, handlers
from agent.base.errors import HostError
from agent.config.file import ServerConfig

log = logging.getLogger(__name__)


class Server:
    """The gRPC server: bind, serve, flip health, stop."""

    def __init__(self, backend: Backend, config: ServerConfig, max_tokens_limit: int) -> None:
        self._config = config
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # a connection that never completes its handshake, or idles, does not hold a
            # descriptor for ever (gRPC's defaults: 120 s, and never)
            ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000)),
            ("grpc.max_connection_idle_ms", int(config.idle_timeout_s * 1000)),
        ]
        self._server = grpc.aio.server(options=opts)
        self._server.add_generic_rpc_handlers((handlers(AgentService(backend, max_tokens_limit)),))
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable(
            self._server, (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        )
        self.addresses: list[str] = []
        self._bound: unixsocket.BoundSocket | None = None

    async def start(self) -> None:
        """Bind the unix socket (and TCP if configured), then start serving (NOT_SERVING).

        Refuses (HostError, AlreadyRunning) a socket path that is not a socket, a live socket
        or a missing parent directory, having changed nothing; see `agent.api.unixsocket`."""
        await self.set_serving(False)
        sock = self._config.socket
        group = self._config.socket_group
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise HostError(
                f"server.socket_group = {group!r}: no such group on this machine"
            ) from None
        with unixsocket.bind_guard(sock):
            old = os.umask(0o777 ^ self._config.socket_mode)
            try:
                self._server.add_insecure_port(f"unix:{sock}")
            except RuntimeError as exc:  # gRPC says only "Failed to bind"
                raise HostError(f"cannot bind the unix socket {sock}") from exc
            finally:
                os.umask(old)
            self._bound = unixsocket.bound(sock)
        self.addresses.append(f"unix:{sock}")
        if self._config.tcp:
            host = self._config.tcp.rpartition(":")[0]
            try:
                port = self._server.add_insecure_port(self._config.tcp)
            except RuntimeError as exc:
                unixsocket.remove_if_ours(self._bound)  # leave no socket behind
                self._bound = None
                raise HostError(
                    f"cannot listen on {self._config.tcp}: the port is in use or the address is "
                    "not one of this machine's"
                ) from exc
            self.addresses.append(f"{host}:{port}")
        await self._server.start()
        os.chmod(sock, self._config.socket_mode)
        if gid != -1:
            os.chown(sock, -1, gid)
        log.info("listening on %s", ", ".join(self.addresses))

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Stop serving; remove the socket only if it is still the one `start` bound."""
        await self.set_serving(False)
        await self._server.stop(grace)
        if self._bound is not None:
            unixsocket.remove_if_ours(self._bound)
            self._bound = None
