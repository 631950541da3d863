"""A prepared copy never changes what the model computes (issue 20 §1).

The reference here is a plain `ai_edge_litert` Interpreter loop on the original file (its
signature runner, the KV outputs fed back as inputs, greedy argmax), written in this file and
sharing nothing with `agent.runtime`. The tiny model has one KV head: in the default KV layout
litert-torch exports its attention composite with a decomposition that is not what the
composite means, which is what an inlined copy used to run.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from agent.base.errors import AcceleratorError
from agent.runtime import litert
from agent.runtime.prepare import cachefiles, inline

PROMPT = [1, 17, 33, 5, 200, 9, 41, 42, 43, 7]
STEPS = 16


def reference_greedy(path: Path, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and per-step logits of `path` through the Interpreter's signature runners
    only: decode one token at a time from position 0 (every prompt token, then the picks)."""
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=str(path), num_threads=2)
    decode = it.get_signature_runner("decode")
    details = decode.get_input_details()
    kv = {
        name: np.zeros(d["shape"], dtype=d["dtype"])
        for name, d in details.items()
        if name.startswith("kv_cache_")
    }
    out_tokens: list[int] = []
    logits = []
    token = prompt[0]
    for pos in range(len(prompt) - 1 + steps):
        feed = dict(kv, tokens=np.array([[token]], np.int32), input_pos=np.array([pos], np.int32))
        if "mask" in details:
            shape = details["mask"]["shape"]
            mask = np.full(shape, -np.inf, np.float32)
            mask[..., : pos + 1] = 0.0
            feed["mask"] = mask
        result = decode(**feed)
        for name in kv:
            kv[name] = result[name]
        row = result["logits"].reshape(-1)
        if pos + 1 < len(prompt):
            token = prompt[pos + 1]
            continue
        logits.append(row.copy())
        token = int(np.argmax(row))
        out_tokens.append(token)
    return out_tokens, np.array(logits)


@pytest.fixture(scope="module")
def default_layout(tiny_model_factory):
    """One KV head, default KV layout, fused composites, fp32: the case that went wrong."""
    return tiny_model_factory(layout="default", prefill_lens=(8,), kv_max=64)


def _load(path: Path, profile, key: str) -> litert.LoadedModel:
    return litert.load(path, profile, cache_key=key * 64)


def _runner_greedy(runner, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    kv = runner.new_kv()
    runner.reserve(kv, len(prompt) + steps, 0)
    runner.prefill(kv, prompt[:-1], 0)
    token, pos, tokens, logits = prompt[-1], len(prompt) - 1, [], []
    for _ in range(steps):
        row = np.array(runner.decode(kv, token, pos))
        logits.append(row)
        token = int(np.argmax(row))
        tokens.append(token)
        pos += 1
    return tokens, np.array(logits)


def test_the_prepared_copy_of_a_one_kv_head_default_layout_model_computes_the_original(
    default_layout, make_profile, tmp_path, caplog
) -> None:
    want_tokens, want_logits = reference_greedy(default_layout, PROMPT, STEPS)
    assert len(set(want_tokens)) > 1, "a degenerate model proves nothing"
    cache = tmp_path / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache)})
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        loaded = _load(default_layout, profile, "a")
    assert loaded.prepared.startswith("composites inlined"), loaded.prepared
    assert "the prepared copy checked against" in caplog.text
    got_tokens, got_logits = _runner_greedy(loaded.runner, PROMPT, STEPS)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4 * np.abs(want_logits).max())
    # the attention composite is still there; the RMSNorm composites are gone
    copies = [f for f in cache.iterdir() if f.name.endswith(".tflite")]
    assert len(copies) == 1 and not list(cache.glob("*.unchecked"))


def test_a_copy_that_computes_something_else_is_refused_remembered_and_never_served(
    default_layout, make_profile, tmp_path, monkeypatch, caplog
) -> None:
    """Inline the attention composite too (what p3 copies did): the check at the first load
    finds the difference; the original file serves, the reason shows in `prepared`, and later
    loads do not make the copy again."""
    monkeypatch.setattr(inline, "KEPT_COMPOSITES", frozenset())
    want_tokens, _ = reference_greedy(default_layout, PROMPT, STEPS)
    cache = tmp_path / "xnnpack"
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(cache)})
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        loaded = _load(default_layout, profile, "b")
    assert loaded.prepared.startswith("refused, logits differ from the original file's")
    assert f"serving {default_layout.name} as exported" in loaded.prepared
    assert caplog.text.count("prepared copy of") == 1
    got_tokens, _ = _runner_greedy(loaded.runner, PROMPT, STEPS)
    assert got_tokens == want_tokens
    names = {f.name for f in cache.iterdir()}
    assert f"{'b' * 64}.p{cachefiles.PREPARED_FORMAT}.refused" in names
    assert not [n for n in names if n.endswith((".tflite", ".unchecked"))]
    loaded.runner.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent.runtime"):
        again = _load(default_layout, profile, "b")
    assert again.prepared.startswith("refused, logits differ")
    assert "model prepared" not in caplog.text  # not rewritten, not checked again
    assert _runner_greedy(again.runner, PROMPT, STEPS)[0] == want_tokens


def test_the_builtin_cpu_link_is_refused_where_it_runs_a_wrong_decomposition(
    default_layout, make_profile
) -> None:
    """LiteRT's builtin kernels run the attention composite through its decomposition: on
    this model that is not what the file computes on XNNPACK, so the cpu link refuses it
    instead of serving wrong tokens."""
    profile = make_profile(runtime={"accelerators": ["cpu"]})
    with pytest.raises(AcceleratorError, match="builtin CPU kernels do not compute"):
        litert.load(default_layout, profile, cache_key="c" * 64)


def test_a_transposed_model_still_runs_on_the_builtin_cpu_link(
    tiny_model_factory, make_profile
) -> None:
    path = tiny_model_factory(prefill_lens=(8,), kv_max=64)
    want_tokens, _ = reference_greedy(path, PROMPT, STEPS)
    loaded = litert.load(path, make_profile(runtime={"accelerators": ["cpu"]}))
    assert loaded.accelerator == "cpu"
    assert _runner_greedy(loaded.runner, PROMPT, STEPS)[0] == want_tokens


@pytest.mark.parametrize("quantization", ["int8", "int4_block32"])
def test_quantized_copies_pass_their_check_within_the_tolerance(
    tiny_model_factory, make_profile, tmp_path, quantization
) -> None:
    path = tiny_model_factory(prefill_lens=(8,), kv_max=64, quantization=quantization)
    want_tokens, _ = reference_greedy(path, PROMPT, STEPS)
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "x")})
    loaded = _load(path, profile, "d")
    assert loaded.prepared.startswith("composites inlined"), loaded.prepared
    assert _runner_greedy(loaded.runner, PROMPT, STEPS)[0] == want_tokens


def _poison(src: Path, dst: Path) -> None:
    """`src` with its final norm's weights (the last 1-D float32 buffer of the decode graph)
    set to NaN: every logit of every step is then NaN, like an export whose norm weights were
    left uninitialised."""
    from ai_edge_litert.tools import flatbuffer_utils as fu

    model = fu.read_model(str(src))
    sg = model.subgraphs[
        next(
            s.subgraphIndex
            for s in model.signatureDefs
            if s.signatureKey == b"decode" or s.signatureKey == "decode"
        )
    ]
    weights = [
        t
        for t in sg.tensors
        if t.type == 0
        and len(t.shape) == 1
        and model.buffers[t.buffer].data is not None
        and len(model.buffers[t.buffer].data) > 0
    ]
    for t in weights:  # every norm weight: whatever the graph's order, the logits are NaN
        data = model.buffers[t.buffer].data
        model.buffers[t.buffer].data = np.full(len(data) // 4, np.nan, np.float32).view(np.uint8)
    fu.write_model(model, str(dst))


def nan_model_dir(tiny_model_factory, tmp_path: Path) -> Path:
    """A model directory (fp32, tiny) whose every logit is NaN, with metadata that matches it."""
    from agent.model.directory import load_model_dir, write_model_dir_metadata

    src = tiny_model_factory.model_dir(quantizations=("fp32",), prefill_lens=(8,), kv_max=64)
    d = tmp_path / "nan-model"
    shutil.copytree(src, d)
    _poison(src / "model_fp32.tflite", d / "model_fp32.tflite")
    meta = load_model_dir(src)
    write_model_dir_metadata(
        d,
        name=meta.name,
        version=meta.version,
        context_length=meta.context_length,
        bos_id=meta.bos_id,
        eos_id=meta.eos_id,
        stop_token_ids=meta.stop_token_ids,
        chat_template=meta.chat_template,
        variants=[("model_fp32.tflite", "fp32")],
    )
    return d


def test_non_finite_logits_end_the_request_with_an_error_never_a_token(
    tiny_model_factory, make_profile, tmp_path
) -> None:
    from agent.engine.engine import Engine
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest

    d = nan_model_dir(tiny_model_factory, tmp_path)
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "x")})
    engine = Engine.load(profile, d, state_dir=tmp_path / "state")
    try:
        # the first-load check found it: no copy serves a model whose own logits are NaN
        assert engine.info.prepared.startswith("refused, the model's own logits are not finite")
        for temperature in (0.0, 0.8):
            done = engine.complete(
                GenerateRequest(
                    "hello", max_tokens=16, sampling=SamplingParams(temperature=temperature, seed=1)
                )
            )
            assert done.finish_reason == "error" and done.token_ids == ()
            assert "non-finite logits" in (done.events[-1].error or "")
        stats = engine.stats()
        assert stats.nonfinite_logits == 2 and stats.requests_failed == 2
    finally:
        engine.close()
