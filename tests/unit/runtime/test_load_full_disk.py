"""A model's first load on a full weight cache directory (issue 35): XNNPACK aborts the process
when it cannot write its cache file, and a prepared copy cut short by ENOSPC stayed behind as a
`.tmp` taking the room. The load runs in a child process (an abort must fail the test, not end
it) on a real tmpfs the test mounts; and what a first load writes is measured against the bound
the updater counts (`agent.model.room.first_load_bound`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.model import room
from tests.support.tmpfs import fill, free, tmpfs

pytestmark = pytest.mark.root

MiB = 1 << 20

# loads `model` (argv 1) with its weight cache directory in argv 2, as the daemon does
_LOAD = """
import dataclasses, hashlib, logging, sys
from pathlib import Path
from agent.profile.load import load_profile, profiles_dir
from agent.runtime.litert import load
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
model, cache = Path(sys.argv[1]), Path(sys.argv[2])
p = load_profile(profiles_dir() / "generic-x86_64.toml")
p = dataclasses.replace(p, runtime=dataclasses.replace(p.runtime, xnnpack_weight_cache_dir=cache))
m = load(model, p, cache_key=hashlib.sha256(model.read_bytes()).hexdigest())
print("LOADED", m.accelerator, m.runner.accelerator)
"""


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", 8 * MiB) as path:
        yield path


def _load(model: Path, cache: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(model), str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[3],
    )
    assert done.returncode == 0, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    assert "LOADED xnnpack" in done.stdout, done.stdout[-3000:]
    return done.stdout


@pytest.mark.parametrize("leave", [64 * 1024, 700 * 1024], ids=["no-copy", "copy-no-packing"])
def test_a_first_load_on_a_full_disk_serves_with_its_weights_packed_in_memory(
    tiny_model_dir: Path, fs: Path, leave: int
) -> None:
    """With room for nothing, or for the prepared copy but not the packed weights: the model
    loads (the copy, or the file itself), its weights packed in memory, one line saying why;
    no partial file is left in the directory."""
    model = tiny_model_dir / "model_int8.tflite"
    cache = fs / "xnnpack"
    fill(fs, leave=leave)
    out = _load(model, cache)
    assert "packing weights in memory" in out and "No space left" not in out.split("LOADED")[1]
    assert "needed to pack" in out, out
    left = sorted(p.name for p in cache.iterdir())
    assert not [n for n in left if n.endswith((".tmp", ".xnnpack"))], left
    if leave < model.stat().st_size:  # no room for the copy: ENOSPC while writing it
        assert "model not prepared for XNNPACK ([Errno 28]" in out
        assert not [n for n in left if ".tflite" in n], left


def test_a_first_load_writes_less_than_the_bound_the_updater_counts(
    tiny_model_dir: Path, fs: Path
) -> None:
    model = tiny_model_dir / "model_int8.tflite"
    before = free(fs)
    out = _load(model, fs / "xnnpack")
    written = before - free(fs)
    assert "packing weights in memory" not in out  # it had the room: both files written
    names = sorted(p.suffix for p in (fs / "xnnpack").iterdir())
    assert ".tflite" in names and ".xnnpack" in names, names
    assert written <= room.first_load_bound(model.stat().st_size), written
    assert written > model.stat().st_size  # the bound is not met by writing nothing
