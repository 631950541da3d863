"""systemd integration: service notifications (sd_notify) and journald logging.

Importable and fully working without systemd-python and without systemd: with no
``NOTIFY_SOCKET`` every `Notifier` call is a cheap no-op, and logging goes to stderr.

* `Notifier` speaks the notify protocol: READY, STATUS, WATCHDOG, RELOADING (with the
  ``MONOTONIC_USEC`` that ``Type=notify-reload`` needs on systemd >= 253), STOPPING and
  EXTEND_TIMEOUT_USEC. It uses ``systemd.daemon.notify`` (libsystemd's ``sd_notify``) when
  systemd-python is importable and the address came from this process's environment, and a plain
  ``AF_UNIX``/``SOCK_DGRAM`` datagram otherwise. A notify socket that went away is logged once and
  never raised into the caller.
* `configure_logging` sends records to journald with structured fields (``CODE_FILE``,
  ``CODE_LINE``, ... and ``REQUEST_ID``/``SESSION_ID``/``MODEL`` from ``extra=``) when running
  under systemd, and one line per record to stderr otherwise.

How the daemon uses them is described in docs/SYSTEMD.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Final, TextIO

from agent.base.errors import ConfigError

log = logging.getLogger(__name__)

# Attributes a caller may pass through ``extra=``; journald gets them upper-cased.
CONTEXT_FIELDS: Final = ("request_id", "session_id", "model")
SYSLOG_IDENTIFIER: Final = "edge-agent"
LOG_TARGETS: Final = ("auto", "journald", "stderr")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
STDERR_FORMAT: Final = "%(levelname)s %(name)s: %(message)s"
_SEND_TIMEOUT_S: Final = 5.0

# Handlers configure_logging installed on the root logger (replaced by the next call).
_installed: list[logging.Handler] = []

Sender = Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# Notifications


def _optional(module: str) -> ModuleType | None:
    """A systemd-python module, or None without it. (importlib: the repo's systemd/ directory
    of unit files would otherwise pass for a namespace package in type checkers.)"""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _libsystemd_notify() -> Callable[[str], bool] | None:
    daemon = _optional("systemd.daemon")
    if daemon is None:
        return None
    notify: Callable[[str], bool] = daemon.notify
    return notify


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock systemd compares ``MONOTONIC_USEC`` with."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends service state to systemd.

    Build it with `from_env()` in the daemon. ``address`` is a socket path or an abstract name
    written ``@name``; ``None`` disables every call. ``backend`` is ``"socket"`` (plain datagram)
    or ``"libsystemd"`` (``sd_notify`` through systemd-python, which reads ``NOTIFY_SOCKET`` from
    the process environment itself, so `from_env` picks it only for ``os.environ``).
    """

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        backend: str = "socket",
    ) -> None:
        if backend not in ("socket", "libsystemd"):
            raise ValueError(f"backend must be 'socket' or 'libsystemd', not {backend!r}")
        if address is not None and not address.startswith(("/", "@")):
            log.warning("NOTIFY_SOCKET=%r is not a path or @abstract name; not notifying", address)
            address = None
        self.address = address
        self.backend = backend
        self._watchdog_usec = watchdog_usec
        self._failing = False
        self._send: Sender | None = None
        if address is not None:
            if backend == "libsystemd":
                notify = _libsystemd_notify()
                if notify is None:
                    raise ValueError("backend 'libsystemd' needs systemd-python")
                self._send = _libsystemd_sender(address, notify)
            else:
                self._send = _socket_sender(address)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (default: os.environ).

        The watchdog counts only when ``WATCHDOG_PID`` is unset or names this process, as
        ``sd_watchdog_enabled`` decides.
        """
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        backend = "libsystemd" if environ is None and _libsystemd_notify() else "socket"
        return cls(address, watchdog_usec=_watchdog_usec(env), backend=backend)

    @property
    def enabled(self) -> bool:
        """True when there is a notify socket to talk to."""
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """The watchdog timeout (``WatchdogSec=``) in seconds, or None when there is none.

        This is the full timeout: ping at half of it (the customary period) or more often.
        """
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 1_000_000

    def ready(self, status: str | None = None) -> None:
        """Startup finished (model loaded, socket bound): ``READY=1``."""
        self._transition("READY", ["READY=1"], status)

    def reloading(self, status: str | None = None) -> None:
        """A reload (SIGHUP) started: ``RELOADING=1`` + ``MONOTONIC_USEC``; send `ready` after."""
        self._transition("RELOADING", ["RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}"], status)

    def stopping(self, status: str | None = None) -> None:
        """Shutdown started (draining): ``STOPPING=1``."""
        self._transition("STOPPING", ["STOPPING=1"], status)

    def status(self, text: str) -> None:
        """A one-line status shown by ``systemctl status``: ``STATUS=...``."""
        self._notify([f"STATUS={_one_line(text)}"])

    def watchdog(self) -> None:
        """Keep-alive ping: ``WATCHDOG=1``. Not logged."""
        self._notify(["WATCHDOG=1"])

    def extend_timeout(self, usec: int) -> None:
        """Ask for `usec` more microseconds in the current start/stop/reload phase."""
        if usec <= 0:
            raise ValueError(f"extend_timeout needs a positive number of microseconds, not {usec}")
        self._notify([f"EXTEND_TIMEOUT_USEC={usec}"])

    def _transition(self, name: str, lines: list[str], status: str | None) -> None:
        if not self.enabled:
            return
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        log.info("systemd: %s%s", name, f" ({_one_line(status)})" if status else "")
        self._notify(lines)

    def _notify(self, lines: list[str]) -> None:
        if self._send is None:
            return
        try:
            self._send("\n".join(lines))
        except OSError as exc:
            if not self._failing:
                self._failing = True
                log.warning(
                    "systemd notify socket %s unusable (%s); carrying on without notifications",
                    self.address,
                    exc,
                )
            return
        if self._failing:
            self._failing = False
            log.info("systemd notify socket %s reachable again", self.address)


def _socket_sender(address: str) -> Sender:
    """The plain protocol: one datagram per message; a leading '@' is the abstract namespace."""
    target = "\0" + address[1:] if address.startswith("@") else address

    def send(message: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(_SEND_TIMEOUT_S)
            sock.sendto(message.encode("utf-8"), target)

    return send


def _libsystemd_sender(address: str, notify: Callable[[str], bool]) -> Sender:
    plain = _socket_sender(address)

    def send(message: str) -> None:
        if os.environ.get("NOTIFY_SOCKET") != address:
            # sd_notify reads the environment itself; if that changed, address the socket directly.
            plain(message)
        elif not notify(message):
            raise OSError("sd_notify found no NOTIFY_SOCKET")

    return send


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        return None
    return usec if usec > 0 else None


# ---------------------------------------------------------------------------------------------
# Logging


def context_of(record: logging.LogRecord) -> dict[str, str]:
    """The ``extra=`` context fields a record carries (``request_id`` etc.), as strings."""
    out: dict[str, str] = {}
    for name in CONTEXT_FIELDS:
        value = getattr(record, name, None)
        if value is not None:
            out[name] = str(value)
    return out


def syslog_priority(levelno: int) -> int:
    """logging level → syslog priority (as JournalHandler.map_priority does)."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def journal_fields(record: logging.LogRecord, message: str) -> dict[str, str]:
    """The journald fields of one record; `message` is the formatted text (with traceback)."""
    fields = {
        "MESSAGE": message,
        "PRIORITY": str(syslog_priority(record.levelno)),
        "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
        "LOGGER": record.name,
        "THREAD_NAME": record.threadName or "",
        "CODE_FILE": record.pathname,
        "CODE_LINE": str(record.lineno),
        "CODE_FUNC": record.funcName,
    }
    if record.exc_text:
        fields["EXCEPTION_TEXT"] = record.exc_text
    for name, value in context_of(record).items():
        fields[name.upper()] = value
    return fields


class JournalFieldsHandler(logging.Handler):
    """Writes records to journald through libsystemd's ``sd_journal_sendv`` (systemd-python).

    Unlike ``systemd.journal.JournalHandler`` it sends only named fields (not every record
    attribute) and maps the ``extra=`` context to upper-case fields.
    """

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        journal = _optional("systemd.journal")
        if journal is None:
            raise ConfigError(
                "logging",
                "target",
                "journald",
                "a target other than journald (it needs systemd-python)",
            )
        self._sendv: Callable[..., object] = journal.sendv

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = journal_fields(record, self.format(record))
            self._sendv(*(f"{key}={value}" for key, value in fields.items()))
        except Exception:
            self.handleError(record)


def _quote(value: str) -> str:
    if value and not any(c.isspace() or c in '"=\\' for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class StderrFormatter(logging.Formatter):
    """``LEVEL logger: message key=value ...``; with `level_prefix` each line starts with the
    ``<N>`` syslog priority that journald reads from a service's stderr."""

    def __init__(self, *, level_prefix: bool = False) -> None:
        super().__init__(STDERR_FORMAT)
        self.level_prefix = level_prefix

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        context = context_of(record)
        if context:
            text += " " + " ".join(f"{k}={_quote(v)}" for k, v in context.items())
        return text

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.level_prefix:
            prefix = f"<{syslog_priority(record.levelno)}>"
            text = "\n".join(prefix + line for line in text.split("\n"))
        return text


def journal_stream_matches(fd: int, environ: Mapping[str, str] | None = None) -> bool:
    """True when `fd` is the journal stream systemd connected (``JOURNAL_STREAM=dev:ino``)."""
    env = os.environ if environ is None else environ
    dev, sep, ino = env.get("JOURNAL_STREAM", "").partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError):
        return False


def journald_available() -> bool:
    """True when systemd-python's journal module is importable."""
    return _optional("systemd.journal") is not None


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (OSError, ValueError, AttributeError):
        return None


def configure_logging(level: str, target: str = "auto", *, stream: TextIO | None = None) -> str:
    """Send the root logger's records to journald or `stream` (default: sys.stderr).

    ``target``: ``journald`` (needs systemd-python), ``stderr``, or ``auto``: journald when
    `stream` is the service's journal stream (``JOURNAL_STREAM``) and systemd-python is
    importable, else stderr (with ``<N>`` priority prefixes when it is the journal stream).
    Replaces only handlers an earlier call installed. Returns the target used.
    """
    if target not in LOG_TARGETS:
        raise ConfigError("logging", "target", target, "one of " + ", ".join(LOG_TARGETS))
    upper = level.upper()
    if upper not in LOG_LEVELS:
        raise ConfigError("logging", "level", level, "one of " + ", ".join(LOG_LEVELS))
    out = stream if stream is not None else sys.stderr
    fd = _fileno(out)
    to_journal = fd is not None and journal_stream_matches(fd)
    if target == "auto":
        chosen = "journald" if to_journal and journald_available() else "stderr"
    else:
        chosen = target

    handler: logging.Handler
    if chosen == "journald":
        handler = JournalFieldsHandler()  # raises ConfigError without systemd-python
    else:
        handler = logging.StreamHandler(out)
        handler.setFormatter(StderrFormatter(level_prefix=to_journal))
    root = logging.getLogger()
    while _installed:
        old = _installed.pop()
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    _installed.append(handler)
    root.setLevel(upper)
    return chosen
