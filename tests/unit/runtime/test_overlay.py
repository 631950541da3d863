"""The prepared copy as an overlay on the original flatbuffer (`agent.runtime.prepare.overlay`): a
model
whose weights are stored after its flatbuffer (offset/size, as the toolchain exports them)
keeps every weight byte at an offset of the same alignment, and its first load checks and
serves the copy."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from agent.model.tflite.file import read_model_file
from agent.model.tflite.schema import schema
from agent.runtime import litert
from agent.runtime.prepare.inline import _flatbuffer_end, prepare_file


def _external(path: Path) -> list[tuple[int, int, bytes]]:
    """(offset, size, bytes) of each buffer stored after the flatbuffer, by buffer index."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        root = schema.Model.GetRootAs(view, 0)
        out = []
        for i in range(root.BuffersLength()):
            b = root.Buffers(i)
            if b.Offset() > 1:
                out.append((b.Offset(), b.Size(), bytes(view[b.Offset() : b.Offset() + b.Size()])))
        return out


def test_weights_stored_after_the_flatbuffer_keep_their_bytes_and_alignment(
    tiny_model_factory, make_profile, tmp_path
) -> None:
    src = tiny_model_factory(prefill_lens=(8, 32), kv_max=512, quantization="int8")
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        assert _flatbuffer_end(view) < len(view)  # the export keeps its weights after it
    copy = tmp_path / "copy.tflite"
    done = prepare_file(src, copy, (256,), 512)
    assert done.windows == (256,) and done.inlined > 0
    before, after = _external(src), _external(copy)
    assert len(before) >= 4
    assert [b[1:] for b in after] == [b[1:] for b in before]  # sizes and bytes, by index
    shifts = {a[0] - b[0] for a, b in zip(after, before, strict=True)}
    assert len(shifts) == 1 and shifts.pop() % 4096 == 0  # every alignment kept
    made = read_model_file(copy)
    assert {s.key for s in made.signatures} == {
        *(s.key for s in read_model_file(src).signatures),
        "kv256_decode",
        "kv256_prefill_32",
    }
    # its first load checks the copy against the file (windows, logits) and serves it
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    loaded = litert.load(src, profile, cache_key="e" * 64)
    assert loaded.prepared.startswith("composites inlined, KV windows 256"), loaded.prepared
    plain = litert.load(src, make_profile(), kv_windows=False).runner
    outs = []
    for r in (loaded.runner, plain):
        kv = r.new_kv()
        r.reserve(kv, 12, 0)
        r.prefill(kv, list(range(3, 11)), 0)
        outs.append(np.array(r.decode(kv, 11, 8), copy=True))
    scale = max(1.0, float(np.abs(outs[1]).max()))
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=2e-2 * scale)
