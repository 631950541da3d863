"""A model directory: one or more `.tflite` variants, a tokenizer and ``metadata.json``, the
form every model takes here (a `.litertlm` bundle is opened into the same `ModelMeta`:
`agent.model.litertlm`). Layout and keys: `load_model_dir`; docs/MODELS.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.base.errors import ModelFormatError
from agent.base.fsutil import atomic_write_bytes

QUANTIZATIONS = (
    "fp32",
    "fp16",
    "int8",
    "int4_block32",
    "int4_block64",
    "int4_block128",
    "mixed",
    "int8_weight_only",  # int8 on disk, float in memory: what the legacy backend runs
)
METADATA_FILE = "metadata.json"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Variant:
    """One `.tflite` file of a model directory."""

    file: str
    quantization: str
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class ModelMeta:
    """What `metadata.json` says about a model directory."""

    directory: Path
    name: str
    version: str
    context_length: int
    tokenizer: str
    bos_id: int | None
    eos_id: int | None
    stop_token_ids: tuple[int, ...]
    chat_template: str  # "" when the model has none
    variants: tuple[Variant, ...]
    add_bos: bool = True  # prepend bos_id to a plain prompt (never to a rendered chat)
    generation: tuple[tuple[str, float], ...] = ()  # sampler defaults the model ships

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / self.tokenizer

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends a generation: eos and the listed stop tokens."""
        eos = () if self.eos_id is None else (self.eos_id,)
        return frozenset((*eos, *self.stop_token_ids))

    def variant(self, quantization: str) -> Variant:
        for v in self.variants:
            if v.quantization == quantization:
                return v
        have = ", ".join(v.quantization for v in self.variants)
        raise ModelFormatError(
            f"{self.directory}: no {quantization!r} variant; the directory has: {have}"
        )

    def path_of(self, variant: Variant) -> Path:
        return self.directory / variant.file


def sha256_file(
    path: Path, chunk: int = 1 << 20, progress: Callable[[int, int], None] | None = None
) -> str:
    """Hex sha256 of a file, read in chunks; `progress(done, total)` after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        done = 0
        while block := f.read(chunk):
            h.update(block)
            done += len(block)
            if progress is not None:
                progress(done, total)
    return h.hexdigest()


def _field(raw: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    if key not in raw:
        raise ModelFormatError(f"{where}: missing key {key!r}")
    value = raw[key]
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ModelFormatError(f"{where}: {key} = {value!r} should be of type {kind.__name__}")
    return value


def _optional_id(raw: dict[str, Any], key: str, where: Path) -> int | None:
    if raw.get(key) is None:
        if key not in raw:
            raise ModelFormatError(f"{where}: missing key {key!r}")
        return None
    return int(_field(raw, key, int, where))


def _generation(raw: dict[str, Any], where: Path) -> tuple[tuple[str, float], ...]:
    gen = raw.get("generation", {})
    allowed = ("temperature", "top_k", "top_p")
    if not isinstance(gen, dict) or not all(
        k in allowed and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in gen.items()
    ):
        raise ModelFormatError(
            f"{where}: generation = {gen!r} should map {', '.join(allowed)} to numbers"
        )
    return tuple(sorted((k, float(v)) for k, v in gen.items()))


def load_model_dir(directory: Path) -> ModelMeta:
    """Read and check `metadata.json` of a model directory (does not hash the files).

    Layout::

        <dir>/metadata.json
        <dir>/tokenizer.model | tokenizer.json   (SentencePiece, or Hugging Face tokenizers)
        <dir>/<variant files>.tflite

    ``metadata.json`` (written by the toolchain, read here)::

        {
          "format": 1,
          "name": "edge-demo-pystdlib", "version": "1.0.0",
          "context_length": 1024,
          "tokenizer": "tokenizer.model",
          "bos_id": 1, "eos_id": 2, "stop_token_ids": [2],
          "chat_template": "{system}\\n{user}\\n",
          "add_bos": true,
          "variants": [
            {"file": "model_int8.tflite", "quantization": "int8",
             "sha256": "...", "size": 5800000}
          ]
        }

    Quantization names: ``fp32``, ``fp16``, ``int8``, ``int4_block32``, ``int4_block64``,
    ``int4_block128``, ``mixed``, ``int8_weight_only``.

    Optional keys (absent in older directories): ``add_bos`` (prepend ``bos_id`` to a plain prompt;
    default true when ``bos_id`` is set), ``bos_id`` / ``eos_id`` may be ``null`` (Qwen has no BOS),
    ``chat_template`` is either the old ``{system}``/``{user}`` form or a Jinja template (a template
    with ``{%`` or ``{{``), ``""`` when the model has none (chat is then refused), and
    ``generation`` holds sampler defaults the model ships (``temperature``, ``top_k``, ``top_p``).
    """
    if directory.is_file():
        raise ModelFormatError(
            f"{directory}: a file, not a model directory (a .litertlm runs with --model; "
            "edge-agent model import makes a model directory of it)"
        )
    where = directory / METADATA_FILE
    try:
        raw = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelFormatError(f"{directory}: not a model directory (no {METADATA_FILE})") from exc
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{where}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{where}: expected a JSON object")
    fmt = _field(raw, "format", int, where)
    if fmt != FORMAT_VERSION:
        raise ModelFormatError(
            f"{where}: format {fmt} is not supported (expected {FORMAT_VERSION})"
        )
    variants = []
    for i, v in enumerate(_field(raw, "variants", list, where)):
        if not isinstance(v, dict):
            raise ModelFormatError(f"{where}: variants[{i}] should be an object")
        quant = _field(v, "quantization", str, where)
        if quant not in QUANTIZATIONS:
            raise ModelFormatError(
                f"{where}: variants[{i}].quantization = {quant!r}; "
                f"allowed: {', '.join(QUANTIZATIONS)}"
            )
        variants.append(
            Variant(
                file=_field(v, "file", str, where),
                quantization=quant,
                sha256=_field(v, "sha256", str, where),
                size=_field(v, "size", int, where),
            )
        )
    if not variants:
        raise ModelFormatError(f"{where}: no variants listed")
    stops = _field(raw, "stop_token_ids", list, where)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise ModelFormatError(f"{where}: stop_token_ids = {stops!r} should be a list of ids")
    bos_id = _optional_id(raw, "bos_id", where)
    add_bos = raw.get("add_bos", bos_id is not None)
    if not isinstance(add_bos, bool):
        raise ModelFormatError(f"{where}: add_bos = {add_bos!r} should be true or false")
    if add_bos and bos_id is None:
        raise ModelFormatError(f"{where}: add_bos is true but bos_id is null")
    template = raw.get("chat_template", "")
    if not isinstance(template, str):
        raise ModelFormatError(f"{where}: chat_template should be a string")
    return ModelMeta(
        directory=directory,
        name=_field(raw, "name", str, where),
        version=_field(raw, "version", str, where),
        context_length=_field(raw, "context_length", int, where),
        tokenizer=_field(raw, "tokenizer", str, where),
        bos_id=bos_id,
        eos_id=_optional_id(raw, "eos_id", where),
        stop_token_ids=tuple(stops),
        chat_template=template,
        variants=tuple(variants),
        add_bos=add_bos,
        generation=_generation(raw, where),
    )


def write_model_dir_metadata(
    directory: Path,
    *,
    name: str,
    version: str,
    context_length: int,
    bos_id: int | None,
    eos_id: int | None,
    stop_token_ids: Iterable[int],
    chat_template: str,
    variants: Iterable[tuple[str, str]],
    tokenizer: str = "tokenizer.model",
    add_bos: bool | None = None,
    generation: dict[str, float] | None = None,
    sha256: Mapping[str, str] | None = None,
) -> Path:
    """Write `metadata.json` for files already in `directory`.

    `variants` are ``(file name, quantization)`` pairs; sizes and sha256 are computed here
    (a file named in `sha256` is not read again: its caller has just hashed it).
    The file is written atomically (`agent.base.fsutil.atomic_write`: temp file, fsync, rename).
    """
    entries = []
    for file, quant in variants:
        if quant not in QUANTIZATIONS:
            raise ModelFormatError(f"unknown quantization {quant!r}; allowed: {QUANTIZATIONS}")
        path = directory / file
        entries.append(
            {
                "file": file,
                "quantization": quant,
                "sha256": (sha256 or {}).get(file) or sha256_file(path),
                "size": path.stat().st_size,
            }
        )
    doc = {
        "format": FORMAT_VERSION,
        "name": name,
        "version": version,
        "context_length": context_length,
        "tokenizer": tokenizer,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "stop_token_ids": list(stop_token_ids),
        "chat_template": chat_template,
        "add_bos": bos_id is not None if add_bos is None else add_bos,
        "variants": entries,
    }
    if generation:
        doc["generation"] = dict(generation)
    target = directory / METADATA_FILE
    # world-readable as open() made it: the daemon's user reads a directory an operator wrote
    atomic_write_bytes(target, (json.dumps(doc, indent=2) + "\n").encode("utf-8"), mode=0o644)
    return target


def model_digest(files: Mapping[str, str]) -> str:
    """One sha256 for what defines a model: ``metadata.json``, its tokenizer and every variant,
    given as file name -> sha256 (hex of ``"<name> <sha256>\n"`` lines in name order). A device
    reports it for the directory it serves and a rollout computes it from a manifest's file
    list, so "already on target" means every defining file, not only the weights."""
    lines = "".join(f"{name} {sha}\n" for name, sha in sorted(files.items()))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def defining_files(meta: ModelMeta) -> dict[str, str]:
    """`model_digest`'s input for a model directory: the variants' sha256 as its metadata
    records them (the served one is checked at load), the tokenizer's and metadata.json's
    hashed here (small files)."""
    files = {v.file: v.sha256 for v in meta.variants}
    for name in (meta.tokenizer, METADATA_FILE):
        if (meta.directory / name).is_file():  # a .litertlm's extraction has no metadata.json
            files[name] = sha256_file(meta.directory / name)
    return files


def demo_model_dir() -> Path:
    """The demo model shipped inside the package (`agent.base.shipped.demo_model`)."""
    from agent.base.shipped import demo_model

    return demo_model()
