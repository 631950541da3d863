"""The installed unit under a real systemd: a Debian root booted with systemd-nspawn.

The root (tests/support/emulation.py, cached) gets the wheel tests/support/wheel.py builds from
``git archive
HEAD`` in a venv at ``/opt/edge-agent/venv`` (``--system-site-packages`` for Debian's
python3-systemd, the journald and sd_notify binding). The container boots with
``--volatile=overlay`` (every change lands in a tmpfs, the cached root stays as it was) and a
private network, and is stopped whatever happens. Inside it, ``edge-agent systemd install``
writes the unit, and the test drives the service's whole life with systemctl, as on a board.

The only test-only setting is ``Environment=EDGE_AGENT_FAULT_INJECTION=1`` in a local drop-in
(``50-test.conf``): with it SIGUSR2 wedges the engine thread. The shipped unit never sets it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support import emulation
from tests.support.wheel import ROOT, build_wheel, clean_env, dependencies_key, wheel_venv

WHEEL_CACHE = ROOT / ".cache" / "wheel"
VENV = "/opt/edge-agent/venv"
SOCKET = "/run/edge-agent/agent.sock"
PROMPT = "def parse(path):"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _chroot(root: Path, *cmd: str) -> None:
    out = subprocess.run(
        ["chroot", str(root), *cmd],
        capture_output=True,
        text=True,
        env={"PATH": PATH, "HOME": "/root", "LC_ALL": "C.UTF-8"},
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"chroot {' '.join(cmd)} exited {out.returncode}:\n{out.stdout}{out.stderr}"
        )


def install_venv(root: Path, wheel: Path) -> None:
    """The wheel and its dependencies in ``/opt/edge-agent/venv`` inside `root` (cached: the
    dependencies per dependency set, the wheel per wheel).

    The dependencies' wheels are downloaded by this machine's pip (its index and certificate
    configuration stay outside the root) and installed by the root's own pip with
    ``--no-index``: the root needs no network and keeps no host configuration.
    """
    venv = root / VENV.lstrip("/")
    tmp = root / "tmp" / "edge-agent-wheels"
    with emulation.locked(emulation.cache_dir() / ".systemd-venv.lock"):
        deps = venv / ".deps"
        if not deps.exists() or deps.read_text() != dependencies_key():
            shutil.rmtree(venv, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--disable-pip-version-check",
                    "--only-binary=:all:",
                    "-d",
                    str(tmp),
                    str(wheel),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            _chroot(root, "/usr/bin/python3", "-m", "venv", "--system-site-packages", VENV)
            _chroot(
                root,
                f"{VENV}/bin/pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-index",
                "--find-links",
                "/tmp/edge-agent-wheels",
                f"/tmp/edge-agent-wheels/{wheel.name}",
            )
            shutil.rmtree(tmp)
            deps.write_text(dependencies_key())
        stamp = venv / ".wheel"
        if not stamp.exists() or stamp.read_text() != str(wheel):
            tmp.mkdir(parents=True, exist_ok=True)
            shutil.copy2(wheel, tmp / wheel.name)
            _chroot(
                root,
                f"{VENV}/bin/pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-index",
                "--no-deps",
                "--force-reinstall",
                f"/tmp/edge-agent-wheels/{wheel.name}",
            )
            shutil.rmtree(tmp)
            stamp.write_text(str(wheel))


class Container:
    """A booted systemd-nspawn container; `sh`/`run` execute inside it through nsenter."""

    def __init__(self, root: Path, log: Path) -> None:
        self.log = log
        self._log = open(log, "wb")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [
                "systemd-nspawn",
                "-D",
                str(root),
                "--volatile=overlay",
                "-b",
                "--register=no",
                "--keep-unit",
                "--private-network",
                "--machine=edge-agent-test",
                "--console=pipe",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.leader = self._find_leader(60)

    def _find_leader(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"systemd-nspawn exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
                )
            for status in Path("/proc").glob("[0-9]*/status"):
                try:
                    fields = dict(
                        line.split(":\t", 1)
                        for line in status.read_text().splitlines()
                        if ":\t" in line
                    )
                except OSError:
                    continue
                nspid = fields.get("NSpid", "").split()
                # the container's pid 1 once it is systemd (before its exec it is nspawn's
                # child, not yet in the container's root)
                if (
                    len(nspid) == 2
                    and nspid[1] == "1"
                    and fields.get("Name") == "systemd"
                    and self._descends(int(nspid[0]))
                ):
                    return int(nspid[0])
            time.sleep(0.2)
        raise AssertionError("the container's init did not appear")

    def _descends(self, pid: int) -> bool:
        while pid > 1:
            if pid == self.proc.pid:
                return True
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        return False

    def run(
        self, *cmd: str, timeout: float = 120, check: bool = False, user: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*cmd, user=user),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env={"PATH": PATH, "LC_ALL": "C.UTF-8"},
        )

    def command(self, *cmd: str, user: str | None = None) -> list[str]:
        inner = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
        return [
            "nsenter",
            "-t",
            str(self.leader),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "-r",
            "-w",
            "env",
            "-i",
            f"PATH={PATH}",
            "LC_ALL=C.UTF-8",
            *inner,
        ]

    def sh(self, script: str, timeout: float = 120) -> str:
        out = self.run("sh", "-c", script, timeout=timeout)
        assert out.returncode == 0, f"{script!r} exited {out.returncode}: {out.stdout}{out.stderr}"
        return out.stdout

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn powers the container off
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._log.close()


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    found = emulation.problems()
    if found:
        pytest.fail(f"the systemd boot test cannot run here: {'; '.join(found)}")
    root = emulation.build_root(emulation.SYSTEMD)
    install_venv(root, build_wheel(WHEEL_CACHE))
    c = Container(root, tmp_path_factory.mktemp("nspawn") / "console.log")
    try:
        deadline = time.monotonic() + 180
        state = c.run("systemctl", "is-system-running", "--wait", timeout=180)
        while "Failed to connect to bus" in state.stderr and time.monotonic() < deadline:
            time.sleep(0.5)  # systemd has not opened its private bus yet
            state = c.run("systemctl", "is-system-running", "--wait", timeout=180)
        assert state.stdout.strip() in ("running", "degraded"), state.stdout + c.sh(
            "systemctl --failed --no-pager"
        )
        yield c
    finally:
        c.stop()


def show(c: Container, *props: str) -> dict[str, str]:
    out = c.sh(f"systemctl show edge-agent -p {','.join(props)}")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(
    c: Container, predicate_props: Sequence[str], ok: object, timeout: float
) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        props = show(c, *predicate_props)
        if ok(props):  # type: ignore[operator]
            return props
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting: {props}\n"
                + c.run("journalctl", "-u", "edge-agent", "--no-pager", "-n", "60").stdout
            )
        time.sleep(0.5)


def client(
    c: Container, user: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return c.run(f"{VENV}/bin/edge-agent", "client", *args, user=user, timeout=timeout)


def x86_reference(tmp: Path, max_tokens: int) -> list[int]:
    """The same wheel on this machine, in-process (``edge-agent generate``), greedy."""
    venv = wheel_venv(WHEEL_CACHE)
    out = subprocess.run(
        [
            str(venv / "bin" / "edge-agent"),
            "generate",
            PROMPT,
            "--profile",
            "generic-x86_64",
            "--temperature",
            "0",
            "--max-tokens",
            str(max_tokens),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=clean_env(tmp),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["tokens"])


def _in_flight(c: Container) -> subprocess.Popen[str]:
    """alice's 1000-token greedy request, once its first text has streamed (it is running)."""
    inflight = subprocess.Popen(
        c.command(
            f"{VENV}/bin/edge-agent",
            "client",
            "generate",
            PROMPT,
            "--temperature",
            "0",
            "--max-tokens",
            "1000",
            "--timeout",
            "120",
            user="alice",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert inflight.stdout is not None
    inflight.stdout.read(1)
    return inflight


def test_the_unit_lifecycle_under_systemd(container: Container, tmp_path: Path) -> None:
    c = container
    # install as the docs say, from the venv; then the test-only fault switch in a local drop-in
    install = c.run(f"{VENV}/bin/edge-agent", "systemd", "install", "--profile", "generic-x86_64")
    assert install.returncode == 0, install.stdout + install.stderr
    unit = c.sh("systemctl cat edge-agent")
    assert f"ExecStart={VENV}/bin/edge-agent run" in unit
    c.sh(
        "mkdir -p /etc/systemd/system/edge-agent.service.d && printf '[Service]\\n"
        "Environment=EDGE_AGENT_FAULT_INJECTION=1\\n' "
        "> /etc/systemd/system/edge-agent.service.d/50-test.conf"
        # the stop below drains a whole 1000-token request: a drain time no loaded machine
        # reaches (the default 5 s would cut it there, as it should a stuck client)
        " && mkdir -p /etc/edge-agent"
        " && printf '[limits]\\ndrain_timeout_s = 60\\n' > /etc/edge-agent/agent.toml"
        " && systemctl daemon-reload"
    )
    c.sh(
        "getent group edge-agent-clients"
        " && useradd -m -G edge-agent-clients alice && useradd -m bob"
    )

    # READY=1: systemctl start returns only after it (Type=notify); our STATUS line shows
    start = c.run("systemctl", "start", "edge-agent", timeout=300)
    assert start.returncode == 0, start.stderr + c.sh("journalctl -u edge-agent --no-pager -n 80")
    props = show(c, "ActiveState", "SubState", "StatusText", "MainPID", "NRestarts")
    assert props["ActiveState"] == "active" and props["SubState"] == "running", props
    assert props["StatusText"].startswith("serving: edge-demo-pystdlib"), props
    status = c.run("systemctl", "status", "edge-agent", "--no-pager").stdout
    assert f'Status: "{props["StatusText"].split(";")[0]}' in status, status
    pid = props["MainPID"]

    # the socket: the dynamic user's (the daemon's uid, in systemd's dynamic range), group
    # edge-agent-clients, 0660
    sock = c.sh(f"stat -c '%u %G %a %F %i' {SOCKET}").split()
    uid = show(c, "UID")["UID"]
    daemon_uid = c.sh(f"awk '/^Uid:/ {{print $2}}' /proc/{pid}/status").strip()
    assert sock[0] == uid == daemon_uid and 61184 <= int(uid) <= 65519, (sock, uid, daemon_uid)
    assert sock[1:4] == ["edge-agent-clients", "660", "socket"], sock
    assert c.sh("stat -c '%a %G' /run/edge-agent").split() == ["750", "edge-agent-clients"]

    # a member of the group generates; the tokens are the same wheel's in-process greedy tokens
    expected = x86_reference(tmp_path / "home", 12)
    alice = client(
        c, "alice", "generate", PROMPT, "--temperature", "0", "--max-tokens", "12", "--json"
    )
    assert alice.returncode == 0, alice.stderr
    assert json.loads(alice.stdout)["tokens"] == expected
    # another user is refused by the socket's permissions: exit 3 (unreachable), naming it
    bob = client(c, "bob", "generate", PROMPT, "--max-tokens", "4")
    assert bob.returncode == 3, (bob.returncode, bob.stderr)
    assert SOCKET in bob.stderr or "/run/edge-agent" in bob.stderr, bob.stderr
    assert "Traceback" not in bob.stderr

    # reload (SIGHUP) with a request in flight: same process, same socket, the request completes
    inflight = _in_flight(c)
    reload = c.run("systemctl", "reload", "edge-agent", timeout=120)
    _, err = inflight.communicate(timeout=180)
    assert reload.returncode == 0, reload.stderr
    assert inflight.returncode == 0, err
    wait_for(c, ["ActiveState"], lambda p: p["ActiveState"] == "active", 60)
    assert show(c, "MainPID")["MainPID"] == pid
    assert c.sh(f"stat -c %i {SOCKET}").strip() == sock[4]
    log = c.sh("journalctl -u edge-agent --no-pager -o cat")
    assert "systemd: RELOADING" in log, log[-3000:]
    again = client(
        c, "alice", "generate", PROMPT, "--temperature", "0", "--max-tokens", "12", "--json"
    )
    assert again.returncode == 0 and json.loads(again.stdout)["tokens"] == expected, again.stderr

    # journald carries our structured fields
    records = [
        json.loads(line)
        for line in c.sh("journalctl -u edge-agent -o json --no-pager").splitlines()
    ]
    ours = [r for r in records if r.get("SYSLOG_IDENTIFIER") == "edge-agent" and "LOGGER" in r]
    assert ours, records[-5:]
    assert all(
        {"CODE_FILE", "CODE_LINE", "CODE_FUNC", "THREAD_NAME", "PRIORITY"} <= r.keys() for r in ours
    )
    assert any("REQUEST_ID" in r for r in ours), [r["MESSAGE"] for r in ours][-20:]

    # the sandbox of the installed unit (with its drop-ins) stays at most 2.0
    security = c.run("systemd-analyze", "security", "edge-agent", "--no-pager")
    level = re.search(r"Overall exposure level for edge-agent.service: (\d+\.\d+)", security.stdout)
    assert level, security.stdout + security.stderr
    assert float(level.group(1)) <= 2.0, security.stdout

    # a wedged engine: the pings stop, the watchdog kills the daemon (SIGABRT), systemd restarts it
    c.sh("systemctl kill --kill-who=main -s SIGUSR2 edge-agent")
    restarted = wait_for(
        c,
        ["NRestarts", "ActiveState", "MainPID"],
        lambda p: (
            p["NRestarts"] == "1"
            and p["ActiveState"] == "active"
            and p["MainPID"] not in ("0", pid)
        ),
        180,
    )
    system_log = c.sh("journalctl --no-pager -o cat -u edge-agent")
    assert "Watchdog timeout" in system_log, system_log[-3000:]
    assert "Failed with result 'watchdog'" in system_log, system_log[-3000:]
    assert "fault injection: stalling the engine thread" in system_log
    assert client(c, "alice", "health").returncode == 0, restarted

    # stop with a request in flight: it drains (the request completes), the daemon exits 0
    inflight = _in_flight(c)
    stop = c.run("systemctl", "stop", "edge-agent", timeout=120)
    _, err = inflight.communicate(timeout=180)
    assert stop.returncode == 0, stop.stderr
    assert inflight.returncode == 0, err
    final = show(c, "ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    assert final["ActiveState"] == "inactive" and final["Result"] == "success", final
    assert final["ExecMainStatus"] == "0", final
    assert "shutdown: drained" in c.sh("journalctl -u edge-agent --no-pager -o cat -n 20")
    assert c.run("test", "-e", SOCKET).returncode != 0
