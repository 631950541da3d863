"""KV windows: decode signatures over shorter KV lengths in one file, used while they hold a
session, with the rows moved up when it grows (CompiledModel path)."""

from __future__ import annotations

import numpy as np
import pytest

from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.runtime import litert
from agent.runtime.layout import discover_layout
from agent.runtime.modelfile import read_model_file
from agent.toolchain.export import ExportOptions

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
    want = win.decode(long, 7, 12)
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
    a = Engine(profile, d, quantization="int8")
    b = Engine(profile, d, quantization="int8", kv_windows=False)
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
