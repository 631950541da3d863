"""The installed wheel, as a new user runs it: built from ``git archive HEAD``
(tests/support/wheel.py),
installed with its dependencies into a fresh venv, run from a directory outside the checkout
with the checkout on no path, HOME a fresh directory and no XDG or systemd variables.

Every command's result is compared with the checkout's own run of the same command (or with
the committed files themselves), never with numbers copied from our output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grpc_tools import protoc

from tests.support.wheel import ROOT, build_wheel, clean_env, export_head, pip_wheel, wheel_venv

# Another checkout's HEAD instead of this one's (to see these tests fail on older code).
REPO = Path(os.environ.get("EDGE_AGENT_WHEEL_REPO", str(ROOT)))
CACHE = ROOT / ".cache" / "wheel"
PROMPT = "def parse(path):"
GREEDY = ["--temperature", "0", "--max-tokens", "24", "--seed", "1"]


@dataclass(frozen=True, slots=True)
class Installed:
    """The venv with the wheel in it, and a user's directories to run it in."""

    venv: Path
    home: Path
    work: Path

    @property
    def exe(self) -> str:
        return str(self.venv / "bin" / "edge-agent")

    def run(
        self, *args: str, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.exe, *args],
            capture_output=True,
            text=True,
            cwd=self.work,
            env={**clean_env(self.home), **(env or {})},
            timeout=timeout,
        )

    def ok(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = self.run(*args, env=env)
        assert done.returncode == 0, f"edge-agent {' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("user")
    (base / "home").mkdir()
    (base / "work").mkdir()
    return Installed(wheel_venv(CACHE, REPO), base / "home", base / "work")


def checkout(*args: str) -> str:
    """The same command from the checkout (the test venv's editable install)."""
    done = subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def committed(path: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(REPO), "show", f"HEAD:{path}"], capture_output=True, check=True
    ).stdout


def committed_names(directory: str) -> list[str]:
    listing = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", "HEAD", directory],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(listing.split())


def test_the_package_is_the_installed_one(installed: Installed) -> None:
    done = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c", "import agent, sys; print(agent.__file__)"],
        capture_output=True,
        text=True,
        cwd=installed.work,
        env=clean_env(installed.home),
    )
    assert done.returncode == 0, done.stderr
    where = Path(done.stdout.strip()).resolve()
    assert where.is_relative_to(installed.venv.resolve()), where  # not the checkout's agent/


def test_wheel_carries_the_shipped_files() -> None:
    names = set(zipfile.ZipFile(build_wheel(CACHE, REPO)).namelist())
    for directory in ("firmware_profiles", "systemd", "proto"):
        files = committed_names(directory)
        assert files
        for path in files:
            assert f"agent/data/{path}" in names, path
    for path in committed_names("agent/models/demo"):
        assert path in names, path


def test_sdist_builds_the_same_wheel(tmp_path: Path) -> None:
    """``pip install .`` from a source export, by way of the sdist (MANIFEST.in): the wheel it
    makes holds the same files as the one built from the export itself."""
    src = export_head(tmp_path / "src", REPO)
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
         "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "sdist")],
        capture_output=True, text=True, cwd=src,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    sdist = tmp_path / "sdist" / done.stdout.split()[-1]
    wheel = pip_wheel(sdist, tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set(zipfile.ZipFile(build_wheel(CACHE, REPO)).namelist())
    assert names == expected


def test_profile_list(installed: Installed) -> None:
    listed = json.loads(installed.ok("profile", "list", "--json"))["profiles"]
    shipped = [Path(p).stem for p in committed_names("firmware_profiles")]
    assert sorted(p["name"] for p in listed) == shipped
    pi5 = json.loads(installed.ok("profile", "show", "raspberry-pi-5", "--json"))
    assert pi5 == {**json.loads(checkout("profile", "show", "raspberry-pi-5", "--json")),
                   "source": pi5["source"], "reasons": pi5["reasons"]}  # fmt: skip
    assert Path(pi5["source"]).is_relative_to(installed.venv)


def test_profiles_dir_override(installed: Installed, tmp_path: Path) -> None:
    """$EDGE_AGENT_PROFILES_DIR still wins over the package's own profiles."""
    (tmp_path / "my-board.toml").write_bytes(
        committed("firmware_profiles/raspberry-pi-4.toml").replace(
            b'name = "raspberry-pi-4"', b'name = "my-board"'
        )
    )
    env = {"EDGE_AGENT_PROFILES_DIR": str(tmp_path)}
    listed = json.loads(installed.ok("profile", "list", "--json", env=env))["profiles"]
    assert [p["name"] for p in listed] == ["my-board"]


def _generate(run: Callable[..., str], *extra: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(run("generate", PROMPT, "--json", *GREEDY, *extra))
    return doc


def test_generate_equals_the_checkout(installed: Installed) -> None:
    mine = _generate(installed.ok, "--profile", "generic-x86_64")
    reference = _generate(checkout, "--profile", "generic-x86_64")
    assert mine["finish_reason"] == "length" and len(mine["tokens"]) == 24
    assert mine["tokens"] == reference["tokens"]
    assert mine["text"] == reference["text"]
    assert mine["model"] == reference["model"]


def _tree(path: Path) -> set[str]:
    return {str(p) for p in path.rglob("*")} if path.exists() else set()


def test_generate_keeps_caches_in_the_users_directory(installed: Installed) -> None:
    """A board profile names the daemon's /var/cache/edge-agent/xnnpack; a one-shot command
    uses ~/.cache/edge-agent instead (as root too: the daemon's files are not ours)."""
    daemons = Path("/var/cache/edge-agent")
    before = _tree(daemons)
    mine = _generate(installed.ok, "--profile", "raspberry-pi-5")
    assert _tree(daemons) == before
    cache = installed.home / ".cache" / "edge-agent" / "xnnpack"
    packed = sorted(p.name for p in cache.glob("*.xnnpack"))
    assert packed, f"no packed weights in {cache}"
    reference = _generate(checkout, "--profile", "generic-x86_64")
    assert mine["tokens"] == reference["tokens"]


def test_model_inspect_demo(installed: Installed, tmp_path: Path) -> None:
    demo = Path(_demo_dir(installed))  # the installed copy of the demo model
    assert demo.is_relative_to(installed.venv)
    mine = json.loads(installed.ok("model", "inspect", str(demo), "--json"))
    source = ROOT / "agent/models/demo"
    reference = json.loads(checkout("model", "inspect", str(source), "--json"))
    assert mine["variants"] and _relative(mine, str(demo)) == _relative(reference, str(source))


def _demo_dir(installed: Installed) -> str:
    done = subprocess.run(
        [
            str(installed.venv / "bin" / "python"),
            "-c",
            "from agent.model.directory import demo_model_dir; print(demo_model_dir())",
        ],
        capture_output=True,
        text=True,
        cwd=installed.work,
        env=clean_env(installed.home),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _relative(doc: object, directory: str) -> object:
    """`doc` with `directory` in its strings replaced by ``DEMO``."""
    if isinstance(doc, dict):
        return {k: _relative(v, directory) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_relative(v, directory) for v in doc]
    return doc.replace(directory, "DEMO") if isinstance(doc, str) else doc


def test_systemd_install_into_a_root(installed: Installed, tmp_path: Path) -> None:
    root = tmp_path / "root"
    exec_start = f"{installed.exe} run"
    installed.ok("systemd", "install", "--root", str(root), "--exec-start", exec_start)
    unit = root / "etc/systemd/system/edge-agent.service"
    assert unit.read_bytes() == committed("systemd/edge-agent.service")
    dropin = (root / "etc/systemd/system/edge-agent.service.d/10-profile.conf").read_text()
    assert f"ExecStart={exec_start}" in dropin
    assert (root / "etc/sysusers.d/edge-agent.conf").is_file()
    assert installed.ok("systemd", "dropin", "--exec-start", exec_start) == dropin


def test_shipped_protos_compile_with_plain_protoc(installed: Installed, tmp_path: Path) -> None:
    import grpc_tools

    proto = Path(_demo_dir(installed)).parent.parent / "data" / "proto"
    files = sorted(p.relative_to(proto).as_posix() for p in proto.rglob("*.proto"))
    assert files == sorted(p.removeprefix("proto/") for p in committed_names("proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", "-I", str(proto), "-I", include, f"--python_out={tmp_path}", *files]
    assert protoc.main(args) == 0


@pytest.fixture
def daemon(installed: Installed, tmp_path: Path) -> Iterator[Path]:
    """`edge-agent run` from the wheel on a unix socket; yields the socket."""
    sock = tmp_path / "run" / "agent.sock"
    sock.parent.mkdir()
    config = tmp_path / "agent.toml"
    config.write_text("")
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(
        [installed.exe, "run", "--profile", "generic-x86_64", "--socket", str(sock),
         "--config", str(config), "--state-dir", str(tmp_path / "state")],
        stdout=log, stderr=subprocess.STDOUT, cwd=installed.work, env=clean_env(installed.home),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while installed.run("client", "health", "--socket", str(sock)).returncode != 0:
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the daemon never became SERVING"
            time.sleep(0.3)
        yield sock
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "daemon.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_run_and_client_generate(installed: Installed, daemon: Path) -> None:
    served = json.loads(
        installed.ok("client", "generate", PROMPT, "--json", *GREEDY, "--socket", str(daemon))
    )
    reference = _generate(checkout, "--profile", "generic-x86_64")
    assert served["tokens"] == reference["tokens"]
    assert served["text"] == reference["text"]
