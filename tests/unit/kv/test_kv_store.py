"""KV storage below the bound tier: file format, disk tier, byte-bounded LRU, prefix cache.

Real files under tmp_path, no mocks: failures are made with real file-system conditions.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import resource
import shutil
import signal
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agent.base.errors import InvalidRequest, NotFound, SessionLost, Unavailable, grpc_status_name
from agent.kv import codec
from agent.kv.disk import DiskTier, Stored
from agent.kv.lru import ByteLRU
from agent.kv.prefix import PrefixCache, block_hashes
from agent.kv.snapshot import KVSnapshot

MODEL_A = hashlib.sha256(b"model a").hexdigest()
MODEL_B = hashlib.sha256(b"model b").hexdigest()
META = {"owner_uid": 1000, "policy": "chat", "created": 1.7e9, "last_used": 1.7e9 + 0.5}
MIB = 1 << 20


def make_snapshot(
    tokens: Sequence[int], model: str = MODEL_A, seed: int = 0, width: int = 8
) -> KVSnapshot:
    """KV rows of `tokens` in three dtypes; the V array is a non-contiguous slice, as in a
    transposed cache whose used rows are the leading part of the last axis."""
    rows = len(tokens)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, 2, rows, width), dtype=np.float32)
    v_cache = rng.standard_normal((1, 2, width, max(rows, 32))).astype(np.float16)
    scales = rng.integers(-128, 128, size=(rows, 4), dtype=np.int8)
    arrays = {"kv_cache_k_0": k, "kv_cache_v_0": v_cache[..., :rows], "scales": scales}
    return KVSnapshot(model, tuple(tokens), arrays)


def files(tier: DiskTier) -> list[str]:
    return sorted(os.listdir(tier.dir))


# ---------------------------------------------------------------------------------- file format


@settings(max_examples=60, deadline=None)
@given(
    arrays=st.dictionaries(
        st.text("abcdefgh_0123", min_size=1, max_size=8),
        hnp.arrays(
            st.sampled_from(["<f4", "<f2", "|i1", "|u1", "<i4", ">f4", "<f8", "|b1", "<c8"]),
            hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
        ),
        max_size=4,
    ),
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=20),
    meta=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
)
def test_codec_round_trip_is_bit_exact(
    arrays: dict[str, np.ndarray[Any, Any]], tokens: list[int], meta: dict[str, Any]
) -> None:
    snap = KVSnapshot(MODEL_A, tuple(tokens), arrays)
    buf = io.BytesIO()
    codec.encode(snap, meta).write_to(buf)
    assert len(buf.getvalue()) == codec.encode(snap, meta).nbytes
    buf.seek(0)
    header = codec.read_header(buf, len(buf.getvalue()))
    back = codec.read_snapshot(buf, header)
    assert back.same_as(snap)
    assert header.meta == meta
    assert header.file_bytes == len(buf.getvalue())


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", ">f4", "bool"])
def test_disk_round_trip_is_bit_exact(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((1, 3, 5, 4)) * 50).astype(dtype)
    if a.dtype.kind == "f":  # NaN payloads, -0.0 and inf must survive as bytes
        flat = a.reshape(-1)
        flat[:3] = [np.nan, -0.0, np.inf]
        bits = flat.view(f"u{a.dtype.itemsize}")
        bits[0] |= 1
    arrays = {"kv": a, "strided": a[:, :, ::2], "empty": a[:, :, :0], "scalar": a[0, 0, 0, 0, ...]}
    snap = KVSnapshot(MODEL_A, (5, 6, 7, 8, 9), arrays)
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    assert tier.put("abc", snap, META) == Stored(True)
    back, meta = tier.get("abc")
    assert back.same_as(snap)
    assert meta == META
    assert back.arrays["kv"].tobytes() == a.tobytes()
    assert back.arrays["scalar"].shape == ()


def test_sessions_survive_a_restart_in_lru_order(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    snaps = {key: make_snapshot(range(1, 6), seed=i) for i, key in enumerate(["s1", "s2", "s3"])}
    for key, snap in snaps.items():
        assert tier.put(key, snap, META | {"key": key}).ok
    tier.get("s1")
    assert tier.keys() == ["s2", "s3", "s1"]

    again = DiskTier(tmp_path, MODEL_A, MIB)
    assert again.keys() == ["s2", "s3", "s1"]
    assert (
        again.usage_bytes
        == tier.usage_bytes
        == sum((tmp_path / "sessions" / f"{k}.kv").stat().st_size for k in snaps)
    )
    entries = {e.key: e for e in again.entries()}
    assert entries["s2"].tokens == 5
    assert entries["s2"].meta == META | {"key": "s2"}
    assert entries["s2"].last_used < entries["s3"].last_used < entries["s1"].last_used
    for key, snap in snaps.items():
        back, meta = again.get(key)
        assert back.same_as(snap)
        assert meta["key"] == key


# ---------------------------------------------------------------------------------- invalidation


def test_files_of_another_model_are_deleted_on_startup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = DiskTier(tmp_path, MODEL_A, MIB)
    old.put("s1", make_snapshot([1, 2, 3]), META)
    old.put("s2", make_snapshot([1, 2, 3]), META)
    caplog.set_level(logging.INFO, logger="agent.kv.disk")
    new = DiskTier(tmp_path, MODEL_B, MIB)
    assert len(new) == 0
    assert files(new) == []
    assert "invalidated 2 saved sessions: model changed" in caplog.text


def test_get_of_a_file_from_another_model_loses_the_session(tmp_path: Path) -> None:
    tier_a = DiskTier(tmp_path, MODEL_A, MIB)
    tier_b = DiskTier(tmp_path, MODEL_B, MIB)
    assert tier_b.put("s1", make_snapshot([1, 2, 3], model=MODEL_B), META).ok
    with pytest.raises(SessionLost, match=r"session s1: .*another model.*the session is lost"):
        tier_a.get("s1")
    assert files(tier_a) == []
    with pytest.raises(NotFound):
        tier_a.get("s1")


def test_put_of_another_models_snapshot_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    stored = tier.put("s1", make_snapshot([1], model=MODEL_B), META)
    assert not stored.ok and "another model" in stored.reason
    assert files(tier) == []


def _stored_file(tmp_path: Path) -> tuple[DiskTier, Path, bytes]:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    assert tier.put("bad", make_snapshot([5, 17, 29, 3]), META).ok
    assert tier.put("good", make_snapshot([5, 17, 29, 3], seed=2), META).ok
    path = tier.dir / "bad.kv"
    return tier, path, path.read_bytes()


def _assert_lost(tier: DiskTier, why: str) -> None:
    with pytest.raises(SessionLost, match=f"session bad: .*{why}.*; the session is lost") as info:
        tier.get("bad")
    assert grpc_status_name(info.value) == "DATA_LOSS"
    assert files(tier) == ["good.kv"]
    assert "bad" not in tier
    assert tier.get("good")[0].same_as(make_snapshot([5, 17, 29, 3], seed=2))


@pytest.mark.parametrize("where", ["empty", "magic", "preamble", "header", "data", "last_byte"])
def test_truncated_file_loses_only_that_session(tmp_path: Path, where: str) -> None:
    tier, path, raw = _stored_file(tmp_path)
    header_end = codec.PREAMBLE.size + int.from_bytes(raw[8:12], "little")
    cut = {
        "empty": 0,
        "magic": 3,
        "preamble": codec.PREAMBLE.size,
        "header": header_end - 7,
        "data": (header_end + len(raw)) // 2,
        "last_byte": len(raw) - 1,
    }[where]
    path.write_bytes(raw[:cut])
    _assert_lost(tier, r"corrupted \((truncated at|\d+ bytes where the header says)")


@pytest.mark.parametrize(
    "where", ["magic", "version", "header_token", "header_json", "data", "sum"]
)
def test_flipped_byte_loses_only_that_session(tmp_path: Path, where: str) -> None:
    tier, path, raw = _stored_file(tmp_path)
    header_end = codec.PREAMBLE.size + int.from_bytes(raw[8:12], "little")
    at = {
        "magic": 1,
        "version": 4,
        "header_token": raw.index(b'"tokens":[5') + 10,  # "5" -> "4": valid JSON, wrong sum
        "header_json": raw.index(b'"tokens"'),  # '"' -> '#': not JSON any more
        "data": (header_end + len(raw)) // 2,
        "sum": len(raw) - 1,
    }[where]
    flipped = bytearray(raw)
    flipped[at] ^= 0x01 if where == "header_token" else 0x04
    path.write_bytes(bytes(flipped))
    why = {"magic": "bad magic", "version": "unknown format version", "header_json": "malformed"}
    _assert_lost(tier, "corrupted .*" + why.get(where, "checksum mismatch"))


def test_corrupt_and_temp_files_are_cleaned_up_on_startup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier, path, raw = _stored_file(tmp_path)
    path.write_bytes(raw[: len(raw) // 2])
    (tier.dir / ".good.x1y2.tmp").write_bytes(raw[:100])
    (tier.dir / "notes.txt").write_text("not ours: left alone")
    caplog.set_level(logging.INFO, logger="agent.kv.disk")
    again = DiskTier(tmp_path, MODEL_A, MIB)
    assert files(again) == ["good.kv", "notes.txt"]
    assert again.keys() == ["good"]
    assert "deleted 1 saved sessions: corrupt or truncated" in caplog.text
    assert "deleted 1 temp files" in caplog.text


# ---------------------------------------------------------------------------------- budget


def test_budget_evicts_least_recently_used_other_sessions(tmp_path: Path) -> None:
    one = codec.encode(make_snapshot(range(8)), META).nbytes
    tier = DiskTier(tmp_path, MODEL_A, 3 * one + 10)
    for i, key in enumerate(["a", "b", "c"]):
        assert tier.put(key, make_snapshot(range(8), seed=i), META).ok
    tier.get("a")
    stored = tier.put("d", make_snapshot(range(8), seed=3), META)
    assert stored.ok and stored.evicted == ("b",)
    assert tier.keys() == ["c", "a", "d"]
    assert files(tier) == ["a.kv", "c.kv", "d.kv"]
    assert tier.usage_bytes == 3 * one <= tier.budget_bytes
    # Replacing a session does not count its old copy: nothing else is evicted.
    assert tier.put("c", make_snapshot(range(8), seed=4), META) == Stored(True)
    # A smaller budget after a restart evicts down to it, least recently used first.
    assert DiskTier(tmp_path, MODEL_A, 2 * one).keys() == ["d", "c"]


def test_snapshot_bigger_than_the_budget_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path, MODEL_A, 1000)
    assert tier.put("small", make_snapshot([1]), {}).ok
    stored = tier.put("big", make_snapshot(range(30)), META)
    assert not stored.ok and stored.evicted == ()
    assert "disk tier holds 1000" in stored.reason
    assert files(tier) == ["small.kv"]
    assert caplog.text.count("session big not saved to disk") == 1


def test_budget_zero_is_off(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MODEL_A, 0)
    assert tier.disabled is not None
    assert not tier.put("s1", make_snapshot([1]), {}).ok
    assert not (tmp_path / "sessions").exists()
    with pytest.raises(NotFound):
        tier.get("s1")


def test_unstorable_dtype_or_meta_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    objects = KVSnapshot(MODEL_A, (1,), {"kv": np.array([object()])})
    assert "dtype" in tier.put("s1", objects, {}).reason
    assert "JSON" in tier.put("s1", make_snapshot([1]), {"t": float("nan")}).reason
    assert files(tier) == []


# ---------------------------------------------------------------------------------- OS failures


def test_directory_that_cannot_be_created_disables_the_tier(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("a regular file")
    tier = DiskTier(tmp_path / "afile" / "x", MODEL_A, MIB)  # NotADirectoryError, even for root
    assert tier.disabled is not None and "cannot use" in tier.disabled
    stored = tier.put("s1", make_snapshot([1]), META)
    assert not stored.ok and stored.reason == tier.disabled
    with pytest.raises(NotFound):
        tier.get("s1")
    assert not tier.delete("s1")
    assert tier.entries() == []


def test_unwritable_directory_is_a_refusal_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    assert tier.put("old", make_snapshot([1, 2]), META).ok
    tier.dir.chmod(0o500)
    try:
        if os.access(tier.dir, os.W_OK):
            # Root writes through mode bits: put a regular file where the directory was,
            # which fails with NotADirectoryError for everyone.
            tier.dir.chmod(0o700)
            shutil.rmtree(tier.dir)
            tier.dir.write_text("not a directory")
        stored = tier.put("new", make_snapshot([1, 2, 3]), META)
    finally:
        if tier.dir.is_dir():
            tier.dir.chmod(0o700)
    assert not stored.ok and "cannot write" in stored.reason
    assert "session new not saved to disk" in caplog.text
    assert "new" not in tier
    if tier.dir.is_dir():
        assert files(tier) == ["old.kv"]


def test_write_failing_midway_keeps_the_old_copy_and_no_temp_file(tmp_path: Path) -> None:
    # A full disk (ENOSPC) needs a small filesystem we cannot mount here. RLIMIT_FSIZE gives the
    # same shape of failure without root or mocks: write() fails (EFBIG) part-way through a file.
    tier = DiskTier(tmp_path, MODEL_A, 64 * MIB)
    small = make_snapshot([1, 2])
    assert tier.put("s1", small, META).ok
    big = make_snapshot(range(32), width=512)
    limit = codec.encode(big, META).nbytes // 2
    assert limit > (tier.dir / "s1.kv").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        stored = tier.put("s1", big, META)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert not stored.ok and "File too large" in stored.reason
    assert files(tier) == ["s1.kv"]
    assert tier.get("s1")[0].same_as(small)


def test_out_of_file_descriptors_is_unavailable_and_keeps_the_file(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    snap = make_snapshot([1, 2, 3])
    assert tier.put("s1", snap, META).ok
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # the next open(): EMFILE
    try:
        with pytest.raises(Unavailable, match="s1"):
            tier.get("s1")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert tier.get("s1")[0].same_as(snap)


# ---------------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key", ["", "../x", "a/b", ".", "..", ".hidden", "a b", "é", "x" * 129])
def test_bad_session_keys_are_invalid_requests(tmp_path: Path, key: str) -> None:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    with pytest.raises(InvalidRequest):
        tier.put(key, make_snapshot([1]), {})
    with pytest.raises(InvalidRequest):
        tier.get(key)
    with pytest.raises(InvalidRequest):
        tier.delete(key)
    assert files(tier) == []


def test_missing_and_deleted_sessions_are_not_found(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, MODEL_A, MIB)
    with pytest.raises(NotFound):
        tier.get("nope")
    tier.put("s1", make_snapshot([1]), {})
    assert "s1" in tier
    assert tier.delete("s1")
    assert not tier.delete("s1")
    assert "s1" not in tier and files(tier) == []
    with pytest.raises(NotFound):
        tier.get("s1")


# ---------------------------------------------------------------------------------- ByteLRU

_OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get", "pop"]), st.sampled_from("abcde"), st.integers(0, 40)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 100), ops=_OPS)
def test_byte_lru_matches_a_simple_model(budget: int, ops: list[tuple[str, str, int]]) -> None:
    lru: ByteLRU[str, int] = ByteLRU(budget)
    model: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (value, nbytes), LRU first
    live: set[int] = set()  # every value put and not yet handed back, popped or replaced
    for serial, (op, key, nbytes) in enumerate(ops):
        if op == "put":
            replaced = lru.peek(key)
            evicted = lru.put(key, serial, nbytes)
            model.pop(key, None)
            expected: list[tuple[str, int]] = []
            if nbytes > budget:
                expected.append((key, serial))
            else:
                while sum(n for _, n in model.values()) + nbytes > budget:
                    old_key, (old_value, _) = model.popitem(last=False)
                    expected.append((old_key, old_value))
                model[key] = (serial, nbytes)
            assert evicted == expected
            if replaced is not None:
                live.discard(replaced)
            live.add(serial)
            live -= {value for _, value in evicted}
        elif op == "get":
            assert lru.get(key) == (model[key][0] if key in model else None)
            if key in model:
                model.move_to_end(key)
        else:
            value = lru.pop(key)
            assert value == (model.pop(key)[0] if key in model else None)
            if value is not None:
                live.discard(value)
        assert lru.keys() == list(model)
        assert lru.usage_bytes == sum(n for _, n in model.values()) <= budget
        assert set(map(lru.peek, lru.keys())) == live


def test_byte_lru_refuses_an_item_larger_than_the_budget() -> None:
    lru: ByteLRU[str, str] = ByteLRU(10)
    assert lru.put("a", "A", 6) == []
    assert lru.put("b", "B", 11) == [("b", "B")]
    assert lru.keys() == ["a"] and lru.usage_bytes == 6
    assert lru.put("a", "A2", 11) == [("a", "A2")]  # the older "a" is dropped: it was replaced
    assert len(lru) == 0 and lru.usage_bytes == 0


# ---------------------------------------------------------------------------------- prefix cache


def test_block_hashes_are_chained_and_cover_full_blocks_only() -> None:
    tokens = list(range(100, 110))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    assert block_hashes(tokens[:8], 4) == hashes
    changed_first = block_hashes([0, *tokens[1:]], 4)
    assert changed_first[0] != hashes[0] and changed_first[1] != hashes[1]
    changed_second = block_hashes([*tokens[:4], 0, *tokens[5:]], 4)
    assert changed_second[0] == hashes[0] and changed_second[1] != hashes[1]
    assert block_hashes(tokens[:3], 4) == []


def test_prefix_cache_finds_the_longest_stored_prefix() -> None:
    prompt = list(range(1, 15))  # 3 full blocks of 4, then 2 tokens
    cache = PrefixCache(MIB, block=4)
    one, two = make_snapshot(prompt[:4]), make_snapshot(prompt[:8])
    assert cache.insert(prompt, one) and cache.insert(prompt, two)
    assert cache.entries == 2 and cache.usage_bytes == one.nbytes + two.nbytes
    assert cache.lookup(prompt) is two
    assert cache.lookup(prompt[:7]) is one  # the partial second block does not count
    assert cache.lookup([*prompt[:5], 99, *prompt[6:]]) is one  # diverges in block 2
    assert cache.lookup([99, *prompt[1:]]) is None
    assert cache.lookup(prompt[:3]) is None
    assert (cache.hits, cache.misses) == (3, 2)


def test_prefix_cache_insert_checks_the_snapshot() -> None:
    cache = PrefixCache(MIB, block=4)
    prompt = list(range(1, 15))
    with pytest.raises(ValueError, match="multiple of 4"):
        cache.insert(prompt, make_snapshot(prompt[:6]))  # not trimmed to whole blocks
    with pytest.raises(ValueError, match="multiple of 4"):
        cache.insert(prompt, make_snapshot([]))
    with pytest.raises(ValueError, match="not a prefix"):
        cache.insert(prompt, make_snapshot([9, 9, 9, 9]))
    assert cache.entries == 0


def test_prefix_cache_survives_a_hash_collision() -> None:
    cache = PrefixCache(MIB, block=4)
    stored = list(range(1, 9))
    other = [*stored[:4], 50, 51, 52, 53]
    cache.insert(stored, make_snapshot(stored[:4]))
    # Make `other`'s two-block hash point at a snapshot of different tokens, as a collision would.
    impostor = make_snapshot(stored)
    cache._lru.put(block_hashes(other, 4)[-1], impostor, impostor.nbytes)
    found = cache.lookup(other)
    assert found is not None and found.tokens == tuple(stored[:4])  # the shorter true prefix
    assert cache.lookup([60, 61, 62, 63, *other[4:]]) is None


def test_prefix_cache_evicts_least_recently_used_prefixes() -> None:
    prompts = [[i] * 4 for i in range(1, 4)]
    size = make_snapshot(prompts[0]).nbytes
    cache = PrefixCache(2 * size, block=4)
    cache.insert(prompts[0], make_snapshot(prompts[0]))
    cache.insert(prompts[1], make_snapshot(prompts[1]))
    assert cache.lookup(prompts[0]) is not None  # now the most recently used
    cache.insert(prompts[2], make_snapshot(prompts[2]))
    assert cache.entries == 2 and cache.usage_bytes <= 2 * size
    assert cache.lookup(prompts[1]) is None
    assert cache.lookup(prompts[0]) is not None and cache.lookup(prompts[2]) is not None
    assert not PrefixCache(size - 1, block=4).insert(prompts[0], make_snapshot(prompts[0]))
