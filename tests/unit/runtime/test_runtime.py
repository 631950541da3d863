"""The LiteRT runtime on real tiny models: layouts, in-place KV, prefill plans, fallbacks."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from agent.base.errors import AcceleratorError, BudgetError, ModelFormatError
from agent.model.tflite import file as modelfile
from agent.model.tflite.file import read_model_file
from agent.model.tflite.layout import discover_layout
from agent.runtime import litert
from agent.runtime.memory import keep_large_buffers_mapped
from agent.runtime.plan import check_budget, plan_memory, plan_prefill
from agent.runtime.prepare import cachefiles
from agent.runtime.prepare.model import PreparedModel
from tests.support.tiny_models import LEGACY

P = f"p{cachefiles.PREPARED_FORMAT}"  # the prepared copies' format, in their names

LAYOUTS = [
    # (layout, prefill lengths, mask as input)
    ("transposed", (8,), False),
    ("transposed", (8, 16), False),
    ("default", (8,), False),
    ("default", (8, 16), True),
    ("transposed", (8,), True),
]


@pytest.mark.parametrize(("kv_layout", "prefill", "mask"), LAYOUTS)
def test_discovers_layout(tiny_model_factory, kv_layout, prefill, mask) -> None:
    path = tiny_model_factory(layout=kv_layout, prefill_lens=prefill, kv_max=64, mask_as_input=mask)
    layout = discover_layout(read_model_file(path))
    assert layout.kv.name == kv_layout
    assert [s.length for s in layout.prefill] == list(prefill)
    assert layout.decode.has_mask is mask
    assert layout.context_length == 64
    assert layout.vocab_size == 256
    assert layout.kv.num_layers == 2
    if kv_layout == "transposed":
        assert layout.kv.k_shape == (1, 1, 64, 32) and layout.kv.v_shape == (1, 1, 32, 64)
    else:
        assert layout.kv.k_shape == layout.kv.v_shape == (1, 64, 1, 32)
    assert layout.kv.bytes_per_session == 2 * 2 * 64 * 32 * 4


def _decode_all(runner, tokens):
    kv = runner.new_kv()
    out = []
    for pos, t in enumerate(tokens):
        out.append(runner.decode(kv, t, pos).copy())  # the next call overwrites it
    return np.stack(out)


def _prefill_then_decode(runner, tokens):
    kv = runner.new_kv()
    runner.prefill(kv, tokens[:-1], 0)
    return runner.decode(kv, tokens[-1], len(tokens) - 1).copy()


PROMPT = [1, 17, 33, 5, 200, 9, 41, 42, 43, 7, 99, 120, 3, 18, 64, 65, 66, 12, 250, 8]


# tflite-runtime has only the Interpreter path, and runs only the transposed KV layout right
# (docs/PROFILES.md); the tests of what only ai-edge-litert has are skipped on it
MALLINFO2_FIELDS = (  # glibc's struct mallinfo2, all size_t
    *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
    *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
)
NOT_LEGACY = pytest.mark.skipif(LEGACY, reason="ai-edge-litert only")
PATHS = [pytest.param(False, id="compiled", marks=NOT_LEGACY), pytest.param(True, id="interpreter")]
RUN_LAYOUTS = [
    pytest.param(*row, marks=NOT_LEGACY if row[0] == "default" else ()) for row in LAYOUTS
]


def test_a_kept_reading_of_a_model_is_used_only_for_the_same_file(
    tiny_model_factory, tmp_path
) -> None:
    path = tmp_path / "model.tflite"
    path.write_bytes(tiny_model_factory(layout="transposed", prefill_lens=(8,)).read_bytes())
    kept = tmp_path / "cache" / "model.parse.json"
    fresh = read_model_file(path, kept)
    assert kept.exists() and read_model_file(path) == fresh
    assert read_model_file(path, kept) == fresh  # read back: the same signatures, ops, weights
    # it is used without reading the model: a changed reading of the same file is believed
    text = kept.read_text()
    kept.write_text(text.replace(f'"weight_bytes": {fresh.weight_bytes}', '"weight_bytes": 7'))
    assert read_model_file(path, kept).weight_bytes == 7
    # another file at the same path (a new modification time) is read again, and kept
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert read_model_file(path, kept) == fresh
    assert read_model_file(path, kept).weight_bytes == fresh.weight_bytes
    # a reading that is not one (truncated, an older format) is read again too
    kept.write_text(text[: len(text) // 2])
    assert read_model_file(path, kept) == fresh
    kept.write_text(text.replace(f"[{modelfile.PARSE_FORMAT}, ", "[0, ", 1))
    assert read_model_file(path, kept) == fresh
    # nowhere to keep it: the reading is still made
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert read_model_file(path, blocked / "model.parse.json") == fresh


@pytest.mark.parametrize(("kv_layout", "prefill", "mask"), RUN_LAYOUTS)
@pytest.mark.parametrize("interpreter", PATHS)
def test_prefill_matches_token_by_token_decode(
    tiny_model_factory, dev_profile, kv_layout, prefill, mask, interpreter
) -> None:
    path = tiny_model_factory(layout=kv_layout, prefill_lens=prefill, kv_max=64, mask_as_input=mask)
    loaded = litert.load(path, dev_profile, prefer_interpreter=interpreter)
    assert loaded.path_kind == ("interpreter" if interpreter else "compiled")
    reference = _decode_all(loaded.runner, PROMPT)
    # 19 prompt tokens go through padded prefill calls, the last through decode
    last = _prefill_then_decode(loaded.runner, PROMPT)
    np.testing.assert_allclose(last, reference[-1], rtol=1e-4, atol=1e-4)
    # different positions give different logits: the cache really carries the context
    assert np.abs(reference[-1] - reference[-2]).max() > 1e-3


def test_compiled_and_interpreter_agree(tiny_model_factory, dev_profile) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    a = _decode_all(litert.load(path, dev_profile).runner, PROMPT)
    b = _decode_all(litert.load(path, dev_profile, prefer_interpreter=True).runner, PROMPT)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@NOT_LEGACY
def test_decode_writes_its_logits_into_the_runners_array(tiny_model_factory, dev_profile) -> None:
    """No allocation per token: each step's logits land in the same array, bound as the
    signature's output, and are the values the step computed."""
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    runner = litert.load(path, dev_profile).runner
    want = _decode_all(runner, PROMPT[:3])
    kv = runner.new_kv()
    first = runner.decode(kv, PROMPT[0], 0)
    np.testing.assert_array_equal(first, want[0])
    second = runner.decode(kv, PROMPT[1], 1)
    assert np.shares_memory(first, second)
    np.testing.assert_array_equal(second, want[1])
    assert not np.array_equal(want[0], want[1])


def test_large_buffers_stay_mapped_after_a_larger_one_is_freed() -> None:
    """glibc would raise its mmap threshold to the size of a freed mapped block and serve the
    next large buffers (a larger KV window's) from the heap, where their pages stay after
    they are freed; the runtime pins the threshold, so they get mappings of their own."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    keep_large_buffers_mapped()
    big = np.ones(16 << 20, dtype=np.uint8)  # mapped, then freed: the threshold would rise
    del big
    before = libc.mallinfo2().hblkhd
    buffer = np.ones(8 << 20, dtype=np.uint8)  # no hole in the heap is this large
    assert libc.mallinfo2().hblkhd - before >= 8 << 20
    del buffer


def test_sessions_do_not_share_kv(tiny_model_factory, dev_profile) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    for interpreter in (False, True):
        runner = litert.load(path, dev_profile, prefer_interpreter=interpreter).runner
        a, b = runner.new_kv(), runner.new_kv()
        runner.prefill(a, PROMPT[:10], 0)
        runner.prefill(b, PROMPT[10:19], 0)  # interleaved with a, different content
        got = runner.decode(a, PROMPT[10], 10).copy()
        want = _decode_all(runner, PROMPT[:11])[-1]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_layout", ["transposed", pytest.param("default", marks=NOT_LEGACY)])
@pytest.mark.parametrize("interpreter", PATHS)
def test_saved_rows_restore_a_cache_exactly(
    tiny_model_factory, dev_profile, kv_layout, interpreter
) -> None:
    """What a spill keeps (only the used rows) continues bit for bit in another cache."""
    path = tiny_model_factory(layout=kv_layout, prefill_lens=(8,), kv_max=64)
    runner = litert.load(path, dev_profile, prefer_interpreter=interpreter).runner
    a = runner.new_kv()
    runner.prefill(a, PROMPT[:12], 0)
    rows = runner.read_rows(a, 12)
    kv = runner.layout.kv
    for name, r in rows.items():
        assert r.shape[kv.k_seq_axis if "_k_" in name else kv.v_seq_axis] == 12
    assert sum(r.nbytes for r in rows.values()) == 12 * runner.layout.kv.bytes_per_token
    b = runner.new_kv()
    runner.prefill(b, PROMPT[5:17], 0)  # different content that the restore must replace
    runner.write_rows(b, rows)
    want = runner.decode(a, PROMPT[12], 12).copy()
    got = runner.decode(b, PROMPT[12], 12)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ModelFormatError):
        runner.write_rows(b, {"kv_cache_k_0": rows["kv_cache_k_0"]})


def test_plan_prefill_never_runs_past_the_cache(tiny_model_factory) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8, 16), kv_max=64)
    layout = discover_layout(read_model_file(path))
    for start in range(0, 64):
        for n in range(1, 64 - start + 1):
            calls = plan_prefill(layout.full, n, start)
            assert sum(c.count for c in calls) == n
            assert [c.offset for c in calls] == list(np.cumsum([0] + [c.count for c in calls[:-1]]))
            for c in calls:
                assert start + c.offset + c.signature.length <= 64

    # the cheapest plan: a call costs its padded length plus CALL_COST_TOKENS (8)
    def plan(n: int, start: int = 0) -> list[int]:
        return [c.signature.length for c in plan_prefill(layout.full, n, start)]

    assert plan(5) == [8]  # one padded call, not five decode calls
    assert plan(20) == [16, 8]
    assert plan(17) == [16, 1]  # the last token through decode, not a padded 8
    assert plan(1) == [1] and plan(2) == [8]
    assert plan(30) == [16, 16]
    # near the end only decode fits
    assert [c.signature.key for c in plan_prefill(layout.full, 3, 61)] == ["decode"] * 3


def test_memory_budget_refusal_names_the_numbers(tiny_model_factory, make_profile) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    profile = make_profile(
        runtime={"max_num_bytes": 16 * 1024 * 1024},
        kv={"host_max_bytes": 0, "prefix_max_bytes": 0},
    )
    # the tiny model fits in 16 MiB; a budget below its size must be refused before loading
    plan = plan_memory(read_model_file(path), discover_layout(read_model_file(path)), profile)
    assert plan.total < 16 * 1024 * 1024
    assert plan.weights == path.stat().st_size
    assert plan.kv_per_session == 2 * 2 * 64 * 32 * 4
    check_budget(plan, profile, path)  # fits: no error
    many = dataclasses.replace(plan, sessions=1000)  # 1000 sessions of 32 KiB KV do not fit
    with pytest.raises(BudgetError) as err:
        check_budget(many, profile, path)
    msg = str(err.value)
    assert "max_num_bytes = 16777216" in msg and "x 1000 session(s)" in msg
    assert f"weights {plan.weights / 2**20:.1f}" in msg
    assert profile.name in msg and str(profile.source) in msg


@NOT_LEGACY
def test_require_fused_refuses_unfused_model(tiny_model_factory, make_profile) -> None:
    fused = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    assert read_model_file(fused).fused
    unfused = tiny_model_factory(
        layout="transposed", prefill_lens=(8,), kv_max=64, enable_hlfb=False
    )
    assert not read_model_file(unfused).fused
    profile = make_profile(runtime={"require_fused": True})
    litert.load(fused, profile)
    with pytest.raises(ModelFormatError, match="require_fused"):
        litert.load(unfused, profile)


def test_not_an_llm_gets_a_clear_error(tmp_path: Path, dev_profile) -> None:
    junk = tmp_path / "junk.tflite"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFormatError, match="not a TFLite flatbuffer"):
        litert.load(junk, dev_profile)


# ----------------------------------------------------------------------------- accelerators


def test_missing_npu_library_falls_back_with_reason(tiny_model_factory, make_profile) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    profile = make_profile(
        runtime={"accelerators": ["npu", "xnnpack", "cpu"]},
        npu={"kind": "external_delegate", "library": "/nonexistent/libvx_delegate.so"},
    )
    loaded = litert.load(path, profile)
    assert loaded.accelerator == "xnnpack"
    assert len(loaded.fallbacks) == 1
    assert "npu" in loaded.fallbacks[0] and "libvx_delegate.so" in loaded.fallbacks[0]


NOOP_DELEGATE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
/* TfLiteDelegate, declared by hand (FACTS.md): data, Prepare, 3 buffer-handle callbacks,
   flags, opaque builder. Prepare claims no nodes, so the graph stays on the CPU kernels. */
typedef struct TfLiteDelegate {
  void* data_;
  int (*Prepare)(void* context, struct TfLiteDelegate* delegate);
  void* CopyFromBufferHandle;
  void* CopyToBufferHandle;
  void* FreeBufferHandle;
  int64_t flags;
  void* opaque_delegate_builder;
} TfLiteDelegate;
static int prepare(void* context, TfLiteDelegate* d) { (void)context; (void)d; return 0; }
TfLiteDelegate* tflite_plugin_create_delegate(char** keys, char** values, size_t n,
                                              void (*report_error)(const char*)) {
  (void)report_error;
  const char* marker = getenv("NOOP_DELEGATE_MARKER");
  if (marker) {
    FILE* f = fopen(marker, "w");
    for (size_t i = 0; f && i < n; i++) fprintf(f, "%s=%s\n", keys[i], values[i]);
    if (f) fclose(f);
  }
  TfLiteDelegate* d = calloc(1, sizeof(TfLiteDelegate));
  d->Prepare = prepare;
  return d;
}
void tflite_plugin_destroy_delegate(TfLiteDelegate* d) { free(d); }
"""


@pytest.fixture(scope="session")
def noop_delegate(tmp_path_factory) -> Path:
    """A real TFLite external delegate (.so) that claims no nodes, built with gcc."""
    d = tmp_path_factory.mktemp("delegate")
    src = d / "noop_delegate.c"
    src.write_text(NOOP_DELEGATE)
    lib = d / "libnoop_delegate.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)], check=True)
    return lib


def test_external_npu_delegate_is_loaded_with_its_options(
    tiny_model_factory, make_profile, noop_delegate, tmp_path, monkeypatch
) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    marker = tmp_path / "delegate-options.txt"
    monkeypatch.setenv("NOOP_DELEGATE_MARKER", str(marker))
    profile = make_profile(
        runtime={"accelerators": ["npu", "xnnpack", "cpu"]},
        npu={
            "kind": "external_delegate",
            "library": str(noop_delegate),
            "options": {"device": "pci", "cache_dir": "/tmp/x"},
        },
    )
    loaded = litert.load(path, profile)
    assert loaded.accelerator == "npu" and loaded.path_kind == "interpreter"
    assert loaded.fallbacks == ()
    assert set(marker.read_text().split()) == {"device=pci", "cache_dir=/tmp/x"}
    # the graph runs (on the CPU kernels behind the no-op delegate) and matches xnnpack
    want = _decode_all(litert.load(path, make_profile()).runner, PROMPT[:6])
    got = _decode_all(loaded.runner, PROMPT[:6])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_plain_cpu_kernels_match_xnnpack(tiny_model_factory, make_profile) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    cpu = litert.load(path, make_profile(runtime={"accelerators": ["cpu"]}))
    assert cpu.accelerator == "cpu"
    want = _decode_all(litert.load(path, make_profile()).runner, PROMPT[:6])
    np.testing.assert_allclose(_decode_all(cpu.runner, PROMPT[:6]), want, rtol=1e-3, atol=1e-3)


@NOT_LEGACY
def test_xnnpack_weight_cache_file_is_written_reused_and_pruned(
    tiny_model_factory, make_profile, tmp_path
) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8, 16), kv_max=64)
    cache_dir = tmp_path / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache_dir)})
    cache_dir.mkdir()
    stale = cache_dir / f"{'0' * 64}{cachefiles.WEIGHT_CACHE_SUFFIX}"
    stale.write_bytes(b"packed weights of a model that was replaced")
    stale_copy = cache_dir / f"{'0' * 64}.{P}-inlined-kv256.tflite{cachefiles.UNCHECKED_SUFFIX}"
    stale_copy.write_bytes(b"a copy a load did not live to check")
    mine = cache_dir / f"{'a' * 64}.{P}{cachefiles.NO_WINDOWS_SUFFIX}"  # this model's, kept
    mine.write_text("why its windows failed")
    theirs = cache_dir / "model.tflite"  # not named like the runtime's files: never removed
    theirs.write_bytes(b"someone else's file")
    # what loads killed while writing left: a prepared copy, a reading (mkstemp's name)
    killed = [
        cache_dir / f"{'0' * 64}.{P}-inlined.tflite.tmp",
        cache_dir / f"{'a' * 64}{cachefiles.PARSE_SUFFIX}k3_x9abq.tmp",
    ]
    for leftover in killed:
        leftover.write_bytes(b"half written")
    want = _decode_all(litert.load(path, make_profile()).runner, PROMPT[:6])

    first = litert.load(path, profile, cache_key="a" * 64)
    # the fused model runs with its composites inlined: that file has its own packed weights
    cache = cache_dir / f"{'a' * 64}.{P}-inlined{cachefiles.WEIGHT_CACHE_SUFFIX}"
    inlined = cache_dir / f"{'a' * 64}.{P}-inlined{cachefiles.MODEL_SUFFIX}"
    # what reading the model found is kept beside them
    reading = cache_dir / f"{'a' * 64}{cachefiles.PARSE_SUFFIX}"
    names = sorted(p.name for p in cache_dir.iterdir())  # stale files and leftovers pruned
    assert names == sorted([cache.name, inlined.name, theirs.name, mine.name, reading.name])
    written = cache.stat()
    assert written.st_size > 0
    np.testing.assert_allclose(_decode_all(first.runner, PROMPT[:6]), want, rtol=1e-4, atol=1e-4)
    # a second load maps the packed weights from the file instead of packing them again
    second = litert.load(path, profile, cache_key="a" * 64)
    assert cache.stat().st_mtime_ns == written.st_mtime_ns
    np.testing.assert_allclose(_decode_all(second.runner, PROMPT[:6]), want, rtol=1e-4, atol=1e-4)
    # another model loaded beside it (an update) leaves the files of the one still running:
    # a rollback starts from them
    other = litert.load(path, profile, cache_key="b" * 64)
    assert other.accelerator == "xnnpack"
    assert cache.exists() and inlined.exists() and mine.exists() and reading.exists()
    # once its runners are closed, the next load prunes them, the inlined copy included
    first.runner.close()
    assert cache.exists()  # one runner still runs it
    second.runner.close()
    other.runner.close()
    litert.load(path, profile, cache_key="b" * 64).runner.close()
    assert not cache.exists() and not inlined.exists() and not mine.exists()
    assert not reading.exists()
    assert theirs.exists()


@NOT_LEGACY
def test_composites_are_inlined_for_xnnpack(tiny_model_factory, dev_profile, tmp_path) -> None:
    """Every STABLEHLO_COMPOSITE op is replaced by its decomposition: the same signatures and
    weights, no composite left, and the same logits."""
    from agent.runtime.prepare.inline import prepare_file

    path = tiny_model_factory(
        layout="transposed", prefill_lens=(8, 16), kv_max=64, quantization="int8"
    )
    fused = read_model_file(path)
    assert fused.fused
    out = tmp_path / "inlined.tflite"
    assert prepare_file(path, out).inlined >= 3  # rms_norm composites in each of 3 signatures
    flat = read_model_file(out)
    assert not flat.fused
    assert [s.key for s in flat.signatures] == [s.key for s in fused.signatures]

    def big(m):  # type: ignore[no-untyped-def]
        return [w for w in m.weights if w[0] in ("FULLY_CONNECTED", "EMBEDDING_LOOKUP")]

    assert big(flat) == big(fused)  # the same weight tensors, shared buffers intact
    a = litert.load(path, dev_profile).runner  # no weight cache dir: loaded as it is
    b = litert.load(out, dev_profile).runner
    np.testing.assert_array_equal(_decode_all(a, PROMPT[:12]), _decode_all(b, PROMPT[:12]))
    # a model without composites (and no KV windows asked for) is left alone: nothing written
    again = prepare_file(out, tmp_path / "again.tflite")
    assert not again.changed and not (tmp_path / "again.tflite").exists()


@NOT_LEGACY
def test_unwritable_weight_cache_dir_packs_in_memory(tiny_model_factory, make_profile, tmp_path):
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(blocker / "xnnpack")})
    assert cachefiles.weight_cache_path(profile, "b" * 64) == cachefiles.IN_MEMORY_WEIGHT_CACHE
    loaded = litert.load(path, profile, cache_key="b" * 64)
    assert loaded.accelerator == "xnnpack"
    assert not blocker.is_dir()


@NOT_LEGACY
def test_no_working_accelerator_is_an_error(tiny_model_factory, make_profile) -> None:
    path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    profile = make_profile(
        runtime={"accelerators": ["npu", "cpu"]},
        npu={"kind": "dispatch", "library": "/nonexistent/dispatch"},
    )
    # cpu still works: the chain ends there
    assert litert.load(path, profile).accelerator == "cpu"
    with pytest.raises(AcceleratorError):
        litert._open(
            path,
            discover_layout(read_model_file(path)),
            profile,
            "npu",
            False,
            PreparedModel(path, None),
        )
