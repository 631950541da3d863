"""The agent's own configuration (`/etc/edge-agent/agent.toml`): what is not board-specific.

Board-specific settings live in device profiles; this file holds the socket, the optional TCP
listener, limits, the model directory, logging and whether clients share sessions. Parsing is
pure (`parse_config`); `load_config` does the I/O; command-line flags are applied on top with
`dataclasses.replace`. A missing default file means defaults; a missing file named explicitly is
an error.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.base.clock import SOURCES as CLOCK_SOURCES
from agent.base.errors import ConfigError
from agent.base.tomltable import Table
from agent.config.fleet import BROKER_FORMAT as BROKER_FORMAT
from agent.config.fleet import DEVICE_ID_RE as DEVICE_ID_RE
from agent.config.fleet import FLEET, parse_fleet
from agent.config.fleet import GROUP_RE as GROUP_RE
from agent.config.fleet import MQTT_PROTOCOLS as MQTT_PROTOCOLS
from agent.config.fleet import Broker as Broker
from agent.config.fleet import FleetConfig as FleetConfig
from agent.config.fleet import parse_broker as parse_broker
from agent.config.models import ModelsConfig, parse_models
from agent.config.probe import PROBE, ProbeConfig, parse_probe
from agent.config.window import SWITCH_KEYS, SwitchConfig, parse_switch

DEFAULT_PATH = Path("/etc/edge-agent/agent.toml")
DEFAULT_SOCKET = Path("/run/edge-agent/agent.sock")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_TARGETS = ("auto", "journald", "stderr")

TOP = (
    "server",
    "limits",
    "model",
    "log",
    "watchdog",
    "sessions",
    "fleet",
    "updates",
    "http",
    "quotas",
    "probe",
    "models",
)
SERVER = (
    "socket",
    "socket_mode",
    "socket_group",
    "tcp",
    "allow_remote_tcp",
    "max_message_bytes",
    "stream_interval_ms",
    "handshake_timeout_s",
    "idle_timeout_s",
)
LIMITS = (
    "max_sessions",
    "max_active",
    "queue_capacity",
    "max_pending_events",
    "consumer_stall_s",
    "drain_timeout_s",
    "reload_drain_s",
    "max_tokens",
)
MODEL = ("path", "quantization")
LOG = ("level", "target")
WATCHDOG = ("engine_stall_s", "tick_s")
SESSIONS = ("share",)
QUOTAS = ("sessions_per_client", "session_bytes_per_client", "waiting_per_client")
UPDATES = (
    "trusted_keys_dir",
    "trial_s",
    "max_trial_restarts",
    "max_payload_bytes",
    "progress_interval_s",
    "retry_s",
    "max_download_attempts",
    "min_free_bytes",
    "clock",
    "timesync_file",
    *SWITCH_KEYS,
)
HTTP = (
    "listen",
    "key_file",
    "max_connections",
    "header_timeout_s",
    "body_timeout_s",
    "keep_alive_s",
    "allowed_hosts",
    "allowed_origins",
)
HTTP_LISTEN = (
    '"off", an absolute unix socket path, or HOST:PORT (loopback TCP, beside the default unix '
    'socket), e.g. "/run/edge-agent/http.sock" or "127.0.0.1:8080"'
)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket: Path = DEFAULT_SOCKET
    socket_mode: int = 0o660
    socket_group: str | None = None
    tcp: str | None = None  # "HOST:PORT"; loopback only unless allow_remote_tcp
    allow_remote_tcp: bool = False
    max_message_bytes: int = 1 << 20
    stream_interval_ms: int = 50  # a stream's messages at most this often (first and last: at once)
    # a connection that has not finished its HTTP/2 handshake by then is closed (slowloris)
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0  # a connection with no call for this long is closed


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_active: int = 4
    queue_capacity: int = 16
    max_pending_events: int = 64
    # a paused stream whose client read nothing for this long is cancelled (frees its slot)
    consumer_stall_s: float = 60.0
    # SIGTERM: running requests may go on this long, then are cut (CANCELLED, their tokens so
    # far); waiting ones are refused at once
    drain_timeout_s: float = 5.0
    # a reload or update switching models: the old engine's in-flight requests may finish
    # this long (new ones already go to the new engine)
    reload_drain_s: float = 20.0
    max_tokens: int = 4096  # upper bound on any request's max_tokens
    max_sessions: int = 8  # live conversations; beyond, fair eviction (agent.kv.quota)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: Path | None = None
    quantization: str | None = None


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "info"
    target: str = "auto"


@dataclass(frozen=True, slots=True)
class WatchdogConfig:
    engine_stall_s: float = 10.0  # engine heartbeat older than this stops WATCHDOG=1
    tick_s: float = 1.0  # main loop tick (status, watchdog)


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    # true: every client sees, continues and deletes every session (one shared namespace);
    # false: a session answers only to the client key that created it (docs/API.md)
    share: bool = False


@dataclass(frozen=True, slots=True)
class QuotasConfig:
    """What one client key may hold (docs/CONFIG.md "[quotas]"); None: half of the shared
    bound (limits.max_sessions, the profile's host + disk tier bytes, limits.queue_capacity),
    or all of it when sessions are shared (one namespace: one client)."""

    sessions_per_client: int | None = None
    session_bytes_per_client: int | None = None
    waiting_per_client: int | None = None


@dataclass(frozen=True, slots=True)
class UpdatesConfig:
    """Signed model updates (docs/UPDATES.md); they arrive through the fleet link."""

    trusted_keys_dir: Path = Path("/etc/edge-agent/keys")  # *.pub: the keys updates must carry
    trial_s: float = 300.0  # a new model must stay healthy this long before it is committed
    max_trial_restarts: int = 3  # restarts during the trial that mean a crash loop: roll back
    max_payload_bytes: int = 4 << 30  # refuse manifests declaring more
    progress_interval_s: float = 5.0  # download progress reports, at most this often
    retry_s: float = 30.0  # between download attempts
    max_download_attempts: int = 20  # in a row without progress: then the update is given up
    # kept free on the state directory's filesystem: an offer that would leave less is refused
    # (`no_space`), and health flags and logs free space below it
    min_free_bytes: int = 64 << 20
    # when the wall clock counts as synchronized (agent.base.clock.SOURCES): "auto" = timesyncd's
    # file or the kernel's NTP status; "trusted" = always (an RTC set by other means)
    clock: str = "auto"
    timesync_file: Path = Path("/run/systemd/timesync/synchronized")
    # when to switch, the download's cap (window.py)
    switch: SwitchConfig = field(default_factory=SwitchConfig)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The OpenAI-compatible HTTP API (docs/API.md). `socket` None: beside the gRPC socket
    (`http_socket`), with its mode and group; `tcp` is in addition to the unix socket."""

    enabled: bool = True
    socket: Path | None = None
    tcp: str | None = None  # "HOST:PORT"; loopback only unless server.allow_remote_tcp
    key_file: Path | None = None  # then every request needs "Authorization: Bearer <key>"
    # the listener's bounds (agent.api.http.connections; docs/CONFIG.md "[http]")
    max_connections: int = 64  # both listeners together; lowered at start to fit RLIMIT_NOFILE
    header_timeout_s: float = 10.0  # a request's head, from its first byte (or the connection)
    body_timeout_s: float = 30.0  # a request's body, from its head
    keep_alive_s: int = 5  # an idle connection between requests (whole seconds: uvicorn's)
    # beyond loopback names and the listen address: Host names and Origins a browser may use
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()


def http_socket(config: AgentConfig) -> Path:
    """Where the HTTP API's unix socket is: configured, or beside the gRPC one
    (/run/edge-agent/agent.sock → /run/edge-agent/agent-http.sock)."""
    sock = config.server.socket
    return config.http.socket or sock.with_name(f"{sock.stem}-http.sock")


def parse_http_listen(
    source: str, key: str, value: str, allow_remote: bool, base: HttpConfig
) -> HttpConfig:
    """`[http] listen` / `--http`: "off", a unix socket path, or HOST:PORT."""
    if value == "off":
        return replace(base, enabled=False, socket=None, tcp=None)
    if value.startswith("/"):
        return replace(base, enabled=True, socket=Path(value), tcp=None)
    if not value or ":" not in value:
        raise ConfigError(source, key, value, HTTP_LISTEN)
    tcp = check_tcp(source, key, value, allow_remote)
    return replace(base, enabled=True, socket=None, tcp=tcp)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    source: str = "<defaults>"
    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    model: ModelConfig = ModelConfig()
    log: LogConfig = LogConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    sessions: SessionsConfig = SessionsConfig()
    fleet: FleetConfig = FleetConfig()
    updates: UpdatesConfig = UpdatesConfig()
    http: HttpConfig = HttpConfig()
    quotas: QuotasConfig = QuotasConfig()
    probe: ProbeConfig = ProbeConfig()
    models: ModelsConfig = field(default_factory=ModelsConfig)  # [models] (config/models.py)


def check_tcp(source: str, key: str, value: str, allow_remote: bool) -> str:
    """`HOST:PORT` with a literal IP; non-loopback hosts only when explicitly allowed. Port 0
    asks for an ephemeral port: the daemon logs the one it bound and says it in its status."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    allowed = (
        "HOST:PORT with a literal IP address and a port 0-65535 (0: any free port), e.g. "
        "127.0.0.1:50051 or [::1]:50051"
    )
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(source, key, value, allowed)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError as exc:
        raise ConfigError(source, key, value, allowed) from exc
    if not ip.is_loopback and not allow_remote:
        raise ConfigError(
            source,
            key,
            value,
            "a loopback address (127.0.0.0/8 or ::1); set server.allow_remote_tcp = true to "
            "listen beyond this machine",
        )
    return value


def parse_config(data: Mapping[str, object], source: str) -> AgentConfig:
    """Validate a parsed TOML document into an AgentConfig."""
    top = Table(data, source, "", TOP)
    d = AgentConfig()
    s = top.table("server", SERVER, required=False)
    server = d.server
    if s is not None:
        mode_text = s.raw.get("socket_mode", "0660")
        if not isinstance(mode_text, str) or not _is_mode(mode_text):
            raise s.error("socket_mode", mode_text, 'an octal string such as "0660"')
        allow = s.flag("allow_remote_tcp", default=False)
        tcp = s.optional_text("tcp")
        server = ServerConfig(
            socket=s.absolute_path("socket") or d.server.socket,
            socket_mode=int(mode_text, 8),
            socket_group=s.optional_text("socket_group"),
            tcp=check_tcp(source, "server.tcp", tcp, allow) if tcp else None,
            allow_remote_tcp=allow,
            max_message_bytes=s.size(
                "max_message_bytes", 4096, 64 << 20, d.server.max_message_bytes
            ),
            stream_interval_ms=s.integer(
                "stream_interval_ms", 0, 1000, d.server.stream_interval_ms
            ),
            handshake_timeout_s=s.number(
                "handshake_timeout_s", 0.1, 600, default=d.server.handshake_timeout_s
            ),
            idle_timeout_s=s.number("idle_timeout_s", 1, 86400, default=d.server.idle_timeout_s),
        )
    lt = top.table("limits", LIMITS, required=False)
    limits = d.limits
    if lt is not None:
        limits = LimitsConfig(
            max_active=lt.integer("max_active", 1, 256, d.limits.max_active),
            queue_capacity=lt.integer("queue_capacity", 0, 4096, d.limits.queue_capacity),
            max_pending_events=lt.integer(
                "max_pending_events", 1, 65536, d.limits.max_pending_events
            ),
            consumer_stall_s=lt.number(
                "consumer_stall_s", 0.1, 86400, default=d.limits.consumer_stall_s
            ),
            drain_timeout_s=lt.number("drain_timeout_s", 0, 3600, default=d.limits.drain_timeout_s),
            reload_drain_s=lt.number("reload_drain_s", 0, 3600, default=d.limits.reload_drain_s),
            max_tokens=lt.integer("max_tokens", 1, 1 << 20, d.limits.max_tokens),
            max_sessions=lt.integer("max_sessions", 0, 4096, d.limits.max_sessions),
        )
    m = top.table("model", MODEL, required=False)
    model = d.model
    if m is not None:
        model = ModelConfig(
            path=m.absolute_path("path"), quantization=m.optional_text("quantization")
        )
    lg = top.table("log", LOG, required=False)
    log = d.log
    if lg is not None:
        log = LogConfig(
            level=lg.choice("level", LOG_LEVELS) if "level" in lg.raw else d.log.level,
            target=lg.choice("target", LOG_TARGETS) if "target" in lg.raw else d.log.target,
        )
    w = top.table("watchdog", WATCHDOG, required=False)
    watchdog = d.watchdog
    if w is not None:
        watchdog = WatchdogConfig(
            engine_stall_s=w.number("engine_stall_s", 0.5, 3600, default=d.watchdog.engine_stall_s),
            tick_s=w.number("tick_s", 0.05, 60, default=d.watchdog.tick_s),
        )
    st = top.table("sessions", SESSIONS, required=False)
    sessions = d.sessions
    if st is not None:
        sessions = SessionsConfig(share=st.flag("share", default=d.sessions.share))
    ft = top.table("fleet", FLEET, required=False)
    fleet = parse_fleet(ft, source) if ft is not None else d.fleet
    ut = top.table("updates", UPDATES, required=False)
    updates = _parse_updates(ut) if ut is not None else d.updates
    ht = top.table("http", HTTP, required=False)
    http = d.http
    if ht is not None:
        dh = d.http

        def seconds(key: str, default: float) -> float:
            return ht.number(key, 0.1, 3600) if key in ht.raw else default

        http = HttpConfig(
            key_file=ht.absolute_path("key_file"),
            max_connections=ht.integer("max_connections", 4, 65536, dh.max_connections),
            header_timeout_s=seconds("header_timeout_s", dh.header_timeout_s),
            body_timeout_s=seconds("body_timeout_s", dh.body_timeout_s),
            keep_alive_s=ht.integer("keep_alive_s", 1, 3600, dh.keep_alive_s),
            allowed_hosts=ht.text_list("allowed_hosts", ()),
            allowed_origins=ht.text_list("allowed_origins", ()),
        )
        listen = ht.optional_text("listen")
        if listen is not None:
            http = parse_http_listen(source, "http.listen", listen, server.allow_remote_tcp, http)
    qt = top.table("quotas", QUOTAS, required=False)
    quotas = d.quotas
    if qt is not None:
        quotas = QuotasConfig(
            sessions_per_client=qt.optional_integer("sessions_per_client", 1, 4096),
            session_bytes_per_client=qt.optional_integer("session_bytes_per_client", 1, None),
            waiting_per_client=qt.optional_integer("waiting_per_client", 1, 4096),
        )
    pt = top.table("probe", PROBE, required=False)
    probe = parse_probe(pt) if pt is not None else d.probe
    mt = top.raw.get("models")
    if mt is not None and not isinstance(mt, dict):
        raise top.error("models", mt, "a table: [models]")
    models = parse_models(mt, source) if mt is not None else d.models
    if models.entries and model.path is not None:
        raise top.error(
            "model.path", str(model.path), "no [model] path beside [models.NAME] tables"
        )
    parts = (server, limits, model, log, watchdog, sessions, fleet, updates, http, quotas)
    return AgentConfig(source, *parts, probe, models)


def _parse_updates(t: Table) -> UpdatesConfig:
    d = UpdatesConfig()

    def num(key: str, lo: float, hi: float, default: float) -> float:
        return t.number(key, lo, hi) if key in t.raw else default

    return UpdatesConfig(
        trusted_keys_dir=t.absolute_path("trusted_keys_dir") or d.trusted_keys_dir,
        trial_s=num("trial_s", 0, 86400, d.trial_s),
        max_trial_restarts=t.integer("max_trial_restarts", 1, 100, d.max_trial_restarts),
        max_payload_bytes=t.size("max_payload_bytes", 1024, 1 << 40, d.max_payload_bytes),
        progress_interval_s=num("progress_interval_s", 0.1, 3600, d.progress_interval_s),
        retry_s=num("retry_s", 0.1, 3600, d.retry_s),
        max_download_attempts=t.integer("max_download_attempts", 1, 10000, d.max_download_attempts),
        min_free_bytes=t.size("min_free_bytes", 0, 1 << 40, d.min_free_bytes),
        clock=t.choice("clock", CLOCK_SOURCES) if "clock" in t.raw else d.clock,
        timesync_file=t.absolute_path("timesync_file") or d.timesync_file,
        switch=parse_switch(t),
    )


def _is_mode(text: str) -> bool:
    try:
        return 0 <= int(text, 8) <= 0o777
    except ValueError:
        return False


def load_config(path: Path | None) -> AgentConfig:
    """Read the config file; the default path may be absent (defaults), a named one may not."""
    target = path or DEFAULT_PATH
    try:
        with open(target, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as exc:
        if path is None:
            return AgentConfig()
        raise ConfigError(str(target), "<file>", str(target), "an existing TOML file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(target), "<syntax>", str(exc), "valid TOML") from exc
    return parse_config(data, str(target))
