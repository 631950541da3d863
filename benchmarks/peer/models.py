"""The peer benchmark's inputs: the models (built by the toolchain on first use), their
LiteRT-LM bundles and the bench profiles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._report import ROOT
from benchmarks.peer.spec import CACHE, have


def ensure_model(target: Path, build_args: list[str]) -> Path | None:
    """The model directory, built by the toolchain on first use; None if it cannot be."""
    if (target / "metadata.json").exists():
        return target
    if not (have("torch") and have("litert_torch")):
        print(f"SKIP building {target.name}: the toolchain extra (torch, litert-torch) is missing")
        return None
    name = f"{target.name}-random"
    cmd = [sys.executable, str(ROOT / "scripts" / "build_model.py"), *build_args]
    cmd += ["--name", name, "--out", str(target)]
    print("building", target.name, "(once; several minutes):", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return target


def pack_litertlm(model_dir: Path, quant: str) -> Path | None:
    """The `.litertlm` bundle of one variant: the same `.tflite` bytes plus the tokenizer."""
    if not (have("litert_lm") and have("litert_lm_builder")):
        return None
    from litert_lm_builder.litertlm_builder import (
        DType,
        LitertLmFileBuilder,
        Metadata,
        TfLiteModelType,
    )
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    from agent.model.directory import load_model_dir

    meta = load_model_dir(model_dir)
    variant = next(v for v in meta.variants if v.quantization == quant)
    out = CACHE / f"{model_dir.name}_{quant}_{variant.sha256[:12]}.litertlm"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    md = llm_metadata_pb2.LlmMetadata()
    if meta.bos_id is not None:
        md.start_token.token_ids.ids.append(meta.bos_id)
    for stop in sorted(meta.stop_ids):
        md.stop_tokens.add().token_ids.ids.append(stop)
    md.max_num_tokens = meta.context_length
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        md_path = Path(tmp) / "llm_metadata.pb"
        md_path.write_bytes(md.SerializeToString())
        b = LitertLmFileBuilder()
        b.add_system_metadata(Metadata(key="Authors", value="edge-agent bench", dtype=DType.STRING))
        b.add_llm_metadata(str(md_path))
        b.add_sentencepiece_tokenizer(str(meta.tokenizer_path))
        b.add_tflite_model(str(meta.path_of(variant)), TfLiteModelType.PREFILL_DECODE)
        partial = Path(tmp) / out.name
        with open(partial, "wb") as f:
            b.build(f)
        os.replace(partial, out)
    return out


def bench_profile(threads: int, quant: str, cold: bool = False) -> Path:
    """The dev profile with `threads` threads, a persistent weight cache and no prefix cache
    (LiteRT-LM has none across requests: repeated prompts must be prefilled every time).
    `cold`: its weight cache directory is emptied, so the load prepares and packs the model."""
    from agent.profile import profiles_dir

    text = (profiles_dir() / "generic-x86_64.toml").read_text()
    kind = "cold-" if cold else ""
    out = CACHE / f"bench-{kind}{threads}t-{quant.replace('_', '-')}.toml"
    weights = CACHE / f"xnnpack{'-cold' if cold else ''}" / quant
    if cold:
        shutil.rmtree(weights, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    text = text.replace('name = "generic-x86_64"', f'name = "{out.stem}"')
    text = text.replace("num_threads = 2", f"num_threads = {threads}")
    text = text.replace("prefix_max_bytes = 134_217_728", "prefix_max_bytes = 0")
    text = text.replace(
        'arena_extend_strategy = "kNextPowerOfTwo"',
        f'arena_extend_strategy = "kNextPowerOfTwo"\nxnnpack_weight_cache_dir = "{weights}"',
    )
    out.write_text(text)
    return out


def model_and_bundle(
    section: str, spec: tuple[Path, list[str]], skipped: list[str]
) -> tuple[Path | None, Path | None]:
    """A section's int8 model and its LiteRT-LM bundle, each None (and said so) if missing."""
    model = ensure_model(*spec)
    if model is None:
        skipped.append(f"{section}: no model (toolchain extra missing)")
        return None, None
    bundle = pack_litertlm(model, "int8")
    if bundle is None:
        skipped.append(f"{section}: the LiteRT-LM column (peer extra missing)")
    return model, bundle
