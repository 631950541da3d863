"""A real RabbitMQ (Debian's rabbitmq-server, its MQTT plugin: MQTT 3.1.1) on loopback ports,
the second, independent broker implementation the fleet tests run against (docs/FLEET.md,
"Brokers"). Everything it writes lives under the given directory: its own node name, Erlang
cookie ($HOME), Mnesia and log directories, config file and enabled-plugins file, and its own
epmd on a free port, so that it touches nothing of a RabbitMQ installed as a service.

    broker = RabbitMQ(tmp_path)      # anonymous MQTT on 127.0.0.1:<free port>; ~8 s to start
    broker.url, broker.port, broker.version
    broker.stop()                    # SIGTERM, then SIGKILL of whatever is left, and its epmd

It offers the same `port`, `url` and `pki` (None: plain TCP) as tests/support/broker.py's Mosquitto.

    cluster = RabbitCluster(tmp, 3)  # three nodes joined with `rabbitmqctl join_cluster`
    cluster.urls, cluster.nodes[i].kill(), cluster.nodes[i].start(), cluster.stop()

The nodes of a cluster share one epmd and one Erlang cookie, each with its own ports, node name
and directories; session queues are mirrored to every node (the `ha-mqtt` policy) so that a
persistent session outlives the node it was made on (docs/FLEET.md, "Broker clusters").
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.broker import Pki

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")  # the Debian package's scripts (no user switch)
EPMD = shutil.which("epmd") or "/usr/bin/epmd"


LISTEN_PORTS = (20000, 32000)  # below Linux's ephemeral range (32768-60999): see `free_port`


def free_port() -> int:
    """A free loopback port outside the ephemeral range: a node takes a while to start on a
    loaded machine, and a port the kernel handed out (port 0) can meanwhile be the source
    port of some other process's outgoing connection (eaddrinuse at the node's listen)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(*LISTEN_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LISTEN_PORTS}")


def installed() -> bool:
    return (RABBITMQ_BIN / "rabbitmq-server").exists() and Path(EPMD).exists()


class RabbitMQ:
    """RabbitMQ with rabbitmq_mqtt listening on 127.0.0.1 only (MQTT, AMQP, Erlang
    distribution and epmd), anonymous MQTT logins mapped to the user "guest"."""

    pki: Pki | None = None

    def __init__(
        self,
        tmp: Path,
        start_timeout: float = 90.0,
        *,
        name: str = "rabbitmq",
        epmd_port: int | None = None,
        cookie: str | None = None,
        start: bool = True,
    ) -> None:
        """`epmd_port`: a cluster's shared epmd (else this node starts its own); `cookie`: the
        cluster's Erlang cookie; `start`: False to start it later (`start`)."""
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.amqp_port = free_port()
        self.dist_port = free_port()
        self.own_epmd = epmd_port is None
        self.epmd_port = free_port() if epmd_port is None else epmd_port
        self.node = f"edge-test-{os.getpid()}-{self.port}@localhost"
        if cookie is not None:
            path = self.dir / ".erlang.cookie"
            path.write_text(cookie)
            path.chmod(0o400)
        self.conf = self.dir / "rabbitmq.conf"
        self.conf.write_text(
            "\n".join(
                [
                    f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}",
                    f"mqtt.listeners.tcp.default = 127.0.0.1:{self.port}",
                    "mqtt.allow_anonymous = true",
                    "mqtt.default_user = guest",
                    "mqtt.default_pass = guest",
                    "mqtt.vhost = /",
                    "mqtt.exchange = amq.topic",
                    "log.console = false",
                    "log.file.level = info",
                ]
            )
            + "\n"
        )
        env_file = self.dir / "rabbitmq-env.conf"  # instead of /etc/rabbitmq/rabbitmq-env.conf
        env_file.write_text("")
        keep = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_")) and k != "NOTIFY_SOCKET"
        }
        self.env = {
            **keep,
            "HOME": str(self.dir),  # the Erlang cookie
            "RABBITMQ_CONF_ENV_FILE": str(env_file),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.conf),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(self.dir / "plugins-expand"),
            "RABBITMQ_PID_FILE": str(self.dir / "rabbitmq.pid"),
        }
        if not installed():
            raise RuntimeError(
                f"no RabbitMQ in {RABBITMQ_BIN} or no {EPMD}: apt-get install rabbitmq-server "
                "(scripts/test does)"
            )
        # what `rabbitmq-plugins --offline enable rabbitmq_mqtt` writes, without booting an
        # Erlang VM for it
        (self.dir / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        self.epmd: subprocess.Popen[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.version = ""
        self.launched = 0.0
        if start:
            try:
                self.start(start_timeout)
            except BaseException:
                self.stop()
                raise

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the node (and our epmd) without waiting for it: a cluster starts its nodes
        side by side."""
        self.launched = time.monotonic()
        if self.own_epmd:
            # our own epmd in the foreground, so that the node does not start a detached one
            self.epmd = subprocess.Popen(
                [EPMD, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                env=self.env,
                cwd=self.dir,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            _wait_listening(self.epmd_port, time.monotonic() + 30, self.epmd, "epmd")
        with open(self.dir / "stdout.log", "ab") as out:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [str(RABBITMQ_BIN / "rabbitmq-server")],
                env=self.env,
                cwd=self.dir,  # Erlang writes Mnesia.<node>/ into its working directory when
                # a path does not say where: never into the checkout
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() can end all of it
            )

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until the node's MQTT plugin answers a CONNECT with a CONNACK."""
        assert self.proc is not None
        deadline = self.launched + timeout
        _wait_listening(self.port, deadline, self.proc, "rabbitmq", self.read_log)
        # the listener accepts before the plugin's client-id tracking is ready: wait for a
        # real CONNACK
        while not _mqtt_connects(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rabbitmq's MQTT plugin did not accept:\n{self.read_log()}")
            time.sleep(0.2)
        found = re.search(r"Starting RabbitMQ (\S+) on Erlang (\S+)", self.read_log())
        self.version = f"{found.group(1)} (Erlang {found.group(2)})" if found else "?"

    def stop(self) -> None:
        """SIGTERM (RabbitMQ shuts down cleanly), then SIGKILL to its whole process group if
        it is still there after 30 s, then our epmd."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(30)
            # the Erlang VM and its helpers, even if the wrapper script has gone
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        if self.epmd is not None:
            self.epmd.kill()
            self.epmd.wait()
            self.epmd = None

    def kill(self) -> None:
        """SIGKILL to the node's whole process group: the node dies as a machine would, its
        clients' connections reset."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ctl(self, *args: str, timeout: float = 120.0) -> str:
        """`rabbitmqctl -n <this node> ARGS`; its output, or RuntimeError with it."""
        done = subprocess.run(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node, *args],
            env=self.env,
            cwd=self.dir,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        out = (done.stdout + done.stderr).decode(errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.returncode}\n{out}")
        return out

    def read_log(self) -> str:
        path = self.dir / "log" / f"{self.node}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class RabbitCluster:
    """`n` RabbitMQ nodes on loopback joined into one cluster: one epmd for all, one cookie,
    each node its own MQTT, AMQP and distribution ports. Node 0 is the seed the others join.
    MQTT session queues (`mqtt-subscription-*`) are mirrored to every node by a policy, so a
    persistent session and its queued messages outlive the node the client was on."""

    def __init__(self, tmp: Path, n: int = 3, start_timeout: float = 150.0) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.epmd_port = free_port()
        self._failed: list[BaseException] = []
        cookie = secrets.token_hex(16)
        self.nodes = [
            RabbitMQ(
                tmp,
                name=f"node{i}",
                epmd_port=self.epmd_port,
                cookie=cookie,
                start=False,
            )
            for i in range(n)
        ]
        self.epmd = subprocess.Popen(
            [EPMD, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            env=self.nodes[0].env,
            cwd=self.nodes[0].dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_listening(self.epmd_port, time.monotonic() + 30, self.epmd, "epmd")
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready(start_timeout)
            joins = [
                threading.Thread(target=self._join, args=(node, start_timeout))
                for node in self.nodes[1:]
            ]
            for t in joins:
                t.start()
            for t in joins:
                t.join()
            if self._failed:
                raise self._failed[0]
            self.nodes[0].ctl(
                "set_policy",
                "--apply-to",
                "queues",
                "ha-mqtt",
                "^mqtt-subscription-",
                '{"ha-mode":"all","ha-sync-mode":"automatic"}',
            )
        except BaseException:
            self.stop()
            raise

    def _join(self, node: RabbitMQ, timeout: float) -> None:
        """`rabbitmqctl join_cluster` of `node` to node 0 (side by side for every node)."""
        try:
            node.ctl("stop_app")
            node.ctl("join_cluster", self.nodes[0].node)
            node.ctl("start_app")
            node.launched = time.monotonic()
            node.wait_ready(timeout)
        except BaseException as exc:  # raised in __init__
            self._failed.append(exc)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def restart(self, i: int, timeout: float = 150.0) -> None:
        """Start node `i` again after a `kill`: it rejoins the cluster from its own data."""
        node = self.nodes[i]
        node.launch()
        node.wait_ready(timeout)

    def members(self) -> str:
        """`rabbitmqctl cluster_status` from the first running node."""
        node = next(n for n in self.nodes if n.running)
        return node.ctl("cluster_status")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.epmd.kill()
        self.epmd.wait()


def _wait_listening(
    port: int,
    deadline: float,
    proc: subprocess.Popen[bytes],
    name: str,
    log: Callable[[], str] | None = None,
) -> None:
    while True:
        if proc.poll() is not None:
            detail = log() if log is not None else ""
            raise RuntimeError(f"{name} exited with {proc.returncode}\n{detail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                detail = log() if log is not None else ""
                raise RuntimeError(f"{name} did not listen on port {port}\n{detail}") from None
            time.sleep(0.1)


def _mqtt_connects(port: int) -> bool:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="ready-probe", protocol=mqtt.MQTTv311)
    try:
        c.connect("127.0.0.1", port, keepalive=10)
        deadline = time.monotonic() + 5
        while not c.is_connected() and time.monotonic() < deadline:
            if c.loop(0.1) != mqtt.MQTT_ERR_SUCCESS:
                return False
        ok = c.is_connected()
        c.disconnect()
        return ok
    except OSError:
        return False
