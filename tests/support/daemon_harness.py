"""Start a real `edge-agent run` subprocess on a temporary unix socket, with a real
NOTIFY_SOCKET datagram socket that the test reads, and talk to it with the real client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from agent.api.grpc.client import Client


class NotifyListener:
    """A real AF_UNIX datagram socket standing in for systemd's notify socket.

    A background thread reads it continuously, as systemd does: a receiver that stops reading
    would let the queue fill and block the sender.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path.unlink(missing_ok=True)  # left by an earlier daemon in the same directory
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(65536).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
            self.messages.append(fields)

    def poll(self, timeout: float) -> None:
        time.sleep(timeout)

    def wait_for(
        self, key: str, value: str | None = None, timeout: float = 120.0, since: int | None = None
    ) -> dict[str, str]:
        """The first message after index `since` (default: from now) with `key` (= `value`)."""
        start = len(self.messages) if since is None else since
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.messages[start:]:
                if key in m and (value is None or m[key] == value):
                    return m
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} within {timeout}s; got {self.messages[start:]}")

    def mark(self, name: str) -> int:
        """Send our own datagram to the socket and wait until it is read; the index after it.

        The socket's queue is first in, first out: every message the daemon sent before the
        mark has been read when the mark has, so counting from here is not a race with the
        reader thread."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(f"TEST_MARK={name}".encode(), str(self.path))
        self.wait_for("TEST_MARK", name, since=0)
        return next(i + 1 for i, m in enumerate(self.messages) if m.get("TEST_MARK") == name)

    def count(self, key: str, since: int = 0) -> int:
        return sum(1 for m in self.messages[since:] if key in m)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(1)
        self.sock.close()


class Daemon:
    def __init__(
        self,
        tmp: Path,
        model_dir: Path | None,  # None: the config's ([models])
        config: str = "",
        env: dict[str, str] | None = None,
        profile: str = "generic-x86_64",
        args: tuple[str, ...] = (),
    ):
        self.tmp = tmp
        self.socket = tmp / "run" / "agent.sock"
        self.config = tmp / "agent.toml"
        self.config.write_text(config)
        self.notify = NotifyListener(tmp / "notify.sock")
        self.log = open(tmp / "daemon.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent",
                "run",
                "--profile",
                profile,
                *(("--model", str(model_dir)) if model_dir is not None else ()),
                "--socket",
                str(self.socket),
                "--config",
                str(self.config),
                "--state-dir",
                str(tmp / "state"),
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "NOTIFY_SOCKET": str(self.notify.path),
                "EDGE_AGENT_FAULT_INJECTION": "1",
                **(env or {}),
            },
        )
        try:
            self.ready = self.notify.wait_for("READY", "1")
        except AssertionError:
            self.stop()
            raise AssertionError("daemon did not get ready:\n" + self.read_log()) from None

    def client(self, timeout: float | None = 60.0) -> Client:
        return Client(str(self.socket), timeout=timeout)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def read_log(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.tmp / "daemon.log").read_text()

    def wait_log(self, text: str, timeout: float = 120.0, since: int = 0) -> int:
        """Until the daemon's log holds `text` after character `since`; where it ends there.
        An event to wait for (a log line says the thing happened), `timeout` only a limit."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.read_log()
            at = log.find(text, since)
            if at >= 0:
                return at + len(text)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in the daemon's log:\n{log[since:][-3000:]}")
            time.sleep(0.02)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.notify.close()
        self.log.close()
        return self.proc.returncode
