"""Batched decode signatures (`agent.toolchain.batch`): their inputs and outputs, and each row
equal to single-row ``decode`` bit for bit, run by a bare ai_edge_litert Interpreter (nothing of
edge-agent's runtime) with rows at different positions over different KV contents.

One conversion (~45 s on 2 cores: prefill 8, decode, decode_batch_2, decode_batch_4); int8 is
derived from its float file in < 1 s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.toolchain

pytest.importorskip("litert_torch", reason="needs the toolchain extra (litert-torch)")

from agent.toolchain.export import ExportOptions  # noqa: E402
from tests.support.tiny_models import LEGACY  # noqa: E402

BATCH = (2, 4)
VOCAB = 256


@pytest.fixture(scope="module")
def batched(tiny_model_factory):
    if LEGACY:
        pytest.skip("batched decode is exported and run on ai-edge-litert only")
    return lambda quantization: tiny_model_factory(
        prefill_lens=(8,), kv_max=64, batch_sizes=BATCH, quantization=quantization
    )


def _interpreter(path: Path) -> Any:
    from ai_edge_litert.interpreter import Interpreter

    return Interpreter(model_path=str(path), num_threads=2)


def test_batch_sizes_are_an_option_and_named_in_the_tag() -> None:
    assert ExportOptions().batch_sizes == ()
    assert ExportOptions().tag() == ExportOptions(batch_sizes=()).tag()  # old caches stay valid
    opts = ExportOptions(batch_sizes=(4, 2, 4))
    assert opts.batch_sizes == (2, 4) and opts.tag().endswith("_b2_b4")
    with pytest.raises(ValueError, match="batch sizes"):
        ExportOptions(batch_sizes=(1,))


def test_batch_signatures_bind_each_rows_own_kv(batched) -> None:
    it = _interpreter(batched("fp32"))
    sigs = it.get_signature_list()
    assert sorted(sigs) == ["decode", "decode_batch_2", "decode_batch_4", "prefill_8"]
    for rows in BATCH:
        run = it.get_signature_runner(f"decode_batch_{rows}")
        ins = {k: tuple(v["shape"]) for k, v in run.get_input_details().items()}
        outs = {k: tuple(v["shape"]) for k, v in run.get_output_details().items()}
        kv = {f"r{b}_kv_cache_{p}_{i}" for b in range(rows) for p in "kv" for i in range(2)}
        assert set(ins) == {"tokens", "input_pos"} | kv
        assert set(outs) == {"logits"} | kv
        assert ins["tokens"] == (rows, 1) and ins["input_pos"] == (rows,)
        assert outs["logits"] == (rows, 1, VOCAB)
        assert ins["r1_kv_cache_k_0"] == (1, 1, 64, 32)  # decode's transposed K, per row
        assert ins["r1_kv_cache_v_1"] == (1, 1, 32, 64)


def _decode(run: Any, kv: dict[str, np.ndarray], token: int, pos: int) -> tuple[Any, Any]:
    res = run(tokens=np.array([[token]], np.int32), input_pos=np.array([pos], np.int32), **kv)
    return res["logits"].reshape(-1).copy(), {k: res[k] for k in kv}


@pytest.mark.parametrize("quantization", ["fp32", "int8"])
def test_each_row_equals_single_row_decode_bit_for_bit(batched, quantization) -> None:
    it = _interpreter(batched(quantization))
    decode = it.get_signature_runner("decode")
    details = decode.get_input_details()
    names = [n for n in details if n.startswith("kv_cache_")]
    rng = np.random.default_rng(7)

    def history(n: int) -> dict[str, np.ndarray]:
        kv = {k: np.zeros(details[k]["shape"], np.float32) for k in names}
        for pos, tok in enumerate(rng.integers(0, VOCAB, n)):
            _, kv = _decode(decode, kv, int(tok), pos)
        return kv

    for rows in BATCH:
        run = it.get_signature_runner(f"decode_batch_{rows}")
        # different positions (0 and the last row included) and different histories
        for positions in ([0, 63, 17, 5][:rows], [30, 2, 2, 40][:rows]):
            kvs = [history(p) for p in positions]
            tokens = [int(t) for t in rng.integers(0, VOCAB, rows)]
            want = [_decode(decode, kvs[b], tokens[b], positions[b]) for b in range(rows)]
            args: dict[str, np.ndarray] = {
                "tokens": np.array(tokens, np.int32).reshape(rows, 1),
                "input_pos": np.array(positions, np.int32),
            }
            for b in range(rows):
                args.update({f"r{b}_{k}": v for k, v in kvs[b].items()})
            res = run(**args)
            logits = res["logits"].reshape(rows, -1)
            for b in range(rows):
                np.testing.assert_array_equal(logits[b], want[b][0])
                for k in names:
                    np.testing.assert_array_equal(res[f"r{b}_{k}"], want[b][1][k])
            assert not np.array_equal(logits[0], logits[1])  # the rows really differ
