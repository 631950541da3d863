"""Verify signatures (speculative decoding's runtime side): discovery, KV windows added at load,
`Runner.verify` against decode one by one on the original file, the first-load check, and
prefill plans from measured call costs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.base.errors import ModelFormatError
from agent.model.tflite import layout as kv_layout
from agent.model.tflite.file import read_model_file
from agent.model.tflite.layout import KVLayout, Signature, Window, discover_layout
from agent.runtime import litert
from agent.runtime.costs import OUTLIER, SKIP, SPAN, CallCosts, RunningMean
from agent.runtime.plan import CALL_COST_TOKENS, plan_prefill
from agent.runtime.prepare import cachefiles

VERIFY = (4, 8)
TOKENS = [(37 * i + 5) % 256 for i in range(64)]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    return tiny_model_factory(prefill_lens=(8,), kv_max=64, verify_lens=VERIFY)


@pytest.fixture(scope="module")
def windowed(tiny_model_factory) -> Path:
    return tiny_model_factory(
        prefill_lens=(8,), kv_max=64, verify_lens=VERIFY, decode_windows=(16, 32)
    )


def kv_bytes(window: int) -> int:  # the tiny model: 2 layers x (K + V) x 1 head x 32 dims, fp32
    return 2 * 2 * window * 32 * 4


def _edit(src: Path, dst: Path, change: Any) -> Path:
    """`src` with `change(model)` applied to its flatbuffer object tree."""
    from ai_edge_litert.tools import flatbuffer_utils as fu

    m = fu.read_model(str(src))
    change(m)
    fu.write_model(m, str(dst))
    return dst


def _sig(m: Any, key: str) -> Any:
    return next(s for s in m.signatureDefs if s.signatureKey in (key, key.encode()))


def _name(t: Any) -> str:
    return t.name.decode() if isinstance(t.name, bytes) else str(t.name)


def reference(path: Path, tokens: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Logits of each step and the KV after them: `path`'s decode signature run one token at a
    time from position 0 by a bare ai_edge_litert Interpreter (nothing of edge-agent runs)."""
    from ai_edge_litert.interpreter import Interpreter

    run = Interpreter(model_path=str(path), num_threads=2).get_signature_runner("decode")
    kv = {
        name: np.zeros(d["shape"], d["dtype"])
        for name, d in run.get_input_details().items()
        if name.startswith("kv_cache_")
    }
    logits = []
    for pos, token in enumerate(tokens):
        res = run(tokens=np.array([[token]], np.int32), input_pos=np.array([pos], np.int32), **kv)
        kv = {k: res[k] for k in kv}
        logits.append(res["logits"].reshape(-1).copy())
    return np.stack(logits), kv


def _rows(kv: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """The first `rows` cache rows of the tiny model's transposed KV (K rows on axis 2, V 3)."""
    return {k: (a[:, :, :rows, :] if "_k_" in k else a[:, :, :, :rows]) for k, a in kv.items()}


# ----------------------------------------------------------------------------- discovery


def test_verify_signatures_are_discovered_per_window(model, windowed, tmp_path) -> None:
    layout = discover_layout(read_model_file(model))
    assert [s.key for s in layout.verify] == ["verify_4", "verify_8"]
    assert [s.logits_shape for s in layout.verify] == [(1, 4, 256), (1, 8, 256)]
    assert layout.full.verify == layout.verify
    assert [s.key for s in layout.prefill] == ["prefill_8"]  # never a prefill signature
    wl = discover_layout(read_model_file(windowed))
    assert [[s.key for s in w.verify] for w in wl.all_windows()] == [
        ["kv16_verify_4", "kv16_verify_8"],
        ["kv32_verify_4", "kv32_verify_8"],
        ["verify_4", "verify_8"],
    ]
    assert [[s.key for s in w.prefill] for w in wl.windows] == [
        ["kv16_prefill_8"],
        ["kv32_prefill_8"],
    ]
    # LiteRT-LM's plain `verify`: N from its tokens
    plain = _edit(model, tmp_path / "plain.tflite", lambda m: _set_key(m, "verify_8", "verify"))
    assert [(s.key, s.length) for s in discover_layout(read_model_file(plain)).verify] == [
        ("verify_4", 4),
        ("verify", 8),
    ]
    # a file without them has none
    assert (
        discover_layout(read_model_file(_edit(model, tmp_path / "none.tflite", _drop))).verify == ()
    )


def _set_key(m: Any, old: str, new: str) -> None:
    _sig(m, old).signatureKey = new.encode()


def _drop(m: Any) -> None:
    m.signatureDefs = [s for s in m.signatureDefs if b"verify" not in bytes(s.signatureKey)]


def _rename_logits(m: Any) -> None:
    for t in _sig(m, "verify_8").outputs:
        if _name(t) == "logits":
            t.name = b"hidden"


def _one_row_of_logits(m: Any) -> None:
    sig = _sig(m, "verify_8")
    t = next(t for t in sig.outputs if _name(t) == "logits")
    m.subgraphs[sig.subgraphIndex].tensors[t.tensorIndex].shape = np.array([1, 1, 256], np.int32)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_rename_logits, ["verify_8", "logits [1, 8, 256]", "no 'logits' output"]),
        (_one_row_of_logits, ["verify_8", "logits [1, 8, 256]", "logits [1, 1, 256]"]),
        (lambda m: _set_key(m, "verify_4", "verify_5"), ["verify_5", "tokens of length 5"]),
        (lambda m: _set_key(m, "verify_8", "verify"), []),  # fine: see above
    ],
)
def test_a_malformed_verify_signature_is_refused_naming_it(model, tmp_path, change, words):
    path = _edit(model, tmp_path / "edited.tflite", change)
    if not words:
        assert len(discover_layout(read_model_file(path)).verify) == 2
        return
    with pytest.raises(ModelFormatError) as err:
        discover_layout(read_model_file(path))
    for w in words:
        assert w in str(err.value)


def test_windows_added_at_load_clone_every_verify_signature(
    model, make_profile, tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(kv_layout, "SMALLEST_WINDOW", 16)  # so that KV 64 gets windows 16, 32
    cache = tmp_path / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache)})
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        runner = litert.load(model, profile, cache_key="a" * 64).runner
    assert [[s.key for s in w.verify] for w in runner.layout.all_windows()] == [
        ["kv16_verify_4", "kv16_verify_8"],
        ["kv32_verify_4", "kv32_verify_8"],
        ["verify_4", "verify_8"],
    ]
    assert runner.verify_lengths == VERIFY
    assert "speculation allowed" in caplog.text
    # in the smallest window, verify gives what decode one by one on the original file gives
    want, want_kv = reference(model, TOKENS[:12])
    kv = runner.new_kv()
    for pos in range(5):
        runner.decode(kv, TOKENS[pos], pos)
    got = runner.verify(kv, TOKENS[5:12], 5)
    assert got is not None and got.shape == (7, 256) and kv.nbytes == kv_bytes(16)
    np.testing.assert_array_equal(got, want[5:12])
    for name, rows in _rows(want_kv, 12).items():
        np.testing.assert_array_equal(runner.read_rows(kv, 12)[name], rows)
    # the outcome is kept: a warm start does not check again
    record = json.loads(next(cache.glob(f"{'a' * 64}*{cachefiles.VERIFY_SUFFIX}")).read_text())
    assert list(record.values()) == ["allowed"]
    runner.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        again = litert.load(model, profile, cache_key="a" * 64).runner
    assert again.verify_lengths == VERIFY and "speculation" not in caplog.text
    assert again.costs.count("kv16_verify_4") == 0  # nothing ran


# ----------------------------------------------------------------------------- Runner.verify


@pytest.mark.parametrize("quantization", ["fp32", "int8"])
@pytest.mark.parametrize("interpreter", [False, True])
def test_verify_equals_decode_one_by_one_on_the_original_file(
    tiny_model_factory, dev_profile, quantization, interpreter
) -> None:
    path = tiny_model_factory(
        prefill_lens=(8,), kv_max=64, verify_lens=VERIFY, quantization=quantization
    )
    runner = litert.load(path, dev_profile, prefer_interpreter=interpreter).runner
    assert runner.verify_lengths == VERIFY
    want, want_kv = reference(path, TOKENS[:40])
    kv = runner.new_kv()
    pos = 0
    # decode, then blocks of every length 1..8 (each runs verify_4 or verify_8, padded or not)
    for n in (0, 3, 1, 4, 5, 8, 2, 7, 6):
        if n == 0:
            for p in range(3):
                runner.decode(kv, TOKENS[p], p)
            pos = 3
            continue
        got = runner.verify(kv, TOKENS[pos : pos + n], pos)
        assert got is not None and got.shape == (n, 256)
        np.testing.assert_array_equal(got, want[pos : pos + n])
        pos += n
    assert pos == 39
    rows = runner.read_rows(kv, pos)
    for name, ref_rows in _rows(want_kv, pos).items():
        np.testing.assert_array_equal(rows[name], ref_rows)
    # decode goes on from the verified rows as if they had been decoded
    np.testing.assert_array_equal(runner.decode(kv, TOKENS[39], 39), want[39])


def test_padding_near_the_end_of_a_window_grows_it(windowed, dev_profile) -> None:
    runner = litert.load(windowed, dev_profile).runner
    want, _ = reference(windowed, TOKENS[:20])
    kv = runner.new_kv()
    runner.prefill(kv, TOKENS[:12], 0)
    assert kv.nbytes == kv_bytes(16)
    calls = {k: runner.costs.calls(k) for k in ("kv16_verify_4", "kv32_verify_4")}
    got = runner.verify(kv, TOKENS[12:15], 12)  # verify_4 over rows 12..15: fits window 16
    assert got is not None and kv.nbytes == kv_bytes(16)
    np.testing.assert_allclose(got, want[12:15], rtol=1e-5, atol=1e-5)  # after a prefill
    got = runner.verify(kv, TOKENS[13:16], 13)  # rows 13..16: window 32 (13 rows kept)
    assert got is not None and kv.nbytes == kv_bytes(32)
    np.testing.assert_allclose(got, want[13:16], rtol=1e-5, atol=1e-5)
    assert runner.costs.calls("kv16_verify_4") == calls["kv16_verify_4"] + 1
    assert runner.costs.calls("kv32_verify_4") == calls["kv32_verify_4"] + 1


def test_no_verify_at_the_end_of_the_context(model, dev_profile) -> None:
    runner = litert.load(model, dev_profile).runner
    kv = runner.new_kv()
    runner.prefill(kv, TOKENS[:56], 0)
    assert runner.verify(kv, TOKENS[56:60], 56) is not None  # verify_4 up to row 59
    assert runner.verify(kv, TOKENS[60:64], 60) is not None  # the last four rows
    assert runner.verify(kv, TOKENS[61:64], 61) is None  # padded to 4: past the end
    assert runner.verify(kv, TOKENS[58:63], 58) is None  # 5 tokens: verify_8, past the end
    with pytest.raises(ValueError, match=r"1\.\.8 tokens"):
        runner.verify(kv, TOKENS[:9], 0)
    # decode still runs to the last row, from the rows verify left
    want, _ = reference(model, TOKENS)
    np.testing.assert_allclose(runner.decode(kv, TOKENS[63], 63), want[63], rtol=1e-5, atol=1e-5)


def test_a_model_without_verify_signatures_never_verifies(tiny_model_factory, dev_profile):
    runner = litert.load(tiny_model_factory(prefill_lens=(8,), kv_max=64), dev_profile).runner
    assert runner.verify_lengths == () and runner.layout.verify == ()
    assert runner.verify(runner.new_kv(), [1, 2, 3], 0) is None


def test_builtin_kernels_differ_so_speculation_is_off(model, make_profile, caplog) -> None:
    """LiteRT's builtin kernels compute verify and decode in different orders (~1e-6 apart):
    greedy speculation could then pick another token than plain decoding, so it is off."""
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        loaded = litert.load(model, make_profile(runtime={"accelerators": ["cpu"]}))
    assert loaded.accelerator == "cpu"
    assert loaded.runner.verify_lengths == ()
    assert loaded.runner.verify(loaded.runner.new_kv(), [1, 2], 0) is None
    lines = [r.getMessage() for r in caplog.records if "speculation off" in r.getMessage()]
    assert len(lines) == 1 and "differs from decode one by one by" in lines[0], lines
    diff = float(lines[0].split(" by ")[-1].split()[0])
    assert 0 < diff < 1e-3  # a rounding difference, not a broken signature


# ----------------------------------------------------------------------------- measured costs


def test_every_call_is_timed_but_the_first_of_each_signature(model, dev_profile) -> None:
    runner = litert.load(model, dev_profile).runner
    # the load's checks ran every signature first: their calls are forgotten
    assert all(runner.costs.calls(k) == 0 for k in ("decode", "verify_4", "verify_8"))
    kv = runner.new_kv()
    for pos in range(5):
        runner.decode(kv, TOKENS[pos], pos)
    runner.verify(kv, TOKENS[5:8], 5)
    runner.verify(kv, TOKENS[6:9], 6)
    runner.verify(kv, TOKENS[7:10], 7)
    assert runner.costs.calls("decode") == 5 and runner.costs.count("decode") == 5 - SKIP
    assert runner.costs.calls("verify_4") == 3 and runner.costs.count("verify_4") == 3 - SKIP
    decode_s, verify_s = runner.costs.decode_s(kv), runner.costs.verify_s(kv, 3)
    assert decode_s is not None and decode_s > 0 and decode_s == runner.costs.mean("decode")
    assert verify_s is not None and verify_s == runner.costs.mean("verify_4")
    assert runner.costs.verify_s(kv, 9) is None  # no signature holds 9


def test_running_mean_skips_the_first_call_and_follows_a_change() -> None:
    costs = CallCosts(lambda kv, n: "decode" if n == 1 else None)
    for _ in range(SKIP):
        costs.add("decode", 5.0)  # lazy initialisation, page faults: not counted
    assert costs.mean("decode") is None and costs.count("decode") == 0
    for x in (1.0, 1.25, 1.5):
        costs.add("decode", x)
    assert costs.mean("decode") == 1.25 and costs.count("decode") == 3
    costs.add("decode", 1000.0)  # descheduled: counts as OUTLIER times the mean
    assert costs.mean("decode") == (3 * 1.25 + OUTLIER * 1.25) / 4
    assert costs.calls("decode") == SKIP + 4
    assert costs.decode_s(object()) == costs.mean("decode")
    assert costs.verify_s(object(), 4) is None
    m = RunningMean()
    for _ in range(10 * SPAN):
        m.add(1.0)
    for _ in range(SPAN):
        m.add(3.0)
    assert 1.3 < m.mean < 3.0  # it follows a slower kernel (a longer context), not frozen
    for _ in range(3 * SPAN):
        m.add(3.0)
    assert 2.5 < m.mean < 3.0
    for _ in range(SPAN):
        m.add(1.0)
    assert m.mean < 1.8  # and a faster one, unclipped


def _window(*lengths: int, verify: tuple[int, ...] = ()) -> Window:
    kv = KVLayout("transposed", 2, (1, 1, 1024, 32), (1, 1, 32, 1024), 2, 3, "float32", 4)

    def sig(key: str, n: int) -> Signature:
        logits = not key.startswith("prefill")
        return Signature(key, n, False, (), logits, (), (1, n, 256) if logits else ())

    return Window(
        sig("decode", 1),
        tuple(sig(f"prefill_{n}", n) for n in lengths),
        kv,
        tuple(sig(f"verify_{n}", n) for n in verify),
    )


def _plan(window: Window, n: int, start: int = 0) -> list[str]:
    return [c.signature.key for c in plan_prefill(window, n, start)]


def test_plan_prefill_is_the_token_model_whatever_was_measured() -> None:
    w = _window(32, 128, 512, verify=(4, 8))
    # a call costs CALL_COST_TOKENS + its length: the plan is a function of the tokens alone,
    # so a greedy or seeded request's tokens do not depend on the machine's timings
    assert CALL_COST_TOKENS == 8
    assert _plan(w, 63) == ["prefill_32", "prefill_32"]
    assert _plan(w, 448) == ["prefill_128"] * 3 + ["prefill_32"] * 2
    assert _plan(w, 3) == ["decode"] * 3
    # never past the end of the cache, never a verify signature
    for n, start in ((448, 1024 - 448), (20, 1000), (3, 1021)):
        calls = plan_prefill(w, n, start)
        assert all(start + c.offset + c.signature.length <= 1024 for c in calls)
        assert sum(c.count for c in calls) == n
        assert not any(c.signature.key.startswith("verify") for c in calls)


def test_model_inspect_shows_verify_signatures_and_the_load_check(
    model, windowed, make_profile
) -> None:
    from agent.cli.inspect_report import format_report, inspect_report

    report = inspect_report(windowed)
    assert report["llm"]["verify_lengths"] == [4, 8]
    assert report["llm"]["verify_by_window"] == {"16": [4, 8], "32": [4, 8]}
    assert "verify      [4, 8] (KV 16: [4, 8], KV 32: [4, 8])" in format_report(report)
    assert "speculation" not in report["llm"]  # nothing loaded without a profile
    allowed = inspect_report(model, make_profile())["llm"]["speculation"]
    assert allowed == {"allowed": True, "accelerator": "xnnpack", "verify_lengths": [4, 8]}
    off = inspect_report(model, make_profile(runtime={"accelerators": ["cpu"]}))
    assert off["llm"]["speculation"]["allowed"] is False
    assert "differs from decode one by one" in off["llm"]["speculation"]["reason"]
    assert "; speculation off: window kv64: verify_" in format_report(off)


@pytest.mark.parametrize(
    ("lengths", "window", "want"),
    [
        ((32, 128, 512), 256, (32,)),  # short windows: one length, for memory
        ((32, 128, 512), 512, (32, 128)),  # a 448-token prompt: 3 x 128 + 2 x 32, not 14 x 32
        ((8, 32, 128, 512), 1024, (32, 128)),
        ((8, 32, 128, 512), 2048, (32, 512)),
        ((32,), 1024, (32,)),  # nothing longer
        ((32, 128), 32, ()),  # none shorter than the window
    ],
)
def test_windows_of_512_rows_or_more_get_a_longer_prefill(lengths, window, want) -> None:
    assert kv_layout.window_prefills(lengths, window) == want
    assert kv_layout.window_prefills(iter(lengths), window) == want  # any iterable


def test_the_interpreter_opens_verify_signatures_only_when_their_arenas_are_small(
    model, dev_profile, monkeypatch, caplog
) -> None:
    """The Interpreter holds each signature's KV in and out in its own arena: for a large KV
    the verify signatures are not opened (no speculation there), with one line saying so."""
    from agent.runtime import interpreter

    assert litert.load(model, dev_profile, prefer_interpreter=True).runner.verify_lengths == VERIFY
    monkeypatch.setattr(interpreter, "VERIFY_ARENA_MAX", 2 * kv_bytes(64) * 2 - 1)
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        runner = litert.load(model, dev_profile, prefer_interpreter=True).runner
    assert runner.verify_lengths == () and runner.layout.verify == ()
    assert runner.verify(runner.new_kv(), [1, 2], 0) is None
    assert "verify signatures not opened on the Interpreter" in caplog.text
