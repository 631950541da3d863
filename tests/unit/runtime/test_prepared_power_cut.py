"""The prepared copy and the weight cache's files across a power cut at every boundary of
writing them (tests/support/lazyfs.py): a first load of the tiny model with the profile's
weight cache directory on the power-cut filesystem writes what reading the file found
(``.parse.json``), the prepared copy (``.tflite.unchecked``, renamed ``.tflite`` once checked)
and XNNPACK's packed weights (``.xnnpack``). After each cut a load again must reuse a whole
file or make it again, never run a torn one: its greedy tokens equal those of the original file
(`reference_greedy`, which shares nothing with `agent.runtime`). Each load runs in a process of
its own (a boot; and LiteRT would fault pages of the mount in while holding the GIL the
filesystem's thread in this process needs).

Each cut is made twice: as LazyFS drops it (a name not synced into its directory is gone) and
on a filesystem that commits names before data (`LazyFS.names_first`: every name made stays, a
file's content is what was last synced), where a rename can outlive the data it named."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agent.runtime import litert
from tests.support.lazyfs import LazyFS, every_cut, mounted
from tests.unit.runtime.test_prepared_check import PROMPT, STEPS, _runner_greedy, reference_greedy

pytestmark = pytest.mark.fuse

KEY = "c" * 64  # the cache key a load names the model's files after


def _load_greedy(model: Path, profile: Any) -> tuple[str, list[int]]:
    """In a process of its own: load `model` as the daemon does; what runs and its tokens."""
    loaded = litert.load(model, profile, cache_key=KEY)
    try:
        return loaded.prepared, _runner_greedy(loaded.runner, PROMPT, STEPS)[0]
    finally:
        loaded.runner.close()


def _in_a_process(model: Path, profile: Any) -> tuple[str, list[int]]:
    """A crash of the process raises (BrokenProcessPool), as a boot that dies does."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_load_greedy, model, profile).result(timeout=600)


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[tuple[LazyFS, Path]]:
    with mounted(tmp_path / "fs") as mount:
        yield mount


@pytest.fixture(scope="module")
def fused_model(tiny_model_factory: Any) -> Path:
    """Fused composites: the load makes a prepared copy (the composites inlined)."""
    return tiny_model_factory(layout="default", prefill_lens=(8,), kv_max=64)


@pytest.mark.parametrize("names_first", [False, True], ids=["lazyfs", "names-first"])
def test_a_cut_while_the_cache_files_are_written_never_serves_a_torn_one(
    fused_model: Path, make_profile: Any, lazyfs: tuple[LazyFS, Path], names_first: bool
) -> None:
    fs, mnt = lazyfs
    fs.names_first = names_first
    want, _ = reference_greedy(fused_model, PROMPT, STEPS)
    assert len(set(want)) > 1, "a degenerate model proves nothing"
    cache = mnt / "cache" / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache)})
    seen: list[str] = []

    def setup(m: Path) -> None:
        (m / "cache").mkdir()

    def operation(m: Path, done: list[Any]) -> None:
        seen.append(_in_a_process(fused_model, profile)[0])

    problems: list[str] = []

    def check(m: Path, done: list[Any], where: str) -> None:
        try:
            prepared, got = _in_a_process(fused_model, profile)
        except Exception as exc:  # the finding: a cut must not stop the next load
            problems.append(f"{where}: the load after the cut failed: {exc!r}")
            return
        if got != want:
            problems.append(f"{where}: tokens {got}, the original file gives {want}")
        if not prepared.startswith("composites inlined"):
            problems.append(f"{where}: the copy is not used: {prepared}")

    points = every_cut(fs, mnt, setup, operation, check)
    assert seen[0].startswith("composites inlined"), seen[0]  # the recording made a copy
    assert points > 6, points
    assert problems == [], "\n".join(problems)
