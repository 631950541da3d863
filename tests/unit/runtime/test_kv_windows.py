"""KV windows: decode signatures over shorter KV lengths in one file, used while they hold a
session, with the rows moved up when it grows (CompiledModel path)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.model.tflite import layout as kv_layout
from agent.model.tflite.file import read_model_file
from agent.model.tflite.layout import discover_layout
from agent.runtime import litert
from agent.runtime.prepare import cachefiles
from agent.runtime.prepare.inline import prepare_file
from agent.runtime.prepare.model import prepared_model
from agent.toolchain.export import ExportOptions

P = f"p{cachefiles.PREPARED_FORMAT}"  # the prepared copies' format, in their names

WINDOWS = (16, 32)
PROMPT = [1, 17, 33, 5, 200, 9, 41, 42, 43, 7, 99, 120, 3, 18, 64, 65, 66, 12, 250, 8]


@pytest.fixture(scope="module")
def windowed(tiny_model_factory):
    return tiny_model_factory(prefill_lens=(8,), kv_max=64, decode_windows=WINDOWS)


def kv_bytes(window: int) -> int:  # the tiny model: 2 layers x (K + V) x 1 head x 32 dims, fp32
    return 2 * 2 * window * 32 * 4


def test_the_layout_lists_each_window_with_its_own_signatures(windowed) -> None:
    layout = discover_layout(read_model_file(windowed))
    assert [w.length for w in layout.all_windows()] == [16, 32, 64]
    assert [[s.key for s in w.signatures] for w in layout.windows] == [
        ["kv16_prefill_8", "kv16_decode"],
        ["kv32_prefill_8", "kv32_decode"],
    ]
    assert layout.windows[0].kv.k_shape == (1, 1, 16, 32)
    assert layout.windows[0].kv.v_shape == (1, 1, 32, 16)
    assert layout.context_length == 64 and layout.decode.key == "decode"
    assert [layout.window_for(n) for n in (0, 16, 17, 32, 33, 64)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("lengths", "window", "want"),
    [
        ((32, 128, 512), 256, 32),  # SmolLM's exports: 32 serves every window
        ((8, 32, 128, 512), 2048, 32),  # not 8: a long prompt would take 8 tokens a call
        ((64, 128), 256, 64),
        ((8,), 16, 8),  # nothing of 32 or more fits: the longest that does
        ((8, 16), 32, 16),
        ((32, 128), 32, None),  # none shorter than the window
    ],
)
def test_a_window_added_at_load_gets_one_prefill_length(lengths, window, want) -> None:
    assert kv_layout.window_prefill(lengths, window) == want


def test_the_export_refuses_windows_that_are_not_shorter() -> None:
    with pytest.raises(ValueError, match="decode windows"):
        ExportOptions(kv_max=64, prefill_lens=(8,), decode_windows=(64,))
    opts = ExportOptions(kv_max=64, prefill_lens=(8, 32), decode_windows=(32, 16))
    assert opts.decode_windows == (16, 32)
    assert ExportOptions(kv_max=64, prefill_lens=(8, 32)).window_prefill_lens(32) == (8,)


def _greedy(runner, prompt, until):
    """Prefill, then greedy decode up to position `until`; logits and cache sizes per step."""
    kv = runner.new_kv()
    runner.reserve(kv, len(prompt), 0)
    runner.prefill(kv, prompt[:-1], 0)
    token, logits, sizes = prompt[-1], [], []
    for pos in range(len(prompt) - 1, until):
        out = runner.decode(kv, token, pos)
        logits.append(out.copy())
        sizes.append(kv.nbytes)
        token = int(np.argmax(out))
    return np.stack(logits), sizes, kv


def test_windows_decode_the_same_as_the_full_length_and_move_up(windowed, dev_profile) -> None:
    full = litert.load(windowed, dev_profile, kv_windows=False).runner
    win = litert.load(windowed, dev_profile).runner
    assert full.layout.windows == () and len(win.layout.windows) == 2
    want, want_sizes, _ = _greedy(full, PROMPT[:6], 64)
    got, sizes, _ = _greedy(win, PROMPT[:6], 64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [int(np.argmax(x)) for x in got] == [int(np.argmax(x)) for x in want]
    assert set(want_sizes) == {kv_bytes(64)}
    # position p needs p + 1 rows: window 16 up to p = 15, then 32, then the full 64
    assert sizes[15 - 5] == kv_bytes(16) and sizes[16 - 5] == kv_bytes(32)
    assert sizes[31 - 5] == kv_bytes(32) and sizes[32 - 5] == kv_bytes(64)


def test_a_prefill_past_a_window_moves_up_first(windowed, dev_profile) -> None:
    full = litert.load(windowed, dev_profile, kv_windows=False).runner
    win = litert.load(windowed, dev_profile).runner
    kv = win.new_kv()
    win.prefill(kv, PROMPT[:10], 0)  # window 16
    assert kv.nbytes == kv_bytes(16)
    win.prefill(kv, PROMPT[10:19], 10)  # 19 rows: the 10 kept rows move to window 32
    assert kv.nbytes == kv_bytes(32)
    ref = full.new_kv()
    full.prefill(ref, PROMPT[:19], 0)
    np.testing.assert_allclose(
        win.decode(kv, PROMPT[19], 19), full.decode(ref, PROMPT[19], 19), rtol=1e-5, atol=1e-5
    )


def test_saved_rows_restore_into_the_smallest_window(windowed, dev_profile) -> None:
    win = litert.load(windowed, dev_profile).runner
    _, _, long = _greedy(win, PROMPT[:6], 40)  # grown to the full length
    assert long.nbytes == kv_bytes(64)
    rows = win.read_rows(long, 12)
    want = win.decode(long, 7, 12).copy()
    # a full-length cache restored with 12 rows goes down to window 16 and continues the same
    _, _, other = _greedy(win, PROMPT[3:9], 40)
    win.write_rows(other, rows)
    assert other.nbytes == kv_bytes(16)
    np.testing.assert_array_equal(win.decode(other, 7, 12), want)
    # starting over (nothing kept) also goes down
    win.reserve(long, 5, 0)
    assert long.nbytes == kv_bytes(16)


def test_new_and_moved_caches_hold_zeros_past_their_rows(windowed, dev_profile) -> None:
    """Fresh KV buffers are not zeroed by LiteRT, and a NaN in a masked row would still poison
    attention (0 x NaN): every row a cache has not written reads zero, in every window."""
    win = litert.load(windowed, dev_profile).runner
    kv = win.new_kv()
    assert all(not a.any() for a in win.read_rows(kv, 16).values())
    win.prefill(kv, PROMPT[:10], 0)  # rows 0..9 in window 16
    before = win.read_rows(kv, 10)
    win.reserve(kv, 40, 10)  # to the full length, keeping the 10 rows
    assert kv.nbytes == kv_bytes(64)
    after, tail = win.read_rows(kv, 10), win.read_rows(kv, 64)
    for name, rows in before.items():
        np.testing.assert_array_equal(after[name], rows)
        assert np.count_nonzero(tail[name]) == np.count_nonzero(rows)  # the rest is zero


def test_the_interpreter_path_runs_only_the_full_length(windowed, dev_profile) -> None:
    loaded = litert.load(windowed, dev_profile, prefer_interpreter=True)
    assert loaded.runner.layout.windows == ()
    want, _, _ = _greedy(litert.load(windowed, dev_profile, kv_windows=False).runner, PROMPT, 30)
    got, sizes, _ = _greedy(loaded.runner, PROMPT, 30)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert set(sizes) == {kv_bytes(64)}


@pytest.fixture(scope="module")
def engines(tiny_model_factory, dev_profile_data):
    from agent.profile import parse_profile, profiles_dir

    d = tiny_model_factory.model_dir(
        quantizations=("int8",), prefill_lens=(8,), kv_max=64, decode_windows=WINDOWS
    )
    profile = parse_profile(dev_profile_data, profiles_dir() / "generic-x86_64.toml")
    a = Engine.load(profile, d, quantization="int8")
    b = Engine.load(profile, d, quantization="int8", kv_windows=False)
    yield a, b
    a.close()
    b.close()


def test_sessions_that_grow_across_windows_match_the_full_length(engines) -> None:
    win, full = engines
    assert "kv16_decode" in win.info.signatures and "kv16_decode" not in full.info.signatures
    greedy = SamplingParams(temperature=0.0)

    def conversation(engine: Engine) -> list[tuple[int, ...]]:
        sid = engine.create_session()
        out = [
            engine.complete(
                GenerateRequest(prompt=p, max_tokens=9, sampling=greedy, session_id=sid)
            ).token_ids
            for p in ("def f(x):", "\n    return", " x +", "\nclass A:")
        ]
        assert len(engine.session_tokens(sid)) > 32  # the last turns ran in the full length
        engine.delete_session(sid)
        return out

    assert conversation(win) == conversation(full)


# ------------------------------------------------------------------ windows added at load


def test_windows_added_to_a_file_match_the_exported_ones(
    tiny_model_factory, windowed, dev_profile, tmp_path
) -> None:
    """The rewrite (`agent.runtime.prepare.windows`) makes from a single-length file what the
    converter
    exports with windows: the same signatures and KV shapes, and the same logits (both files
    hold the same weights: seed 0)."""
    single = tiny_model_factory(prefill_lens=(8,), kv_max=64)
    out = tmp_path / "prepared.tflite"
    done = prepare_file(single, out, WINDOWS, 64)
    assert done.windows == WINDOWS and done.refused is None
    made, exported = (discover_layout(read_model_file(p)) for p in (out, windowed))
    assert made.all_windows() == exported.all_windows()
    got, sizes, _ = _greedy(litert.load(out, dev_profile).runner, PROMPT[:6], 40)
    want, want_sizes, _ = _greedy(litert.load(windowed, dev_profile).runner, PROMPT[:6], 40)
    assert sizes == want_sizes and set(sizes) == {kv_bytes(16), kv_bytes(32), kv_bytes(64)}
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_load_gives_a_single_length_model_windows_that_decode_the_same(
    tiny_model_factory, make_profile, tmp_path, caplog
) -> None:
    path = tiny_model_factory(prefill_lens=(8, 32), kv_max=512, quantization="int8")
    cache = tmp_path / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache)})
    # a load that died between writing the copy and checking it left only the unchecked copy
    died = prepared_model(path, profile, "d" * 64, True, (256,), 512)
    assert died.fresh and died.path.name.endswith(".tflite.unchecked")
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        loaded = litert.load(path, profile, cache_key="d" * 64)
    layout = loaded.runner.layout
    assert [w.length for w in layout.all_windows()] == [256, 512]
    # one prefill length per window: the shortest of at least 32 tokens
    assert [s.key for s in layout.windows[0].signatures] == ["kv256_prefill_32", "kv256_decode"]
    assert "KV windows [256] added and checked" in caplog.text
    made = cache / f"{'d' * 64}.{P}-inlined-kv256.tflite"
    assert made.exists() and not died.path.exists()  # checked again, then named
    # what reading the model and its copy found is kept for the next start
    readings = {f"{'d' * 64}{cachefiles.PARSE_SUFFIX}", f"{made.stem}{cachefiles.PARSE_SUFFIX}"}
    assert readings <= {f.name for f in cache.iterdir()}
    # packed on this load, by the original's reference run, into the file the copy maps
    packed = cache / f"{made.stem}{cachefiles.WEIGHT_CACHE_SUFFIX}"
    assert f"weights packed to {packed} by the reference run" in caplog.text
    assert packed.exists() and "model reopened to map them" not in caplog.text
    # a later load runs the same copy without rewriting or checking it again
    caplog.clear()
    mtime = made.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        again = litert.load(path, profile, cache_key="d" * 64).runner
    assert len(again.layout.windows) == 1 and made.stat().st_mtime_ns == mtime
    assert "model prepared" not in caplog.text and "checked" not in caplog.text
    got, sizes, _ = _greedy(again, PROMPT, 300)
    full = litert.load(path, make_profile(), kv_windows=False).runner
    want, want_sizes, _ = _greedy(full, PROMPT, 300)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [int(np.argmax(x)) for x in got] == [int(np.argmax(x)) for x in want]
    per_row = want_sizes[0] // 512
    assert sizes[255 - 19] == 256 * per_row and sizes[256 - 19] == 512 * per_row
    # the profile can turn them off
    off = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache), "kv_windows": False})
    assert litert.load(path, off, cache_key="d" * 64).runner.layout.windows == ()


def test_windows_are_refused_or_dropped_where_the_kv_length_is_ambiguous(
    tiny_model_factory, make_profile, tmp_path, monkeypatch, caplog
) -> None:
    """The tiny model's hidden size is 128. At a KV length of 128 an int8 model's quantized
    weights have that dimension too: the rewrite refuses. A float model's weights are cut like
    positional tables and make a wrong graph: the check at load finds it, and the model runs
    its full length only, with the same tokens. Either outcome is remembered: later loads do
    not rewrite the model for windows again."""
    monkeypatch.setattr(kv_layout, "SMALLEST_WINDOW", 32)  # so that KV 128 gets windows 32, 64
    assert kv_layout.auto_windows(128) == (32, 64)
    cache = tmp_path / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache)})

    def load(path: Path, key: str) -> litert.LoadedModel:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="agent.runtime"):
            return litert.load(path, profile, cache_key=key * 64)

    int8 = tiny_model_factory(prefill_lens=(8,), kv_max=128, quantization="int8")
    done = prepare_file(int8, tmp_path / "int8.tflite", (32, 64), 128)
    assert done.windows == () and done.refused is not None
    assert "weight" in done.refused and "equal to the KV length 128" in done.refused
    assert load(int8, "c").runner.layout.windows == ()
    reason = (cache / f"{'c' * 64}.{P}.nowindows").read_text()
    assert "equal to the KV length 128" in reason
    assert load(int8, "c").runner.layout.windows == ()
    assert "model prepared" not in caplog.text and "an earlier load found weight" in caplog.text

    fp32 = tiny_model_factory(prefill_lens=(8,), kv_max=128)
    loaded = load(fp32, "e")
    assert loaded.runner.layout.windows == ()
    assert "KV windows not used" in caplog.text
    assert not list(cache.glob(f"{'e' * 64}*kv32-64.tflite*"))  # dropped
    assert (cache / f"{'e' * 64}.{P}.nowindows").exists()
    want, _, _ = _greedy(litert.load(fp32, make_profile(), kv_windows=False).runner, PROMPT, 60)
    got, _, _ = _greedy(loaded.runner, PROMPT, 60)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    loaded.runner.close()  # while it runs, its files (the packed windows copy) are kept
    again = load(fp32, "e")  # the inlined copy without windows, made once
    assert again.runner.layout.windows == () and "KV windows [32, 64]" not in caplog.text
    assert "an earlier load found" in caplog.text
    assert sorted(f.name.split(".", 1)[1] for f in cache.iterdir() if f.name[0] == "e") == [
        f"{P}-inlined.tflite",
        f"{P}-inlined.xnnpack",
        f"{P}.nowindows",
        "parse.json",
    ]


def test_the_memory_estimate_counts_the_windows_a_load_adds(
    tiny_model_factory, make_profile, tmp_path
) -> None:
    """The daemon decides from `estimate_memory` whether an update loads beside the serving
    model; the estimate must not be below what the load then plans."""
    from agent.engine.loading import estimate_memory
    from agent.model.directory import load_model_dir

    d = tiny_model_factory.model_dir(quantizations=("int8",), prefill_lens=(8, 32), kv_max=512)
    cache = tmp_path / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache)})
    off = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache), "kv_windows": False})
    estimate, without = estimate_memory(profile, d, "int8"), estimate_memory(off, d, "int8")
    # the reading it made is kept where the load looks for it
    sha = load_model_dir(d).variant("int8").sha256
    assert (cache / f"{sha}{cachefiles.PARSE_SUFFIX}").exists()
    engine = Engine.load(profile, d, quantization="int8")
    try:
        loaded = engine.loaded.memory
        assert [w.length for w in engine.loaded.runner.layout.windows] == [256]
        assert without < loaded.total <= estimate
    finally:
        engine.close()
    plain = Engine.load(off, d, quantization="int8")
    try:
        assert plain.loaded.memory.total == without
    finally:
        plain.close()
