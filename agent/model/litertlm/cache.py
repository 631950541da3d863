"""The cache `.litertlm` bundles are extracted into, and `open_litertlm`, which gives a bundle's
`ModelMeta`: content-addressed files written atomically, so a start that dies half-way leaves
nothing a later start trusts, and a later start of the same bundle reads only its header.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from agent.base.errors import ModelFormatError
from agent.base.fsutil import atomic_write_bytes
from agent.model.directory import ModelMeta, Variant
from agent.model.litertlm.bundle import Bundle, extract_model, read_bundle, tokenizer_file

log = logging.getLogger(__name__)

_MEMO_FORMAT: Final = 1


@dataclass(frozen=True, slots=True)
class _Unpacked:
    model_file: str  # relative to the cache directory
    sha256: str
    size: int
    quantization: str
    context_length: int
    tokenizer: str  # relative to the cache directory


def _memo_path(cache: Path, bundle: Path) -> Path:
    key = hashlib.sha256(str(bundle.resolve()).encode()).hexdigest()[:32]
    return cache / "bundles" / f"{key}.json"


def _stamp(bundle: Bundle) -> list[int]:
    return _stamp_of(bundle.path)


def _stamp_of(path: Path) -> list[int]:
    st = path.stat()
    return [_MEMO_FORMAT, st.st_size, st.st_mtime_ns, st.st_ino]


def _file_stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _remembered(cache: Path, bundle: Bundle) -> _Unpacked | None:
    try:
        memo = json.loads(_memo_path(cache, bundle.path).read_text())
        if memo["stamp"] != _stamp(bundle):
            return None
        u = _Unpacked(**memo["unpacked"])
        if _file_stamp(cache / u.model_file) != memo["model_stamp"]:
            return None  # replaced or changed since: extract again
        if not (cache / u.tokenizer).is_file():
            return None
        return u
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _unpack(cache: Path, bundle: Bundle, llm_hint: int | None) -> _Unpacked:
    from agent.model.facts import context_length_of, quantization_of
    from agent.model.tflite.file import read_model_file

    stamp = _stamp(bundle)
    known = _remembered(cache, bundle)
    if known is not None:
        return known
    log.info("%s: extracting the model and tokenizer into %s", bundle.path, cache)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".model.", suffix=".tmp")
    os.close(fd)
    try:
        sha = extract_model(bundle, Path(tmp))
        model_file = f"{sha}.tflite"
        os.replace(tmp, cache / model_file)
    finally:
        Path(tmp).unlink(missing_ok=True)
    model = read_model_file(cache / model_file)
    context, _ = context_length_of(model, llm_hint)
    name, data = tokenizer_file(bundle)
    tok_rel = f"tokenizers/{hashlib.sha256(data).hexdigest()}/{name}"
    if not (cache / tok_rel).is_file():
        (cache / tok_rel).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cache / tok_rel, data)
    u = _Unpacked(model_file, sha, bundle.model.size, quantization_of(model), context, tok_rel)
    memo = {
        "stamp": stamp,
        "bundle": str(bundle.path.resolve()),
        "unpacked": asdict(u),
        "model_stamp": _file_stamp(cache / model_file),
    }
    memo_path = _memo_path(cache, bundle.path)
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(memo_path, json.dumps(memo).encode())
    _prune(cache)
    return u


_EXTRACTED = re.compile(r"^[0-9a-f]{64}\.tflite$")
_PRUNE_AGE_S: Final = 600.0


def _prune(cache: Path) -> None:
    """Remove what bundles that are gone or changed left in `cache`: their notes, and the
    model and tokenizer files no remaining bundle's note names (a process still running one
    keeps its mapped pages; a later start of it extracts again). Best effort."""
    keep: set[str] = set()
    for note in (cache / "bundles").glob("*.json"):
        try:
            memo = json.loads(note.read_text())
            path = Path(memo["bundle"])
            alive = path.exists() and memo["stamp"][1:] == _stamp_of(path)[1:]
            if alive:
                keep |= {memo["unpacked"]["model_file"], memo["unpacked"]["tokenizer"]}
                continue
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass
        note.unlink(missing_ok=True)
    # files younger than _PRUNE_AGE_S may be another process's extraction, its note not yet
    # written
    old = time.time() - _PRUNE_AGE_S
    for f in cache.iterdir():
        if _EXTRACTED.match(f.name) and f.name not in keep and _mtime(f) < old:
            f.unlink(missing_ok=True)
            log.info("litertlm cache: removed %s (no bundle uses it)", f)
    for tok in (cache / "tokenizers").glob("*/*"):
        if f"tokenizers/{tok.parent.name}/{tok.name}" not in keep and _mtime(tok) < old:
            shutil.rmtree(tok.parent, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def open_litertlm(path: Path, cache: Path) -> ModelMeta:
    """A `ModelMeta` for a `.litertlm` bundle, its model and tokenizer extracted into `cache`
    (once; reused while the bundle is unchanged).

    The cache holds ``<sha256 of the section>.tflite`` and ``tokenizers/<sha256>/tokenizer.json``
    (or ``tokenizer.model``), written through a temp file, fsync and rename, so a start that dies
    half-way leaves nothing that a later start trusts; the engine checks the model file's sha256
    before every load, as for a model directory. What the bundle's sections hash to is kept in
    ``bundles/<hash of the path>.json`` with the bundle's size, modification time and inode, so a
    later start of the same file reads only its header (and its model once, in the sha256 check). An
    extraction removes what bundles that no longer exist (or changed) left there, so updating a
    bundle in place does not pile up copies. The cache is ``litertlm/`` beside the profile's
    ``xnnpack_weight_cache_dir`` (`agent.model.directory.unpack_cache_dir`).
    """
    from agent.model.litertlm.metadata import read_llm_metadata, resolve

    bundle = read_bundle(path)
    if bundle.ignored:
        log.info(
            "%s: sections not used: %s",
            path,
            "; ".join(f"{s.index} {s.kind} ({why})" for s, why in bundle.ignored),
        )
    info = read_llm_metadata(bundle)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        u = _unpack(cache, bundle, info.max_tokens)
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot extract into {cache}: {exc}") from exc
    ids = resolve(info, cache / u.tokenizer, str(path))
    version = bundle.system_item("version")
    return ModelMeta(
        directory=cache,
        name=path.name.removesuffix(".litertlm"),
        version=str(version) if version is not None else "0",
        context_length=u.context_length,
        tokenizer=u.tokenizer,
        bos_id=ids.bos_id,
        eos_id=ids.eos_id,
        stop_token_ids=ids.stop_ids,
        chat_template=info.template,
        variants=(Variant(u.model_file, u.quantization, u.sha256, u.size),),
        add_bos=ids.bos_id is not None,
        generation=info.generation,
    )
