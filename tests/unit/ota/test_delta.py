"""Update deltas (``ea-delta-1``) on the real demo model: round trips, corruption, wrong bases,
the generic fallback, the streaming memory bound and the CLI.

Edits are made the way updates change a `.tflite`: tensor buffers rewritten in place (a
fine-tune), a re-export with renamed tensors and reordered buffers, tokenizer/metadata edits.
Diffs run at a low zstd level to keep the file fast; the format does not depend on it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import shutil
import struct
import tempfile
import tracemalloc
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.base.errors import AgentError
from agent.cli.model import add_delta_commands
from agent.model.directory import demo_model_dir, sha256_file
from agent.ota.delta import files as delta
from agent.ota.delta.files import DeltaError, DeltaStats
from agent.ota.delta.regions import Region, tflite_regions

LEVEL = 3
DEMO = demo_model_dir()
INT8 = DEMO / "model_int8.tflite"


@cache
def int8_bytes() -> bytes:
    return INT8.read_bytes()


@cache
def tensor_regions() -> tuple[Region, ...]:
    regions = tflite_regions(int8_bytes(), "demo")
    assert regions is not None
    return tuple(r for r in regions if r.key)


def finetune(data: bytearray, picks: list[int], seed: int, fraction: float = 0.3) -> None:
    """Nudge `fraction` of the int8 values of the picked tensors by ±1..3, in place."""
    rng = np.random.default_rng(seed)
    regions = tensor_regions()
    for i in picks:
        r = regions[i]
        a = np.frombuffer(data, np.int8, r.length, r.offset).astype(np.int16)
        mask = rng.random(a.size) < fraction
        a[mask] += rng.integers(1, 4, a.size)[mask] * rng.choice([-1, 1], a.size)[mask]
        data[r.offset : r.end] = np.clip(a, -127, 127).astype(np.int8).tobytes()


def no_temps(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture
def tuned(tmp_path: Path) -> Path:
    """The demo int8 model with three tensors fine-tuned."""
    data = bytearray(int8_bytes())
    finetune(data, [1, 5, 20], seed=1)
    path = tmp_path / "model_int8.tflite"
    path.write_bytes(data)
    return path


@pytest.fixture
def tuned_delta(tuned: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tuned.delta"
    delta.diff_file(INT8, tuned, out, level=LEVEL)
    return out


# ----------------------------------------------------------------------------- regions


@pytest.mark.parametrize("name", ["model_int8.tflite", "model_int4_block32.tflite"])
def test_regions_cover_the_file_and_hold_the_buffers(name: str) -> None:
    data = (DEMO / name).read_bytes()
    regions = tflite_regions(data, name)
    assert regions is not None
    assert regions[0].offset == 0 and regions[-1].end == len(data)
    assert all(a.end == b.offset for a, b in itertools.pairwise(regions))
    model = schema.Model.GetRootAs(data, 0)
    tensors = [r for r in regions if r.key]
    assert len(tensors) >= 30
    for r in tensors:
        b = model.Buffers(r.ordinal)
        inline = b.DataAsNumpy()
        expect = inline.tobytes() if b.DataLength() else data[b.Offset() : b.Offset() + b.Size()]
        assert data[r.offset : r.end] == expect


def test_a_file_that_is_not_tflite_has_no_regions() -> None:
    assert tflite_regions(b"\x00" * 64, "x") is None
    assert tflite_regions(b"\x10\x00\x00\x00TFL3" + b"\xff" * 100, "x") is None


# ----------------------------------------------------------------------------- round trips


def test_fine_tune_round_trip_is_small(tuned: Path, tuned_delta: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.tflite"
    delta.patch_file(INT8, tuned_delta, out)
    assert out.read_bytes() == tuned.read_bytes()
    assert tuned_delta.stat().st_size < 0.02 * tuned.stat().st_size
    [entry] = delta.read_header(tuned_delta)
    assert (entry.name, entry.size, entry.method) == (
        "model_int8.tflite",
        len(int8_bytes()),
        "tflite",
    )
    assert entry.sha256 == sha256_file(tuned) and entry.base_sha256 == sha256_file(INT8)


def test_identical_directories_are_all_copies(tmp_path: Path) -> None:
    out = tmp_path / "same.delta"
    stats = delta.diff_dirs(DEMO, DEMO, out, level=LEVEL)
    names = sorted(p.name for p in DEMO.iterdir() if p.is_file())
    assert stats.files == len(names) and stats.copied_bytes == stats.target_bytes
    assert stats.delta_bytes < 4096
    files = delta.patch_dirs(DEMO, out, tmp_path / "new")
    assert [f[0] for f in files] == names
    for name, sha, size in files:
        assert sha == sha256_file(DEMO / name) == sha256_file(tmp_path / "new" / name)
        assert size == (DEMO / name).stat().st_size


def test_directory_update_round_trip(tmp_path: Path) -> None:
    """Fine-tuned int8, re-scored tokenizer, new metadata, a dropped variant, a new file."""
    new = tmp_path / "v2"
    shutil.copytree(DEMO, new)
    (new / "model_int4_block64.tflite").unlink()
    data = bytearray(int8_bytes())
    finetune(data, [0, 3], seed=2)
    (new / "model_int8.tflite").write_bytes(data)
    tok = bytearray((new / "tokenizer.model").read_bytes())
    tok[1000:1010] = bytes(10)
    (new / "tokenizer.model").write_bytes(tok)
    meta = json.loads((new / "metadata.json").read_text())
    meta["version"] = "1.1.0"
    (new / "metadata.json").write_text(json.dumps(meta, indent=2))
    (new / "NOTES.txt").write_text("fine-tuned on more stdlib\n")

    out = tmp_path / "v2.delta"
    stats = delta.diff_dirs(DEMO, new, out, level=LEVEL)
    assert stats.files == 5
    methods = {e.name: (e.method, e.base_name) for e in delta.read_header(out)}
    assert methods == {
        "NOTES.txt": ("generic", ""),
        "metadata.json": ("generic", "metadata.json"),
        "model_int4_block32.tflite": ("same", "model_int4_block32.tflite"),
        "model_int8.tflite": ("tflite", "model_int8.tflite"),
        "tokenizer.model": ("generic", "tokenizer.model"),
    }
    files = delta.patch_dirs(DEMO, out, tmp_path / "rebuilt")
    assert {f[0] for f in files} == {p.name for p in new.iterdir()}
    for name, sha, _ in files:
        assert (tmp_path / "rebuilt" / name).read_bytes() == (new / name).read_bytes()
        assert sha == sha256_file(new / name)
    assert no_temps(tmp_path / "rebuilt")


def test_requantization_round_trip(tmp_path: Path) -> None:
    """int8 -> int4: every tensor differs in size; the structure is diffed against the base."""
    target = DEMO / "model_int4_block32.tflite"
    out = tmp_path / "requant.delta"
    stats = delta.diff_file(INT8, target, out, level=LEVEL)
    assert stats.delta_bytes < target.stat().st_size
    delta.patch_file(INT8, out, tmp_path / "int4.tflite")
    assert sha256_file(tmp_path / "int4.tflite") == sha256_file(target)


@cache
def reexported() -> bytes:
    """The int8 model written again through the object API: every buffer inline, in reverse
    order, and 40 tensors renamed (so the structure changes and nothing stays in place)."""
    from ai_edge_litert.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model_from_bytearray(bytearray(int8_bytes()))
    order = [0, *reversed(range(1, len(model.buffers)))]
    index = {old: new for new, old in enumerate(order)}
    model.buffers = [model.buffers[i] for i in order]
    for sg in model.subgraphs:
        for t in sg.tensors:
            t.buffer = index[t.buffer]
    for t in model.subgraphs[0].tensors[:40]:
        t.name = t.name + b"_v2"
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))


def test_renamed_and_reordered_tensors_are_copied(tmp_path: Path) -> None:
    new = tmp_path / "model_int8.tflite"
    new.write_bytes(reexported())
    out = tmp_path / "reorder.delta"
    stats = delta.diff_file(INT8, new, out, level=LEVEL)
    weights = sum(r.length for r in tensor_regions())
    assert stats.copied_bytes >= weights
    assert stats.delta_bytes < 0.02 * stats.target_bytes
    delta.patch_file(INT8, out, tmp_path / "out.tflite")
    assert (tmp_path / "out.tflite").read_bytes() == reexported()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    edits=st.lists(
        st.tuples(
            st.integers(0, 10_000),  # which tensor (mod the count)
            st.floats(0.0, 1.0),  # where in it the edit starts
            st.integers(1, 4096),  # how many bytes
            st.binary(min_size=1, max_size=64),  # the bytes, repeated
        ),
        min_size=1,
        max_size=6,
    ),
    structure=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 255)), max_size=3),
)
def test_round_trip_on_random_tensor_edits(
    edits: list[tuple[int, float, int, bytes]], structure: list[tuple[int, int]]
) -> None:
    data = bytearray(int8_bytes())
    regions = tensor_regions()
    for which, where, n, pattern in edits:
        r = regions[which % len(regions)]
        start = r.offset + int(where * (r.length - 1))
        n = min(n, r.end - start)
        data[start : start + n] = (pattern * (n // len(pattern) + 1))[:n]
    for pos, value in structure:  # the flatbuffer's own bytes: may break the parse (generic)
        data[pos] = value
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        new, out, rebuilt = tmp / "new.tflite", tmp / "d.delta", tmp / "rebuilt.tflite"
        new.write_bytes(data)
        delta.diff_file(INT8, new, out, level=1)
        delta.patch_file(INT8, out, rebuilt)
        assert rebuilt.read_bytes() == data


# ----------------------------------------------------------------------------- failures


def _flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x41]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.floats(0.0, 1.0, exclude_max=True))
def test_any_flipped_byte_is_refused_and_leaves_nothing(where: float) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        new = tmp / "model_int8.tflite"
        data = bytearray(int8_bytes())
        finetune(data, [2], seed=3)
        new.write_bytes(data)
        bad = tmp / "bad.delta"
        delta.diff_file(INT8, new, bad, level=LEVEL)
        _flip(bad, int(where * bad.stat().st_size))
        out_dir = tmp / "out"
        out_dir.mkdir()
        with pytest.raises(DeltaError):
            delta.patch_file(INT8, bad, out_dir / "model_int8.tflite")
        assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("keep", [0, 5, 100, -40, -33, -1])
def test_truncated_delta_is_refused(keep: int, tuned_delta: Path, tmp_path: Path) -> None:
    data = tuned_delta.read_bytes()
    cut = tmp_path / "cut.delta"
    cut.write_bytes(data[:keep] if keep >= 0 else data[: len(data) + keep])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(DeltaError):
        delta.patch_file(INT8, cut, out_dir / "x.tflite")
    assert list(out_dir.iterdir()) == []


def test_trailing_bytes_are_refused(tuned_delta: Path, tmp_path: Path) -> None:
    with open(tuned_delta, "ab") as f:
        f.write(b"\x00")
    with pytest.raises(DeltaError, match="after the trailer"):
        delta.patch_file(INT8, tuned_delta, tmp_path / "x.tflite")
    assert not (tmp_path / "x.tflite").exists()


def test_wrong_base_is_refused_naming_the_file(tuned_delta: Path, tmp_path: Path) -> None:
    wrong = DEMO / "model_int4_block32.tflite"
    with pytest.raises(DeltaError, match=r"model_int8\.tflite: base .* expects") as exc:
        delta.patch_file(wrong, tuned_delta, tmp_path / "x.tflite")
    assert isinstance(exc.value, AgentError)
    assert not (tmp_path / "x.tflite").exists() and no_temps(tmp_path)


def test_wrong_or_missing_base_in_a_directory(tmp_path: Path) -> None:
    new = tmp_path / "new"
    shutil.copytree(DEMO, new)
    (new / "tokenizer.model").write_bytes((DEMO / "tokenizer.model").read_bytes()[:-100])
    out = tmp_path / "d.delta"
    delta.diff_dirs(DEMO, new, out, level=LEVEL)
    base = tmp_path / "base"
    shutil.copytree(DEMO, base)
    (base / "tokenizer.model").write_bytes(b"not the tokenizer")
    with pytest.raises(DeltaError, match=r"tokenizer\.model: base"):
        delta.patch_dirs(base, out, tmp_path / "rebuilt")
    assert not (tmp_path / "rebuilt").exists()  # created here, removed again
    (base / "tokenizer.model").unlink()
    with pytest.raises(
        DeltaError, match=r"tokenizer\.model: base file tokenizer\.model is missing"
    ):
        delta.patch_dirs(base, out, tmp_path / "rebuilt")


def test_output_directory_must_be_empty(tmp_path: Path) -> None:
    out = tmp_path / "same.delta"
    delta.diff_dirs(DEMO, DEMO, out, level=LEVEL)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(DeltaError, match="must not exist or be empty"):
        delta.patch_dirs(DEMO, out, busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_a_file_level_patch_refuses_a_directory_delta(tmp_path: Path) -> None:
    out = tmp_path / "same.delta"
    delta.diff_dirs(DEMO, DEMO, out, level=LEVEL)
    with pytest.raises(DeltaError, match="use patch_dirs"):
        delta.patch_file(INT8, out, tmp_path / "x")


def test_header_checksum_and_magic(tuned_delta: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.delta"
    data = bytearray(tuned_delta.read_bytes())
    (n,) = struct.unpack_from("<I", data, 11)
    data[15 + n // 2] ^= 1
    bad.write_bytes(data)
    with pytest.raises(DeltaError, match="header checksum"):
        delta.read_header(bad)
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(DeltaError, match="not an ea-delta-1 delta"):
        delta.read_header(bad)


# ----------------------------------------------------------------------------- generic


def test_generic_fallback_for_tokenizer_and_a_broken_tflite(tmp_path: Path) -> None:
    tok = bytearray((DEMO / "tokenizer.model").read_bytes())
    tok[500:500] = b"\x0a\x05hello"
    (tmp_path / "tokenizer.model").write_bytes(tok)
    stats = delta.diff_file(DEMO / "tokenizer.model", tmp_path / "tokenizer.model", tmp_path / "t")
    assert delta.read_header(tmp_path / "t")[0].method == "generic"
    assert stats.patched_bytes == len(tok) and stats.delta_bytes < 1000
    delta.patch_file(DEMO / "tokenizer.model", tmp_path / "t", tmp_path / "tok.out")
    assert (tmp_path / "tok.out").read_bytes() == tok

    broken = bytearray(int8_bytes())
    broken[0:4] = b"\xff\xff\xff\x7f"  # root table offset far outside the file
    (tmp_path / "b.tflite").write_bytes(broken)
    delta.diff_file(INT8, tmp_path / "b.tflite", tmp_path / "b", level=LEVEL)
    assert delta.read_header(tmp_path / "b")[0].method == "generic"
    delta.patch_file(INT8, tmp_path / "b", tmp_path / "b.out")
    assert (tmp_path / "b.out").read_bytes() == broken


# ----------------------------------------------------------------------------- memory


def test_patch_memory_is_bounded_by_the_tensors_not_the_model(
    tuned: Path, tuned_delta: Path, tmp_path: Path
) -> None:
    largest = max(r.length for r in tensor_regions())
    tracemalloc.start()
    try:
        delta.patch_file(INT8, tuned_delta, tmp_path / "out.tflite")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = tuned.stat().st_size
    assert peak < size / 2 and peak < 3 * largest, (peak, size, largest)


def test_stats_add_up(tuned: Path, tmp_path: Path) -> None:
    stats = delta.diff_file(INT8, tuned, tmp_path / "d", level=LEVEL)
    assert isinstance(stats, DeltaStats)
    assert stats.copied_bytes + stats.data_bytes + stats.patched_bytes == stats.target_bytes
    assert stats.delta_bytes == (tmp_path / "d").stat().st_size


# ----------------------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edge-agent")
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model")
    add_delta_commands(model.add_subparsers(dest="model_command", required=True))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_cli_diff_and_patch_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.delta"
    assert (
        _cli(["model", "diff", str(DEMO), str(DEMO), "-o", str(out), "--json", "--level", "3"]) == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"] == 5 and doc["delta_bytes"] == out.stat().st_size
    assert _cli(["model", "patch", str(DEMO), str(out), "-o", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "5 file(s) rebuilt and verified" in text
    assert sha256_file(tmp_path / "o" / "model_int8.tflite") == sha256_file(INT8)


def test_cli_files_and_mixed_arguments(
    tuned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "f.delta"
    assert _cli(["model", "diff", str(INT8), str(tuned), "-o", str(out), "--level", "3"]) == 0
    assert "of the 1 target file(s)" in capsys.readouterr().out
    assert _cli(["model", "patch", str(INT8), str(out), "-o", str(tmp_path / "x.tflite")]) == 0
    assert (tmp_path / "x.tflite").read_bytes() == tuned.read_bytes()
    with pytest.raises(DeltaError, match="both be files or both be model directories"):
        _cli(["model", "diff", str(DEMO), str(tuned), "-o", str(tmp_path / "m")])


def test_demo_model_is_mapped_not_read_by_the_region_parser() -> None:
    with open(INT8, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        regions = tflite_regions(m, str(INT8))
    assert regions is not None and sum(r.length for r in regions) == os.path.getsize(INT8)
