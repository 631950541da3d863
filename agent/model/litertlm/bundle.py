"""`.litertlm` bundles (LiteRT-LM's format): read the header and pick the sections a text LLM
needs, which `agent.model.litertlm.cache` extracts once into a cache rather than running them
in place: ai-edge-litert's in-memory entry points take only ``bytes`` (a copy of the whole
model in anonymous memory), and the loader's checks and caches are keyed on a file path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from agent.base.errors import ModelFormatError
from agent.base.fsutil import atomic_write
from agent.model.tflite.info import ModelFile

log = logging.getLogger(__name__)

MAGIC: Final = b"LITERTLM"
_HEADER_BEGIN: Final = 32
_HEADER_END_AT: Final = 24
_MAJOR: Final = 1  # the header format this reader knows (litert-lm-builder 0.18 writes 1.7.0)
_CHUNK: Final = 1 << 20
PREFILL_DECODE: Final = "prefill_decode"

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True, slots=True)
class Section:
    """One section of a bundle: its data type, byte range and header items."""

    index: int
    kind: str  # AnySectionDataType name: TFLiteModel, SP_Tokenizer, LlmMetadataProto, ...
    begin: int
    end: int
    items: tuple[tuple[str, Any], ...]

    @property
    def size(self) -> int:
        return self.end - self.begin

    def item(self, key: str) -> Any:
        return next((v for k, v in self.items if k == key), None)

    @property
    def model_type(self) -> str | None:
        """``model_type`` without litert-lm-builder's ``tf_lite_`` prefix (``prefill_decode``)."""
        value = self.item("model_type")
        return str(value).lower().removeprefix("tf_lite_") if value is not None else None

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends its ``backend_constraint`` allows (empty: any)."""
        value = self.item("backend_constraint")
        if not isinstance(value, str):
            return ()
        return tuple(b.strip().lower() for b in value.split(",") if b.strip())


@dataclass(frozen=True, slots=True)
class Bundle:
    """A bundle's header and the sections a text LLM runs from."""

    path: Path
    size: int
    version: tuple[int, int, int]
    system: tuple[tuple[str, Any], ...]
    sections: tuple[Section, ...]
    model: Section
    tokenizer: Section
    metadata: Section
    ignored: tuple[tuple[Section, str], ...]  # (section, why it is not used)

    def system_item(self, key: str) -> Any:
        return next((v for k, v in self.system if k == key), None)


def is_litertlm(path: Path) -> bool:
    """Whether `path` is a file that starts with the `.litertlm` magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _schema() -> Any:
    from litert_lm_builder import litertlm_header_schema_py_generated as schema

    return schema


def _value(schema: Any, kvp: Any) -> Any:
    """A KeyValuePair's value (the VData union) as a Python value."""
    table = kvp.Value()
    if table is None:
        return None
    names = {v: k for k, v in vars(schema.VData).items() if isinstance(v, int)}
    name = names.get(kvp.ValueType())
    cls = getattr(schema, name, None) if name and name != "NONE" else None
    if cls is None:
        return None
    obj = cls()
    obj.Init(table.Bytes, table.Pos)
    raw = obj.Value()
    if name == "StringValue":
        return raw.decode("utf-8", "replace") if raw is not None else None
    return bool(raw) if name == "Bool" else raw


def _items(schema: Any, get: Callable[[int], Any], count: int) -> tuple[tuple[str, Any], ...]:
    out = []
    for j in range(count):
        kvp = get(j)
        key = kvp.Key()
        out.append((key.decode("utf-8", "replace") if key else "", _value(schema, kvp)))
    return tuple(out)


Header = tuple[int, tuple[int, int, int], tuple[tuple[str, Any], ...], tuple[Section, ...]]


def read_header(path: Path) -> Header:
    """(file size, format version, system metadata, sections) of a bundle, checked: the
    magic, a version this reader knows, and every section inside the file after the header.

    A bundle is a 32-byte preamble (``LITERTLM``, version, header end offset), a FlatBuffers header
    (`litert_lm_builder`'s ``litertlm_header_schema``: system metadata and one entry per section
    with its data type, byte range and key/value items such as ``model_type``) and the sections,
    each starting on a 16 KiB boundary. Used here: the ``TFLiteModel`` section whose ``model_type``
    is ``prefill_decode`` (and that does not require an NPU), the tokenizer (``SP_Tokenizer``: a
    SentencePiece model; ``HF_Tokenizer_Zlib``: an 8-byte little-endian size and a zlib-compressed
    ``tokenizer.json``) and ``LlmMetadataProto`` (litert-lm-builder's ``LlmMetadata`` protobuf:
    start and stop tokens, a Jinja template or per-role prefix/suffix templates, sampler parameters,
    max tokens). Every other section (vision and audio models, the MTP drafter, NPU-only models,
    embedders) is listed by ``model inspect`` and ignored, with one log line when the bundle is
    opened.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            pre = f.read(_HEADER_BEGIN)
            if len(pre) < _HEADER_BEGIN or pre[:8] != MAGIC:
                raise ModelFormatError(f"{path}: not a .litertlm file (no LITERTLM magic)")
            major, minor, patch = struct.unpack_from("<III", pre, 8)
            (header_end,) = struct.unpack_from("<Q", pre, _HEADER_END_AT)
            if major != _MAJOR:
                raise ModelFormatError(
                    f"{path}: .litertlm format {major}.{minor}.{patch} is not supported "
                    f"(this reader knows {_MAJOR}.x)"
                )
            if not _HEADER_BEGIN < header_end <= size:
                raise ModelFormatError(
                    f"{path}: truncated or corrupt .litertlm: the header ends at byte "
                    f"{header_end} but the file has {size} bytes"
                )
            header = f.read(header_end - _HEADER_BEGIN)
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read: {exc}") from exc
    schema = _schema()
    try:
        root = schema.LiteRTLMMetaData.GetRootAs(header, 0)
        sm = root.SystemMetadata()
        system = _items(schema, sm.Entries, sm.EntriesLength()) if sm is not None else ()
        secs = root.SectionMetadata()
        kinds = {v: k for k, v in vars(schema.AnySectionDataType).items() if isinstance(v, int)}
        sections = []
        for i in range(secs.ObjectsLength() if secs is not None else 0):
            obj = secs.Objects(i)
            sections.append(
                Section(
                    index=i,
                    kind=kinds.get(obj.DataType(), f"type{obj.DataType()}"),
                    begin=obj.BeginOffset(),
                    end=obj.EndOffset(),
                    items=_items(schema, obj.Items, obj.ItemsLength()),
                )
            )
    except Exception as exc:  # a garbled flatbuffer fails anywhere in the generated code
        raise ModelFormatError(f"{path}: corrupt .litertlm header: {exc}") from exc
    for s in sections:
        if not header_end <= s.begin <= s.end:
            raise ModelFormatError(
                f"{path}: corrupt .litertlm header: section {s.index} ({s.kind}) spans bytes "
                f"{s.begin}..{s.end}, overlapping the header (ends at {header_end})"
            )
        if s.end > size:
            raise ModelFormatError(
                f"{path}: truncated .litertlm: section {s.index} ({s.kind}) ends at byte "
                f"{s.end} but the file has {size} bytes"
            )
    return size, (major, minor, patch), system, tuple(sections)


def _ignored_reason(s: Section) -> str | None:
    """Why a section is not used (None: it is a candidate for one of the used roles)."""
    if s.kind == "TFLiteModel":
        if s.model_type != PREFILL_DECODE:
            return f"model_type {s.model_type or 'none'} (only prefill_decode runs)"
        if s.backends and "cpu" not in s.backends:
            return f"a model for the {', '.join(s.backends)} backend only"
        return None
    if s.kind in ("SP_Tokenizer", "HF_Tokenizer_Zlib"):
        if s.model_type not in (None, PREFILL_DECODE):
            return f"the tokenizer of the {s.model_type} model"
        return None
    if s.kind == "LlmMetadataProto":
        return None
    if s.kind == "TFLiteWeights" and s.model_type != PREFILL_DECODE:
        return f"external weights of the {s.model_type or 'untyped'} model"
    return "not used for text generation"


def _one(path: Path, found: list[Section], what: str) -> Section:
    if not found:
        raise ModelFormatError(f"{path}: the bundle has no {what} section")
    if len(found) > 1:
        listed = ", ".join(str(s.index) for s in found)
        raise ModelFormatError(f"{path}: the bundle has several {what} sections ({listed})")
    return found[0]


def read_bundle(path: Path) -> Bundle:
    """The bundle at `path`, with the sections a text LLM runs from chosen (or a clear error)."""
    size, version, system, sections = read_header(path)
    ignored = [(s, why) for s in sections if (why := _ignored_reason(s)) is not None]
    used = [s for s in sections if _ignored_reason(s) is None]
    for s in sections:
        if s.kind == "TFLiteWeights" and s.model_type == PREFILL_DECODE:
            raise ModelFormatError(
                f"{path}: the prefill_decode model keeps its weights in a separate section "
                f"({s.index}); edge-agent runs only self-contained .tflite models"
            )
    model = _one(path, [s for s in used if s.kind == "TFLiteModel"], "prefill_decode TFLiteModel")
    tokenizer = _one(
        path, [s for s in used if s.kind in ("SP_Tokenizer", "HF_Tokenizer_Zlib")], "tokenizer"
    )
    metadata = _one(path, [s for s in used if s.kind == "LlmMetadataProto"], "LlmMetadataProto")
    with open(path, "rb") as f:
        f.seek(model.begin)
        head = f.read(8)
    if len(head) < 8 or head[4:8] != b"TFL3":
        raise ModelFormatError(
            f"{path}: section {model.index} (TFLiteModel) is not a TFLite flatbuffer"
        )
    return Bundle(path, size, version, system, sections, model, tokenizer, metadata, tuple(ignored))


def read_section(path: Path, section: Section) -> bytes:
    """A (small) section's bytes."""
    with open(path, "rb") as f:
        f.seek(section.begin)
        data = f.read(section.size)
    if len(data) != section.size:
        raise ModelFormatError(f"{path}: truncated .litertlm: section {section.index} is short")
    return data


def section_sha256(path: Path, section: Section, progress: Progress | None = None) -> str:
    """The sha256 of a section's bytes, read in chunks."""
    return _stream(path, section, None, progress)


def _stream(path: Path, section: Section, out: Any, progress: Progress | None) -> str:
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        f.seek(section.begin)
        while done < section.size:
            block = f.read(min(_CHUNK, section.size - done))
            if not block:
                raise ModelFormatError(
                    f"{path}: truncated .litertlm: section {section.index} is short"
                )
            h.update(block)
            if out is not None:
                out.write(block)
            done += len(block)
            if progress is not None:
                progress(done, section.size)
    return h.hexdigest()


def extract_model(bundle: Bundle, target: Path, progress: Progress | None = None) -> str:
    """Write the model section to `target` atomically; returns its sha256."""
    box: list[str] = []
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, lambda f: box.append(_stream(bundle.path, bundle.model, f, progress)))
    return box[0]


def tokenizer_file(bundle: Bundle) -> tuple[str, bytes]:
    """(file name, contents) of the bundle's tokenizer: ``tokenizer.model`` or the
    decompressed ``tokenizer.json``."""
    data = read_section(bundle.path, bundle.tokenizer)
    if bundle.tokenizer.kind == "SP_Tokenizer":
        return "tokenizer.model", data
    where = f"{bundle.path}: section {bundle.tokenizer.index} (HF_Tokenizer_Zlib)"
    if len(data) < 8:
        raise ModelFormatError(f"{where}: shorter than its 8-byte size field")
    (want,) = struct.unpack_from("<Q", data, 0)
    try:
        text = zlib.decompress(data[8:])
    except zlib.error as exc:
        raise ModelFormatError(f"{where}: not zlib data: {exc}") from exc
    if len(text) != want:
        raise ModelFormatError(f"{where}: decompressed to {len(text)} bytes, expected {want}")
    return "tokenizer.json", text


def read_model_section(bundle: Bundle) -> ModelFile:
    """The model section's structure, read in place (through a memoryview of the mapped file:
    no copy of the weights)."""
    import dataclasses
    import mmap

    from agent.model.tflite.parse import parse

    with open(bundle.path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(data)[bundle.model.begin : bundle.model.end]
    try:
        # flatbuffers reads any buffer; the section is a whole .tflite at its own offset 0
        model = parse(bundle.path, view)  # type: ignore[arg-type]
    except ModelFormatError:
        raise
    except Exception as exc:
        raise ModelFormatError(
            f"{bundle.path}: section {bundle.model.index}: corrupt TFLite flatbuffer: {exc}"
        ) from exc
    finally:
        view.release()
        data.close()
    return dataclasses.replace(model, size=bundle.model.size)
