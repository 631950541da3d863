"""The edge-agent wheel as a user gets it: built from ``git archive HEAD``, never the work tree.

* ``build_wheel(cache_dir)`` builds ``edge_agent-*.whl`` from the committed tree (so a file
  that is not committed, or not declared as package data, is missing, as it would be for a
  user) and keeps it in `cache_dir` keyed by HEAD's tree hash and the build tools' versions: a
  warm call costs a ``git rev-parse``.
* ``wheel_venv(cache_dir)`` is a fresh venv (not the project's, never the checkout on its path)
  with the wheel's dependencies from the package index, cached by the dependency set; only the
  edge-agent wheel itself is reinstalled when HEAD changes.

Both take a lock in `cache_dir`, so two test runs on one checkout do not build over each other.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.paths import ROOT


@contextmanager
def _locked(cache_dir: Path) -> Iterator[None]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _git(*args: str, repo: Path = ROOT) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def _tool_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def wheel_key(repo: Path = ROOT) -> str:
    """What the wheel depends on: HEAD's tree and the tools that generate code into it."""
    tree = _git("rev-parse", "HEAD^{tree}", repo=repo)
    tools = f"setuptools-{_tool_version('setuptools')}-grpcio-tools-{_tool_version('grpcio-tools')}"
    return f"{tree[:16]}-{hashlib.sha256(tools.encode()).hexdigest()[:8]}"


def export_head(dest: Path, repo: Path = ROOT) -> Path:
    """`repo`'s HEAD as ``git archive`` exports it, unpacked into `dest` (created)."""
    dest.mkdir(parents=True)
    archive = dest.with_name(dest.name + ".tar")
    subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", "-o", str(archive), "HEAD"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


def pip_wheel(source: Path, out: Path) -> Path:
    """``pip wheel`` of a source tree or sdist into `out`, with this interpreter's build tools."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=source.parent,
    )
    wheels = sorted(out.glob("edge_agent-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip wheel made {wheels} in {out}")
    return wheels[0]


def build_wheel(cache_dir: Path, repo: Path = ROOT) -> Path:
    """The wheel of `repo`'s HEAD (``cache_dir/<key>/edge_agent-*.whl``), built once per key.

    Built by this interpreter's pip without build isolation (setuptools and grpcio-tools come
    from the test venv; nothing is downloaded) from a ``git archive HEAD`` export in a temporary
    directory. Raises `subprocess.CalledProcessError` with pip's output when the build fails.
    """
    key = wheel_key(repo)
    out = cache_dir / key
    with _locked(cache_dir):
        found = sorted(out.glob("edge_agent-*.whl")) if out.is_dir() else []
        if found:
            return found[0]
        with tempfile.TemporaryDirectory(prefix="edge-agent-wheel-") as tmp:
            src = export_head(Path(tmp) / "src", repo)
            wheels = [pip_wheel(src, Path(tmp) / "dist")]
            partial = cache_dir / f".{key}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            shutil.copy2(wheels[0], partial / wheels[0].name)
            partial.rename(out)  # the key directory appears only with a whole wheel in it
        _prune(cache_dir, keep=KEEP_WHEELS)
        return out / wheels[0].name


KEEP_WHEELS = 3  # each carries the demo model (~12 MB); a new commit makes a new one


def _prune(cache_dir: Path, keep: int) -> None:
    """Remove all but the `keep` newest wheel directories (``<tree>-<tools>``)."""
    built = sorted(
        (d for d in cache_dir.iterdir() if d.is_dir() and list(d.glob("edge_agent-*.whl"))),
        key=lambda d: d.stat().st_mtime,
        reverse=True,
    )
    for old in built[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def dependencies_key(repo: Path = ROOT) -> str:
    """The venv's key: pyproject's `dependencies` and this interpreter's version."""
    with open(repo / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    text = "\n".join([sys.version, *sorted(deps)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "-q", "install", *args],
        check=True,
        capture_output=True,
        text=True,
    )


def wheel_venv(cache_dir: Path, repo: Path = ROOT) -> Path:
    """A venv (``cache_dir/venv-<deps key>``) with HEAD's wheel and its dependencies installed;
    returns its directory (``bin/edge-agent``, ``bin/python``)."""
    wheel = build_wheel(cache_dir, repo)
    venv = cache_dir / f"venv-{dependencies_key(repo)}"
    with _locked(cache_dir):
        ready = venv / ".deps-installed"
        if not ready.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            _pip(venv / "bin" / "python", str(wheel))  # with its dependencies, from the index
            ready.write_text(wheel.name + "\n")
        stamp = venv / ".wheel"
        if not stamp.exists() or stamp.read_text() != str(wheel):
            _pip(venv / "bin" / "python", "--no-deps", "--force-reinstall", str(wheel))
            stamp.write_text(str(wheel))
    return venv


def clean_env(home: Path) -> dict[str, str]:
    """An environment for the installed command: no PYTHONPATH, no profile overrides, `home` as
    HOME and no XDG or systemd directories (so the defaults are what is tested)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("EDGE_AGENT_", "XDG_", "PYTHON", "VIRTUAL_ENV"))
        and k not in ("CACHE_DIRECTORY", "STATE_DIRECTORY", "RUNTIME_DIRECTORY", "NOTIFY_SOCKET")
    }
    env["HOME"] = str(home)
    return env
