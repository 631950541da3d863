"""Debian roots for the Arm-under-emulation and real-systemd tests, built once and cached.

* ``build_root(spec)`` makes a Debian root with ``debootstrap`` from the apt mirror this machine is
  configured with (``/etc/apt/sources.list*``), under ``.cache/emulation/<name>-<key>`` (or
  ``$EDGE_AGENT_EMULATION_CACHE``), keyed by the suite, the architecture, the package list, the
  debootstrap and qemu versions and this recipe's version. A foreign (Arm) root is a first stage
  only plus every downloaded ``.deb`` unpacked with ``dpkg -x``: its second stage would need
  binfmt_misc, which is not registered here. The key directory appears only when complete.
* ``Emulator`` runs the root's own python3.11 under ``qemu-<arch>-static -cpu <cpu> -L ROOT``
  with a board's ``/proc/cpuinfo`` copied into the root (trimmed to this host's core count):
  without it XNNPACK's CPU detection reads the host's x86 cpuinfo and crashes.
* ``site_dirs(emulator, wheel)`` installs a wheel and its dependencies with the emulated pip
  (``--only-binary=:all:``, so environment markers are evaluated on the emulated machine):
  the dependencies once per dependency set, the wheel itself once per wheel.

``python -m tests.support.emulation`` builds every root (``scripts/test`` runs it in the
background).
Nothing here measures speed: emulated time means nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "boards"
SUITE = "bookworm"
RECIPE = "1"  # bump when the way a root is made changes
DEFAULT_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True, slots=True)
class RootSpec:
    """One cached Debian root: its name, Debian architecture, extra packages and stage."""

    name: str
    arch: str
    include: tuple[str, ...]
    foreign: bool  # first stage only, unpacked with dpkg -x (for an emulated architecture)
    # (link, target) pairs a maintainer script would make (update-alternatives); dpkg -x runs none
    links: tuple[tuple[str, str], ...] = ()


ARM64 = RootSpec("arm64", "arm64", ("python3", "python3-venv", "libpython3.11"), foreign=True)
# 32-bit Raspberry Pi OS route: numpy, sentencepiece, zstandard, cffi (cryptography's) and PyYAML
# (huggingface-hub's, for tokenizers) have no armv7l wheel on the package index, so they come from
# Debian's armhf packages (docs/SYSTEMD.md).
ARMHF = RootSpec(
    "armhf",
    "armhf",
    (
        "python3",
        "python3-venv",
        "libpython3.11",
        "python3-numpy",
        "python3-sentencepiece",
        "python3-zstandard",
        "python3-cffi",
        "python3-yaml",
    ),
    foreign=True,
    links=(
        ("usr/lib/arm-linux-gnueabihf/libblas.so.3", "blas/libblas.so.3"),
        ("usr/lib/arm-linux-gnueabihf/liblapack.so.3", "lapack/liblapack.so.3"),
    ),
)
# procps: the unit's ExecReload is /bin/kill (every standard Debian and Raspberry Pi OS install has
# it; minbase does not); python3-systemd: journald fields without building systemd-python
SYSTEMD = RootSpec(
    "systemd",
    "amd64",
    ("systemd", "systemd-sysv", "dbus", "procps", "python3", "python3-venv", "python3-systemd"),
    foreign=False,
)
ROOTS = (ARM64, ARMHF, SYSTEMD)


def cache_dir() -> Path:
    """Where roots and installed site directories are kept."""
    return Path(os.environ.get("EDGE_AGENT_EMULATION_CACHE", str(ROOT / ".cache" / "emulation")))


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created), so two runs never build the same thing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _version(package: str) -> str:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else "absent"


def mirror() -> str:
    """The Debian mirror apt is configured with here (deb822 or one-line format)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and len(words) > 2:
                uri = next(w for w in words[1:] if not w.startswith("["))
                if "security" not in uri:
                    return uri
    return DEFAULT_MIRROR


def root_key(spec: RootSpec) -> str:
    """The cache key of a root: everything that decides what ends up in it."""
    parts = [
        RECIPE,
        SUITE,
        spec.arch,
        ",".join(spec.include),
        str(spec.foreign),
        repr(spec.links),
        mirror(),
        _version("debootstrap"),
        _version("qemu-user-static") if spec.foreign else "",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def root_path(spec: RootSpec) -> Path:
    return cache_dir() / f"{spec.name}-{SUITE}-{spec.arch}-{root_key(spec)}"


def _run(cmd: Sequence[str | Path], **kw: object) -> None:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if out.returncode != 0:
        tail = (out.stdout + out.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{tail}")


def build_root(spec: RootSpec) -> Path:
    """The cached root for `spec`, made by debootstrap if it is not there yet."""
    final = root_path(spec)
    with locked(cache_dir() / f".{spec.name}.lock"):
        if (final / ".edge-agent-root").exists():
            return final
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        cmd: list[str | Path] = ["debootstrap", "--variant=minbase", f"--arch={spec.arch}"]
        if spec.foreign:
            cmd.append("--foreign")
        cmd += [f"--include={','.join(spec.include)}", SUITE, partial, mirror()]
        _run(cmd)
        debs = sorted((partial / "var" / "cache" / "apt" / "archives").glob("*.deb"))
        if spec.foreign:
            for deb in debs:
                _run(["dpkg-deb", "-x", deb, partial])
            for link, target in spec.links:
                if not (partial / link).parent.joinpath(target).exists():
                    raise RuntimeError(f"{spec.name}: {target} (for {link}) is not in the root")
                (partial / link).symlink_to(target)
        (partial / ".edge-agent-root").write_text("\n".join(d.name for d in debs) + "\n")
        partial.rename(final)
        for stale in cache_dir().glob(f"{spec.name}-{SUITE}-{spec.arch}-*"):
            if stale != final and not stale.name.endswith(".partial"):
                shutil.rmtree(stale, ignore_errors=True)  # an older key of this root
                for site in (cache_dir() / "sites").glob(f"*-{stale.name}-*"):
                    shutil.rmtree(site, ignore_errors=True)  # and what was installed for it
    return final


@dataclass(frozen=True, slots=True)
class Emulator:
    """The root's python3.11 under qemu-user as one emulated CPU with a board's cpuinfo."""

    root: Path
    qemu: str  # qemu-aarch64-static, qemu-arm-static
    cpu: str  # cortex-a76, cortex-a72, cortex-a7
    board: str  # the fixture whose proc/cpuinfo the emulated process reads

    def prepare(self) -> None:
        """Write the board's /proc/cpuinfo into the root, one processor per host core."""
        text = (FIXTURES / self.board / "proc" / "cpuinfo").read_text()
        blocks = [b for b in text.strip().split("\n\n") if b.startswith("processor")]
        tail = [b for b in text.strip().split("\n\n") if not b.startswith("processor")]
        keep = blocks[: max(1, min(len(blocks), os.cpu_count() or 1))]
        target = self.root / "proc" / "cpuinfo"
        target.parent.mkdir(exist_ok=True)
        target.write_text("\n\n".join(keep + tail) + "\n")

    def python(self, *args: str | Path, exe: Path | None = None) -> list[str]:
        """The command line that runs the emulated python3.11 (or `exe`) with `args`."""
        qemu = [self.qemu, "-cpu", self.cpu, "-L", str(self.root)]
        exe = exe or self.root / "usr" / "bin" / "python3.11"
        return [*qemu, str(exe), *map(str, args)]

    def run(
        self,
        *args: str | Path,
        env: Mapping[str, str] | None = None,
        timeout: float = 900,
        check: bool = True,
        exe: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the emulated python; with `check`, a failure raises with its output."""
        self.prepare()
        out = subprocess.run(
            self.python(*args, exe=exe),
            cwd=self.root,  # not the checkout: `-m agent` would import it from the cwd
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise RuntimeError(
                f"emulated {' '.join(map(str, args[:4]))} exited {out.returncode}:\n"
                f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
            )
        return out


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return sorted(
        line.split(":", 1)[1].strip()
        for line in lines
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    )


def _pip(emulator: Emulator, *args: str | Path, exe: Path | None = None) -> None:
    pip = sorted((emulator.root / "usr" / "share" / "python-wheels").glob("pip-*.whl"))[-1]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cache_dir()), "LC_ALL": "C.UTF-8"}
    emulator.run(
        f"{pip}/pip",
        "install",
        "--disable-pip-version-check",
        "--no-cache-dir",
        "--no-compile",  # byte-compiling everything under emulation costs minutes; imports do it
        "-q",
        "--only-binary=:all:",
        *args,
        env=env,
        timeout=1800,
        exe=exe,
    )


def site_dirs(emulator: Emulator, wheel: Path) -> tuple[Path, Path]:
    """(app, deps): `wheel` alone, and its dependencies as the emulated pip resolves them.

    Both are ``pip install --target`` directories outside the root (put them on PYTHONPATH in
    that order). The dependencies are keyed by the wheel's Requires-Dist and the root; the app
    by the wheel's file.
    """
    base = cache_dir() / "sites"
    deps_key = hashlib.sha256("\n".join([emulator.root.name, *_requires(wheel)]).encode())
    deps = base / f"deps-{emulator.root.name}-{deps_key.hexdigest()[:12]}"
    app_key = hashlib.sha256(f"{emulator.root.name}\n{wheel}".encode()).hexdigest()[:12]
    app = base / f"app-{emulator.root.name}-{app_key}"
    with locked(base / f".{emulator.root.name}.lock"):
        if not (deps / ".complete").exists():
            shutil.rmtree(deps, ignore_errors=True)
            _pip(emulator, "--target", deps, wheel)
            for stale in base.glob(f"deps-{emulator.root.name}-*"):
                if stale != deps:
                    shutil.rmtree(stale, ignore_errors=True)
            (deps / ".complete").write_text(wheel.name + "\n")
        if not (app / ".complete").exists():
            shutil.rmtree(app, ignore_errors=True)
            _pip(emulator, "--target", app, "--no-deps", wheel)
            for stale in base.glob(f"app-{emulator.root.name}-*"):
                if stale != app:
                    shutil.rmtree(stale, ignore_errors=True)
            (app / ".complete").write_text(wheel.name + "\n")
    return app, deps


def system_venv(emulator: Emulator, wheel: Path) -> Path:
    """A venv (``--copies --system-site-packages``, outside the root) with `wheel` installed by
    the emulated pip, for a root whose Debian packages provide what the index has no wheel of.

    ``--copies``: a symlinked interpreter would resolve to this machine's own python, since
    qemu-user maps a path into the root only when it exists there. Run ``<venv>/bin/python3.11``
    with ``Emulator.run(..., exe=...)``. Keyed like `site_dirs`.
    """
    base = cache_dir() / "sites"
    # the root's whole path: the venv's pyvenv.cfg names its interpreter there, so a venv made
    # for a root at another path (a cache copied or a checkout moved) would run without its
    # stdlib's extension modules
    key = hashlib.sha256("\n".join([str(emulator.root.resolve()), *_requires(wheel)]).encode())
    venv = base / f"venv-{emulator.root.name}-{key.hexdigest()[:12]}"
    python = venv / "bin" / "python3.11"
    with locked(base / f".{emulator.root.name}.lock"):
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            emulator.run("-m", "venv", "--copies", "--system-site-packages", "--without-pip", venv)
            _pip(emulator, wheel, exe=python)
            for stale in base.glob(f"venv-{emulator.root.name}-*"):
                if stale != venv:
                    shutil.rmtree(stale, ignore_errors=True)
            (venv / ".complete").write_text(wheel.name + "\n")
        stamp = venv / ".wheel"
        if not stamp.exists() or stamp.read_text() != str(wheel):
            _pip(emulator, "--no-deps", "--force-reinstall", wheel, exe=python)
            stamp.write_text(str(wheel))
    return venv


def problems() -> list[str]:
    """Why these roots cannot be made or run here (empty when they can): Debian packages that
    are missing, or not being root (debootstrap, chroot and systemd-nspawn need it)."""
    need = {
        "debootstrap": "debootstrap",
        "qemu-aarch64-static": "qemu-user-static",
        "qemu-arm-static": "qemu-user-static",
        "systemd-nspawn": "systemd-container",
    }
    missing = sorted({pkg for tool, pkg in need.items() if shutil.which(tool) is None})
    found = []
    if missing:
        found.append(
            f"missing the Debian packages {', '.join(missing)} (scripts/test installs them)"
        )
    if os.geteuid() != 0:
        found.append("not root: debootstrap, chroot and systemd-nspawn need root (CI runs as root)")
    return found


def main(argv: Sequence[str]) -> int:
    """Build the named roots (default: all) two at a time; print one line per root."""
    found = problems()
    if found:  # the tests say so themselves, and fail; the rest of the suite can still run
        print(f"[emulation] not built: {'; '.join(found)}", flush=True)
        return 0
    names = set(argv) or {s.name for s in ROOTS}
    specs = [s for s in ROOTS if s.name in names]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for spec, path in zip(specs, pool.map(build_root, specs), strict=True):
            print(f"[emulation] {spec.name}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
