"""The installed wheel on Arm CPUs under qemu-user: profile detection, generate and the daemon.

The wheel tests/support/wheel.py builds from ``git archive HEAD`` is installed with its
dependencies by
the emulated pip (``--only-binary=:all:``, environment markers evaluated on the emulated
machine, so every binary is the one a board gets) and run by a Debian root's own python3.11
(tests/support/emulation.py) under qemu-user with a board's ``/proc/cpuinfo``:

* arm64, ``qemu-aarch64-static -cpu cortex-a76`` (Raspberry Pi 5) and ``-cpu cortex-a72`` (Pi 4:
  no dot product, no LSE atomics), ai-edge-litert on the demo model;
* armv7l, ``qemu-arm-static -cpu cortex-a7`` on an armhf root, the legacy tflite-runtime backend
  (``raspberry-pi-3-32bit``) on an unfused tiny model, with numpy, sentencepiece and zstandard
  from Debian's armhf packages (the index has no armv7l wheel of them) in a
  ``--system-site-packages`` venv: the route docs/SYSTEMD.md gives for 32-bit Raspberry Pi OS.

Greedy tokens are compared with the same wheel run natively on this x86_64 machine (another CPU,
other builds of every binary, and ai-edge-litert where the board runs tflite-runtime). The
daemon serves an x86_64 client over its unix socket. Nothing here is timed: emulated speed
means nothing.

The profiles are the shipped ones with ``xnnpack_weight_cache_dir`` pointed into the test's
directory: qemu-user maps an absolute path into the root only when it already exists there, so
``/var/cache/edge-agent`` would be created on this machine.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import emulation
from tests.support.paths import ROOT
from tests.support.wheel import build_wheel, clean_env, wheel_venv

WHEEL_CACHE = ROOT / ".cache" / "wheel"
PROMPT = "def parse(path):"
MAX_TOKENS = 12
GREEDY = ("--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--json")


@dataclass(frozen=True, slots=True)
class Target:
    """One emulated board: CPU, root, the fixture it detects as, its profile and model."""

    cpu: str
    machine: str  # platform.machine() inside
    cpu_part: str  # the fixture's "CPU part" line
    fixture: str
    profile: str
    quantization: str  # what "auto" picks for the profile (README's budget rule), or the variant
    legacy: bool  # tflite-runtime on an unfused model, Debian packages in a venv

    @property
    def spec(self) -> emulation.RootSpec:
        return emulation.ARMHF if self.legacy else emulation.ARM64

    @property
    def qemu(self) -> str:
        return "qemu-arm-static" if self.legacy else "qemu-aarch64-static"


TARGETS = [
    Target("cortex-a76", "aarch64", "0xd0b", "raspberry-pi-5", "raspberry-pi-5", "int8", False),
    Target(
        "cortex-a72", "aarch64", "0xd08", "raspberry-pi-4", "raspberry-pi-4", "int4_block32", False
    ),
    Target(
        "cortex-a7",
        "armv7l",
        "0xd03",
        "raspberry-pi-zero-2w-32bit",
        "raspberry-pi-3-32bit",
        "int8_weight_only",
        True,
    ),
]


@dataclass(frozen=True, slots=True)
class Installed:
    """The wheel installed for one target, and how to run it there."""

    target: Target
    emulator: emulation.Emulator
    pythonpath: str  # site directories (arm64) or "" (a venv)
    exe: Path | None  # the venv's interpreter, or None for the root's

    def env(self, home: Path) -> dict[str, str]:
        home.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / "cache"),
            "XDG_STATE_HOME": str(home / "state"),
            "LC_ALL": "C.UTF-8",
        }
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env

    def run(self, *args: str | Path, home: Path) -> subprocess.CompletedProcess[str]:
        return self.emulator.run(*args, env=self.env(home), exe=self.exe)

    def command(self, *args: str | Path) -> list[str]:
        self.emulator.prepare()
        return self.emulator.python(*args, exe=self.exe)


def _require_tools() -> None:
    found = emulation.problems()
    if found:
        pytest.fail(f"the Arm tests cannot run here: {'; '.join(found)}")


@pytest.fixture(scope="module")
def wheel() -> Path:
    return build_wheel(WHEEL_CACHE)


@pytest.fixture(scope="module")
def x86_venv() -> Path:
    return wheel_venv(WHEEL_CACHE)


@pytest.fixture(scope="module", params=TARGETS, ids=[t.cpu for t in TARGETS])
def installed(request: pytest.FixtureRequest, wheel: Path) -> Iterator[Installed]:
    _require_tools()
    t: Target = request.param
    root = emulation.build_root(t.spec)
    emu = emulation.Emulator(root, t.qemu, t.cpu, t.fixture)
    if t.legacy:
        venv = emulation.system_venv(emu, wheel)
        yield Installed(t, emu, "", venv / "bin" / "python3.11")
    else:
        app, deps = emulation.site_dirs(emu, wheel)
        yield Installed(t, emu, f"{app}:{deps}", None)


@pytest.fixture(scope="module")
def unfused_dir(tiny_model_factory) -> Path:
    """What the legacy backend runs: fp32 and weight-only int8, composites off."""
    return tiny_model_factory.model_dir(
        quantizations=("fp32", "int8_weight_only"), enable_hlfb=False
    )


def local_profile(name: str, directory: Path, legacy_file: bool = False) -> Path:
    """The shipped profile `name` with its weight cache in `directory` (see the module doc);
    `legacy_file`: it accepts an unfused file (as the legacy profile does)."""
    text = (ROOT / "firmware_profiles" / f"{name}.toml").read_text()
    directory.mkdir(parents=True, exist_ok=True)
    cache = directory / "xnnpack"
    text, n = re.subn(
        r'(?m)^xnnpack_weight_cache_dir = ".*"$', f'xnnpack_weight_cache_dir = "{cache}"', text
    )
    if n == 0:
        text = text.replace("[runtime]\n", f'[runtime]\nxnnpack_weight_cache_dir = "{cache}"\n', 1)
    if legacy_file:
        text = re.sub(r"(?m)^require_fused = .*$", "require_fused = false", text)
    path = directory / f"{name}.toml"
    path.write_text(text)
    return path


def generate_args(profile: Path, quantization: str, model: Path | None) -> list[str]:
    args = ["generate", PROMPT, "--profile", str(profile), "--quantization", quantization]
    args += ["--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--json"]
    return [*args, "--model", str(model)] if model else args


def x86_tokens(venv: Path, t: Target, model: Path | None, tmp: Path) -> list[int]:
    """The same wheel's greedy tokens on this machine (x86_64, ai-edge-litert)."""
    profile = local_profile("generic-x86_64", tmp / "x86", legacy_file=t.legacy)
    (tmp / "x86-home").mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [str(venv / "bin" / "edge-agent"), *generate_args(profile, t.quantization, model)],
        capture_output=True,
        text=True,
        env=clean_env(tmp / "x86-home"),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    tokens = json.loads(out.stdout)["tokens"]
    assert len(tokens) == MAX_TOKENS, out.stdout
    return list(tokens)


@pytest.fixture
def model(installed: Installed, request: pytest.FixtureRequest) -> Path | None:
    """The demo model (the wheel's own) on arm64, the unfused tiny model on armv7l."""
    return request.getfixturevalue("unfused_dir") if installed.target.legacy else None


def test_the_emulated_machine_is_the_board(installed: Installed, tmp_path: Path) -> None:
    t = installed.target
    code = (
        "import agent, platform, importlib.util as u; print(platform.machine()); "
        "print(u.find_spec('ai_edge_litert') is not None, "
        "u.find_spec('tflite_runtime') is not None); print(agent.__file__)"
    )
    out = installed.run("-c", code, home=tmp_path)
    machine, backends, package = out.stdout.splitlines()
    assert machine == t.machine
    # the installed wheel's package, never this checkout's
    assert not Path(package).is_relative_to(ROOT / "agent"), package
    assert "/sites/" in package, package
    # the backend the package's markers pick: ai-edge-litert on arm64, tflite-runtime on 32 bit
    assert backends == ("False True" if t.legacy else "True False")
    # the cpuinfo the emulated process reads is the board's (XNNPACK's CPU detection reads it)
    cpuinfo = installed.run("-c", "print(open('/proc/cpuinfo').read())", home=tmp_path)
    assert f"CPU part\t: {t.cpu_part}" in cpuinfo.stdout


def test_profile_detect_on_the_fixture_root(installed: Installed, tmp_path: Path) -> None:
    t = installed.target
    fixture = emulation.FIXTURES / t.fixture
    out = installed.run(
        "-m", "agent", "profile", "detect", "--root", fixture, "--json", home=tmp_path
    )
    assert json.loads(out.stdout)["profile"] == t.profile, out.stdout


def test_generate_gives_the_x86_64_greedy_tokens(
    installed: Installed, model: Path | None, x86_venv: Path, tmp_path: Path
) -> None:
    t = installed.target
    expected = x86_tokens(x86_venv, t, model, tmp_path)
    profile = local_profile(t.profile, tmp_path)
    out = installed.run(
        "-m", "agent", *generate_args(profile, t.quantization, model), home=tmp_path / "home"
    )
    result = json.loads(out.stdout)
    assert result["tokens"] == expected, (result, out.stderr[-2000:])
    assert result["finish_reason"] == "length"
    assert result["stats"]["accelerator"] == "xnnpack", result["stats"]


def _wait_serving(
    client: list[str], env: dict[str, str], daemon: subprocess.Popen[str], log: Path
) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise AssertionError(
                f"the emulated daemon exited {daemon.returncode}: {log.read_text()}"
            )
        health = subprocess.run(
            [*client[:2], "health", *client[2:]],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        if health.returncode == 0:
            return
        time.sleep(2)
    raise AssertionError(f"the emulated daemon was not SERVING after 900 s: {log.read_text()}")


def test_the_emulated_daemon_serves_an_x86_64_client(
    installed: Installed, model: Path | None, x86_venv: Path, tmp_path: Path
) -> None:
    t = installed.target
    expected = x86_tokens(x86_venv, t, model, tmp_path)
    profile = local_profile(t.profile, tmp_path)
    sock = tmp_path / "run" / "agent.sock"
    sock.parent.mkdir()
    args: list[str | Path] = ["-m", "agent", "run", "--profile", profile, "--socket", sock]
    args += ["--quantization", t.quantization, "--state-dir", tmp_path / "state"]
    if model:
        args += ["--model", model]
    log = tmp_path / "daemon.log"
    with open(log, "w") as err:
        daemon = subprocess.Popen(
            installed.command(*args),
            cwd=installed.emulator.root,  # not the checkout (see Emulator.run)
            env=installed.env(tmp_path / "home"),
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    try:
        # the client is the x86_64 wheel on this machine, over the emulated daemon's socket
        client = [str(x86_venv / "bin" / "edge-agent"), "client", "--socket", str(sock)]
        env = clean_env(tmp_path / "client-home")
        (tmp_path / "client-home").mkdir()
        _wait_serving(client, env, daemon, log)
        out = subprocess.run(
            [*client[:2], "generate", PROMPT, *client[2:], "--timeout", "900", *GREEDY],
            capture_output=True,
            text=True,
            env=env,
            timeout=960,
        )
        assert out.returncode == 0, out.stderr + log.read_text()
        assert json.loads(out.stdout)["tokens"] == expected, out.stdout
        daemon.send_signal(signal.SIGTERM)  # qemu-user passes it to the emulated process
        assert daemon.wait(timeout=300) == 0, log.read_text()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert not sock.exists()
