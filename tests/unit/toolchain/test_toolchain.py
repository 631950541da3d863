"""The model toolchain: conversion options, signatures, KV layouts, quantization, metadata.

Conversions are shared through the session-scoped ``tiny_model_factory``
(tests/support/tiny_models.py);
this module converts two configurations (~45 s on 2 cores) and derives the quantized variants
from the cached float file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.toolchain

pytest.importorskip("litert_torch", reason="needs the toolchain extra (litert-torch)")

from agent.model.directory import load_model_dir, sha256_file  # noqa: E402
from agent.toolchain.config import TINY_SPEC, DecoderSpec  # noqa: E402
from agent.toolchain.export import ExportOptions, build_torch_model  # noqa: E402
from agent.toolchain.quantize import check_block_divides  # noqa: E402
from tests.support.tiny_models import TinyModelFactory  # noqa: E402

HEADS = TINY_SPEC.num_query_groups
HEAD_DIM = TINY_SPEC.head_dim
VOCAB = TINY_SPEC.vocab_size
LAYERS = TINY_SPEC.num_layers


def _signatures(path: Path) -> dict[str, dict[str, list[str]]]:
    from ai_edge_litert.interpreter import Interpreter

    sigs: dict[str, dict[str, list[str]]] = Interpreter(model_path=str(path)).get_signature_list()
    return sigs


def _io(path: Path, sig: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=str(path)).get_signature_runner(sig)
    ins = {k: tuple(v["shape"]) for k, v in runner.get_input_details().items()}
    outs = {k: tuple(v["shape"]) for k, v in runner.get_output_details().items()}
    return ins, outs


def _weights(path: Path) -> list[tuple[str, str, str]]:
    """(op, weight tensor name, TensorType name) of every FULLY_CONNECTED and
    EMBEDDING_LOOKUP weight in the flatbuffer (the embedding table is named
    ``arith.constant<N>`` by the converter, so ops are identified by their kind)."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(bytearray(path.read_bytes()), 0)
    type_names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    op_names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    out = []
    for sg in model.subgraphs:
        for op in sg.operators:
            code = model.operatorCodes[op.opcodeIndex]
            kind = op_names.get(max(code.builtinCode, code.deprecatedBuiltinCode))
            if kind not in ("FULLY_CONNECTED", "EMBEDDING_LOOKUP"):
                continue
            t = sg.tensors[op.inputs[1]]
            out.append((kind, t.name.decode(), type_names[t.type]))
    return out


def _types(weights: list[tuple[str, str, str]], *, op: str, name: str = "") -> set[str]:
    return {t for kind, n, t in weights if kind == op and name in n}


def _kv_names(n_layers: int) -> set[str]:
    return {f"kv_cache_{kv}_{i}" for kv in "kv" for i in range(n_layers)}


@pytest.fixture(scope="module")
def transposed(tiny_model_factory: TinyModelFactory) -> Path:
    path: Path = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    return path


@pytest.fixture(scope="module")
def default_masked(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory(layout="default", prefill_lens=(8, 16), kv_max=64, mask_as_input=True)


def test_transposed_layout_one_prefill(transposed: Path) -> None:
    sigs = _signatures(transposed)
    assert set(sigs) == {"prefill_8", "decode"}
    kv = _kv_names(LAYERS)
    assert set(sigs["decode"]["inputs"]) == kv | {"tokens", "input_pos"}
    assert set(sigs["decode"]["outputs"]) == kv | {"logits"}
    assert set(sigs["prefill_8"]["outputs"]) == kv  # no logits on prefill

    ins, outs = _io(transposed, "decode")
    assert ins["tokens"] == (1, 1) and ins["input_pos"] == (1,)
    assert outs["logits"] == (1, 1, VOCAB)
    for i in range(LAYERS):
        assert ins[f"kv_cache_k_{i}"] == (1, HEADS, 64, HEAD_DIM)
        assert ins[f"kv_cache_v_{i}"] == (1, HEADS, HEAD_DIM, 64)
        assert outs[f"kv_cache_k_{i}"] == ins[f"kv_cache_k_{i}"]
    pins, _ = _io(transposed, "prefill_8")
    assert pins["tokens"] == (1, 8) and pins["input_pos"] == (8,)


def test_default_layout_several_prefills_with_mask(default_masked: Path) -> None:
    sigs = _signatures(default_masked)
    assert set(sigs) == {"prefill_8", "prefill_16", "decode"}
    for name in sigs:
        assert "mask" in sigs[name]["inputs"]
    for name, n in (("prefill_8", 8), ("prefill_16", 16), ("decode", 1)):
        ins, _ = _io(default_masked, name)
        assert ins["tokens"] == (1, n)
        assert ins["mask"] == (1, 1, n, 64)
        for i in range(LAYERS):
            assert ins[f"kv_cache_k_{i}"] == (1, 64, HEADS, HEAD_DIM)
            assert ins[f"kv_cache_v_{i}"] == (1, 64, HEADS, HEAD_DIM)


# The weights' digest, as code run both here and in a fresh interpreter.
_DIGEST = """
import hashlib
from agent.toolchain.config import TINY_SPEC
from agent.toolchain.export import build_torch_model

def digest(seed):
    h = hashlib.sha256()
    state = build_torch_model(TINY_SPEC, kv_max=64, seed=seed).state_dict()
    for name, p in sorted(state.items()):
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()
"""


def test_random_weights_are_the_same_in_a_fresh_process() -> None:
    # A fresh interpreter imports litert-torch during its first build; the weights must not
    # depend on that (a process pool's first model once came out different from the others).
    import subprocess
    import sys

    root = ROOT
    fresh = subprocess.run(
        [sys.executable, "-c", _DIGEST + "print(digest(0))"],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    scope: dict[str, object] = {}
    exec(_DIGEST, scope)  # here, where litert-torch was imported long ago
    digest = scope["digest"]
    assert callable(digest)
    assert fresh.stdout.strip().splitlines()[-1] == digest(0)
    assert digest(1) != digest(0)


def test_float_tflite_matches_torch(transposed: Path) -> None:
    from agent.toolchain.perplexity import check_tflite_matches_torch

    model = build_torch_model(TINY_SPEC, kv_max=64, seed=0)
    window = np.random.default_rng(1).integers(3, VOCAB, 24).tolist()
    res = check_tflite_matches_torch(transposed, TINY_SPEC, model.state_dict(), window)
    assert res["max_abs_diff"] < 1e-3 * max(1.0, res["max_logit"])
    assert res["tflite_ppl"] == pytest.approx(res["torch_ppl"], rel=1e-4)


def test_masked_model_decodes_like_the_unmasked_one(transposed: Path, default_masked: Path) -> None:
    from agent.toolchain.perplexity import DecodeRunner

    window = np.random.default_rng(2).integers(3, VOCAB, 12).tolist()
    a = DecodeRunner(transposed).window_logits(window)
    b = DecodeRunner(default_masked).window_logits(window)
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_int8_weights_and_size(tiny_model_factory: TinyModelFactory, transposed: Path) -> None:
    q8 = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64, quantization="int8")
    assert q8.stat().st_size < 0.45 * transposed.stat().st_size
    assert set(_signatures(q8)) == {"prefill_8", "decode"}
    w = _weights(q8)
    assert _types(w, op="FULLY_CONNECTED") == {"INT8"}
    assert _types(w, op="EMBEDDING_LOOKUP") == {"INT8"}
    assert {t for _, _, t in _weights(transposed)} == {"FLOAT32"}


def test_int4_block32_weights_and_size(
    tiny_model_factory: TinyModelFactory, transposed: Path
) -> None:
    from agent.toolchain.perplexity import DecodeRunner

    q8 = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64, quantization="int8")
    q4 = tiny_model_factory(
        layout="transposed", prefill_lens=(8,), kv_max=64, quantization="int4_block32"
    )
    assert q4.stat().st_size < q8.stat().st_size
    assert _types(_weights(q4), op="FULLY_CONNECTED") == {"INT4"}
    # and it still runs: logits are finite and of the right shape
    logits = DecodeRunner(q4).window_logits([1, 5, 9, 13])
    assert logits.shape == (3, VOCAB) and np.isfinite(logits).all()


def test_mixed_keeps_embedding_and_attention_output_float(
    tiny_model_factory: TinyModelFactory,
) -> None:
    mixed = tiny_model_factory(
        layout="transposed", prefill_lens=(8,), kv_max=64, quantization="mixed"
    )
    w = _weights(mixed)
    assert _types(w, op="EMBEDDING_LOOKUP") == {"FLOAT32"}
    assert _types(w, op="FULLY_CONNECTED", name="Linear_output_projection") == {"FLOAT32"}
    assert _types(w, op="FULLY_CONNECTED", name="Linear_w") == {"INT8"}
    assert _types(w, op="FULLY_CONNECTED", name="Linear_qkv_projection") == {"INT8"}
    assert _types(w, op="FULLY_CONNECTED", name="Linear_lm_head") == {"INT8"}


def test_block_size_must_divide_the_input_dims() -> None:
    spec = DecoderSpec(
        vocab_size=256, num_layers=1, embedding_dim=96, num_heads=3, intermediate_size=192
    )
    check_block_divides(spec, "int4_block32")
    with pytest.raises(ValueError, match="block size 64"):
        check_block_divides(spec, "int4_block64")
    check_block_divides(spec, "int8")


def test_export_options_are_checked() -> None:
    with pytest.raises(ValueError):
        ExportOptions(layout="sideways")
    with pytest.raises(ValueError):
        ExportOptions(prefill_lens=(2048,), kv_max=1024)
    assert ExportOptions(prefill_lens=(128, 32, 32)).prefill_lens == (32, 128)
    with pytest.raises(ValueError, match="verify lengths"):
        ExportOptions(prefill_lens=(8,), verify_lens=(16,))  # longer than the shortest prefill
    with pytest.raises(ValueError, match="verify lengths"):
        ExportOptions(verify_lens=(1,))  # decode already is one token
    opts = ExportOptions(prefill_lens=(32,), verify_lens=(8, 4, 4))
    assert opts.verify_lens == (4, 8)
    assert opts.tag().endswith("_v4_v8") and "_v" not in ExportOptions().tag()


def test_code_tokenizer_keeps_indentation(tmp_path: Path) -> None:
    from agent.toolchain import tokenizer as tk

    path = tk.train_tokenizer(
        [tk.TINY_TEXT * 3], tmp_path / "t.model", vocab_size=256, byte_fallback=False, tiny=True
    )
    sp = tk.load(path)
    text = "def f(x):\n    if x:\n        return x + 1\n"
    ids = sp.encode(text)
    assert sp.decode(ids) == text
    assert sp.piece_to_id("\n") in ids
    assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)


def test_a_padded_tokenizer_reaches_the_model_vocabulary(tmp_path: Path) -> None:
    """A random model of a real LLM's shape has a larger vocabulary than our tokenizer; the
    padded copy encodes as before and decodes every id (LiteRT-LM samples over all of them)."""
    from agent.toolchain import tokenizer as tk

    src = tk.train_tokenizer(
        [tk.TINY_TEXT * 3], tmp_path / "t.model", vocab_size=256, byte_fallback=False, tiny=True
    )
    small = tk.load(src)
    padded = tk.load(tk.pad_tokenizer(src, 300, tmp_path / "p.model"))
    assert (small.vocab_size(), padded.vocab_size()) == (small.vocab_size(), 300)
    text = "def f(x):\n    return x + 1\n"
    assert padded.encode(text) == small.encode(text)
    assert padded.decode([299]) == "<unused_299>"
    with pytest.raises(ValueError, match="more than the vocabulary"):
        tk.pad_tokenizer(src, 100, tmp_path / "q.model")


def test_metadata_round_trips(tiny_model_factory: TinyModelFactory) -> None:
    d = tiny_model_factory.model_dir(quantizations=("fp32", "int8"), prefill_lens=(8,), kv_max=64)
    meta = load_model_dir(d)
    assert meta.context_length == 64
    assert (meta.bos_id, meta.eos_id, meta.stop_token_ids) == (1, 2, (2,))
    assert "{user}" in meta.chat_template
    assert [v.quantization for v in meta.variants] == ["fp32", "int8"]
    for v in meta.variants:
        path = meta.path_of(v)
        assert v.sha256 == sha256_file(path)
        assert v.size == path.stat().st_size
        assert set(_signatures(path)) == {"prefill_8", "decode"}
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(meta.tokenizer_path))
    assert sp.vocab_size() <= VOCAB
