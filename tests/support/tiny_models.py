"""Session-scoped fixtures that build tiny, real LiteRT decoders with the toolchain.

Import these names from ``tests/conftest.py`` (``from tests.support.tiny_models import *`` or by
name).

* ``tiny_model_factory``: a `TinyModelFactory`; ``tiny_model_factory(layout=..., prefill_lens=...,
  kv_max=..., mask_as_input=..., quantization=..., seed=...)`` returns the path of a
  ``.tflite`` with ``prefill_<N>`` + ``decode`` signatures and externalized KV
  (``kv_cache_k_<i>``/``kv_cache_v_<i>``). ``tiny_model_factory.model_dir(...)`` returns a
  model directory (variants + SentencePiece tokenizer + metadata.json).
* ``tiny_tokenizer``: path of a real SentencePiece model (vocab 256, ids pad 0, bos 1, eos 2,
  unk 3, ``\\n`` is a piece) trained on a few KB of text.
* ``tiny_model``: the default tiny model (transposed KV, prefill 8, kv_max 64, fp32).
* ``tiny_model_dir``: a model directory: transposed KV, prefill [8, 32], kv_max 128,
  variants fp32 + int8, context_length 128.

The tiny decoder is `agent.toolchain.config.TINY_SPEC`: 2 layers, dim 128, 4 heads of 32,
1 KV head, gated FFN 256, vocab 256, random weights (deterministic per seed).

Cost: a conversion takes ~8 s per signature on 2 cores (one prefill + decode ≈ 17 s);
quantized variants are derived from the cached float file in < 1 s. Every distinct set of
conversion options is converted once per session. Set ``EDGE_AGENT_TINY_CACHE=<dir>`` to keep
the files across sessions (keyed by the options and a hash of the toolchain source).

All fixtures skip the test when the toolchain extra (torch, litert-torch) is not installed.

Legacy backend runs (``EDGE_AGENT_TEST_BACKEND=tflite-runtime``, in ``.venv-legacy``, which has
no toolchain): every model is exported with composites off and int8 is weight-only (what
tflite-runtime runs), int4 tests are skipped, and missing files are built by the toolchain's
interpreter (``EDGE_AGENT_TOOLCHAIN_PYTHON``) into the same cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import ROOT

LEGACY = os.environ.get("EDGE_AGENT_TEST_BACKEND") == "tflite-runtime"
TOOLCHAIN_PYTHON = os.environ.get("EDGE_AGENT_TOOLCHAIN_PYTHON", "")

TINY_VOCAB = 256
TINY_MODEL_NAME = "tiny-test"
TINY_CHAT_TEMPLATE = "{system}\n{user}\n"


def _toolchain_fingerprint() -> str:
    root = ROOT / "agent" / "toolchain"
    h = hashlib.sha256()
    for name in ("config.py", "export.py", "quantize.py", "tokenizer.py", "batch.py"):
        p = root / name
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _legacy_quant(quantization: str) -> str:
    if quantization.startswith("int4"):
        pytest.skip("tflite-runtime cannot run int4 models")
    return "int8_weight_only" if quantization in ("int8", "mixed") else quantization


def _build_elsewhere(root: Path, method: str, kwargs: dict[str, object]) -> Path:
    """Build with the toolchain's interpreter (the legacy venv has no torch)."""
    import json
    import subprocess

    code = (
        "import json, sys; from pathlib import Path; from tests.support.tiny_models import "
        "TinyModelFactory as F; f = F(Path(sys.argv[1])); "
        "print(getattr(f, sys.argv[2])(**json.loads(sys.argv[3])))"
    )
    r = subprocess.run(
        [TOOLCHAIN_PYTHON, "-c", code, str(root), method, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "EDGE_AGENT_TEST_BACKEND"},
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(r.stdout.strip().splitlines()[-1])


def _require_toolchain() -> None:
    if LEGACY:
        if not TOOLCHAIN_PYTHON:
            pytest.skip("legacy runs build models with EDGE_AGENT_TOOLCHAIN_PYTHON")
        return
    pytest.importorskip("torch", reason="needs the toolchain extra (torch)")
    pytest.importorskip("litert_torch", reason="needs the toolchain extra (litert-torch)")
    pytest.importorskip("sentencepiece")


class TinyModelFactory:
    """Builds and caches tiny `.tflite` decoders and model directories under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._tokenizer: Path | None = None

    # -- single files -------------------------------------------------------------------
    def __call__(
        self,
        *,
        layout: str = "transposed",
        prefill_lens: Sequence[int] = (8,),
        kv_max: int = 64,
        mask_as_input: bool = False,
        quantization: str = "fp32",
        seed: int = 0,
        enable_hlfb: bool = True,
        decode_windows: Sequence[int] = (),
        verify_lens: Sequence[int] = (),
        batch_sizes: Sequence[int] = (),
    ) -> Path:
        if LEGACY:
            kwargs = {
                "layout": layout,
                "prefill_lens": list(prefill_lens),
                "kv_max": kv_max,
                "mask_as_input": mask_as_input,
                "quantization": _legacy_quant(quantization),
                "seed": seed,
                "enable_hlfb": False,
                "decode_windows": list(decode_windows),
                "verify_lens": list(verify_lens),
                "batch_sizes": list(batch_sizes),
            }
            return _build_elsewhere(self.root, "__call__", kwargs)
        from agent.toolchain.config import TINY_SPEC
        from agent.toolchain.export import ExportOptions, export_tiny
        from agent.toolchain.quantize import quantize_file

        opts = ExportOptions(
            layout=layout,
            prefill_lens=tuple(prefill_lens),
            kv_max=kv_max,
            mask_as_input=mask_as_input,
            enable_hlfb=enable_hlfb,
            decode_windows=tuple(decode_windows),
            verify_lens=tuple(verify_lens),
            batch_sizes=tuple(batch_sizes),
        )
        stem = f"tiny_{opts.tag()}_s{seed}"
        target = self.root / f"{stem}_{quantization}.tflite"
        with self._lock:
            if target.exists():
                return target
            fp32 = self.root / f"{stem}_fp32.tflite"
            if not fp32.exists():
                made = export_tiny(
                    self.root,
                    layout=layout,
                    prefill_lens=opts.prefill_lens,
                    kv_max=kv_max,
                    mask_as_input=mask_as_input,
                    quantization="fp32",
                    seed=seed,
                    enable_hlfb=enable_hlfb,
                    decode_windows=opts.decode_windows,
                    verify_lens=opts.verify_lens,
                    batch_sizes=opts.batch_sizes,
                )
                assert made == fp32, (made, fp32)
            if quantization != "fp32":
                quantize_file(fp32, target, quantization, TINY_SPEC)
            return target

    # -- tokenizer ------------------------------------------------------------------------
    def tokenizer(self) -> Path:
        if LEGACY:
            return _build_elsewhere(self.root, "tokenizer", {})
        from agent.toolchain import tokenizer as tk

        with self._lock:
            if self._tokenizer is None or not self._tokenizer.exists():
                path = self.root / "tiny_tokenizer.model"
                if not path.exists():
                    tk.train_tokenizer(
                        [tk.TINY_TEXT * 3],
                        path,
                        vocab_size=TINY_VOCAB,
                        byte_fallback=False,
                        tiny=True,
                    )
                self._tokenizer = path
            return self._tokenizer

    # -- model directories ----------------------------------------------------------------
    def model_dir(
        self,
        *,
        quantizations: Sequence[str] = ("fp32", "int8"),
        layout: str = "transposed",
        prefill_lens: Sequence[int] = (8, 32),
        kv_max: int = 128,
        mask_as_input: bool = False,
        seed: int = 0,
        name: str = TINY_MODEL_NAME,
        version: str = "0.0.1",
        enable_hlfb: bool = True,
        decode_windows: Sequence[int] = (),
        verify_lens: Sequence[int] = (),
        batch_sizes: Sequence[int] = (),
    ) -> Path:
        """A model directory (``model_<quant>.tflite`` files, tokenizer, metadata.json).

        A fresh directory per distinct argument set; treat it as read-only (copy it with
        `shutil.copytree` to modify it).
        """
        if LEGACY:
            kwargs = {
                "quantizations": list(dict.fromkeys(_legacy_quant(q) for q in quantizations)),
                "layout": layout,
                "prefill_lens": list(prefill_lens),
                "kv_max": kv_max,
                "mask_as_input": mask_as_input,
                "seed": seed,
                "name": name,
                "version": version,
                "enable_hlfb": False,
                "decode_windows": list(decode_windows),
                "verify_lens": list(verify_lens),
                **({"batch_sizes": list(batch_sizes)} if batch_sizes else {}),
            }
            return _build_elsewhere(self.root, "model_dir", kwargs)
        from agent.model.directory import write_model_dir_metadata
        from agent.toolchain.tokenizer import BOS_ID, EOS_ID

        key = hashlib.sha256(
            repr(
                (
                    tuple(quantizations),
                    layout,
                    tuple(prefill_lens),
                    kv_max,
                    mask_as_input,
                    seed,
                    name,
                    version,
                    *(() if enable_hlfb else ("unfused",)),
                    *((tuple(decode_windows),) if decode_windows else ()),
                    *((("verify", *verify_lens),) if verify_lens else ()),
                    *((("batch", *batch_sizes),) if batch_sizes else ()),
                )
            ).encode()
        ).hexdigest()[:10]
        d = self.root / f"dir_{key}"
        if (d / "metadata.json").exists():
            return d
        files = []
        for q in quantizations:
            src = self(
                layout=layout,
                prefill_lens=prefill_lens,
                kv_max=kv_max,
                mask_as_input=mask_as_input,
                quantization=q,
                seed=seed,
                enable_hlfb=enable_hlfb,
                decode_windows=decode_windows,
                verify_lens=verify_lens,
                batch_sizes=batch_sizes,
            )
            files.append((f"model_{q}.tflite", q, src))
        tok = self.tokenizer()
        with self._lock:
            tmp = self.root / f".dir_{key}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for fname, _, src in files:
                shutil.copyfile(src, tmp / fname)
            shutil.copyfile(tok, tmp / "tokenizer.model")
            write_model_dir_metadata(
                tmp,
                name=name,
                version=version,
                context_length=kv_max,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                stop_token_ids=[EOS_ID],
                chat_template=TINY_CHAT_TEMPLATE,
                variants=[(fname, q) for fname, q, _ in files],
            )
            shutil.rmtree(d, ignore_errors=True)
            os.replace(tmp, d)
        return d


def cache_root() -> Path | None:
    """Where `EDGE_AGENT_TINY_CACHE` keeps this toolchain's files (None: per-run temp dir)."""
    cache = os.environ.get("EDGE_AGENT_TINY_CACHE")
    return Path(cache).expanduser() / _toolchain_fingerprint() if cache else None


# The conversions the suite asks for (the main run and the legacy run), one entry per float
# export with the variants derived from it. `scripts/test` builds them side by side before
# pytest starts, while ruff and mypy run: one by one as tests first ask, a cold cache costs
# ~4.5 min of the suite's wall time. A conversion missing here is still built on first use.
_T: dict[str, Any] = {"layout": "transposed"}
_UNFUSED: dict[str, Any] = {"enable_hlfb": False}
PREBUILD: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = (
    ({**_T}, ("int8", "int4_block32", "mixed")),
    ({**_T, "prefill_lens": (8, 16)}, ("int8",)),
    ({**_T, "prefill_lens": (8, 32), "kv_max": 128}, ("int8",)),
    ({**_T, "mask_as_input": True}, ()),
    ({**_T, "decode_windows": (16, 32)}, ("int8",)),
    ({**_T, "kv_max": 32}, ()),  # K = V = [1, 1, 32, 32]: either KV layout (test_litertlm)
    ({"layout": "default"}, ()),
    ({"layout": "default", "prefill_lens": (8, 16), "mask_as_input": True}, ()),
    ({**_T, **_UNFUSED}, ("int8",)),
    ({"layout": "default", **_UNFUSED}, ()),
    ({**_T, **_UNFUSED, "prefill_lens": (8, 32), "kv_max": 128}, ("int8_weight_only",)),
    ({**_T, **_UNFUSED, "prefill_lens": (8, 32), "kv_max": 10240}, ("int8_weight_only",)),
)


def _prebuild_one(root: Path, options: dict[str, Any], quantizations: tuple[str, ...]) -> str:
    factory = TinyModelFactory(root)
    built = [factory(**options, quantization=q).name for q in ("fp32", *quantizations)]
    return ", ".join(built)


def prebuild(root: Path, jobs: int) -> None:
    """Build every `PREBUILD` conversion into `root`, `jobs` processes at a time."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    TinyModelFactory(root).tokenizer()
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters: torch is not fork-safe
    with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn) as pool:
        futures = [pool.submit(_prebuild_one, root, o, q) for o, q in PREBUILD]
        for f in futures:
            print("[tiny models]", f.result(), flush=True)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    _require_toolchain()
    return TinyModelFactory(cache_root() or tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory.tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory.model_dir()


__all__ = [
    "TINY_CHAT_TEMPLATE",
    "TINY_MODEL_NAME",
    "TINY_VOCAB",
    "TinyModelFactory",
    "tiny_model",
    "tiny_model_dir",
    "tiny_model_factory",
    "tiny_tokenizer",
]


if __name__ == "__main__":  # python -m tests.support.tiny_models: fill EDGE_AGENT_TINY_CACHE
    target = cache_root()
    if target is None:
        raise SystemExit("set EDGE_AGENT_TINY_CACHE to the directory the tests will use")
    jobs = max(1, min(len(os.sched_getaffinity(0)), 4))
    prebuild(target, jobs)
    from tests.support import (
        families,  # then the model-family matrix (tests/unit/runtime/test_families.py)
    )

    families.prebuild(families.cache_root() or target, min(jobs, 2))
