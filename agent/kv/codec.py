"""The on-disk format of one saved session (`KVSnapshot` + small JSON metadata): a preamble, a
JSON header, the arrays and a sha256 trailer (`encode`). Everything here raises
``ValueError`` with a short reason for a bad file; the caller turns that into `SessionLost`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from agent.kv.snapshot import KVSnapshot

MAGIC = b"EAKV"
VERSION = 1
PREAMBLE = struct.Struct("<4sHHI")
DIGEST_BYTES = 32
DTYPE_KINDS = "biufc"  # bool, signed, unsigned, float, complex: plain bytes, nothing else

Reader = io.RawIOBase | io.BufferedIOBase  # a file opened "rb" (any buffering) or a BytesIO


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """Where one array sits in the data section."""

    name: str
    dtype: str  # numpy dtype string with byte order, e.g. "<f2", "|i1"
    shape: tuple[int, ...]
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True, slots=True)
class Header:
    """A file's parsed preamble and header."""

    model_sha256: str
    tokens: tuple[int, ...]
    meta: dict[str, Any]
    arrays: tuple[ArraySpec, ...]
    raw: bytes  # preamble + JSON, as read (the checksum covers it)

    @property
    def file_bytes(self) -> int:
        """The size a complete file with this header has."""
        return len(self.raw) + sum(s.nbytes for s in self.arrays) + DIGEST_BYTES


@dataclass(frozen=True, slots=True)
class Encoded:
    """A snapshot ready to write: the header bytes plus the arrays, not yet copied."""

    head: bytes
    arrays: tuple[NDArray[Any], ...]

    @property
    def nbytes(self) -> int:
        """The size of the file `write_to` writes."""
        return len(self.head) + sum(int(a.nbytes) for a in self.arrays) + DIGEST_BYTES

    def write_to(self, f: IO[bytes]) -> None:
        """Write the whole file (header, array bytes, checksum) to `f`."""
        digest = hashlib.sha256(self.head)
        f.write(self.head)
        for a in self.arrays:
            raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
            digest.update(raw)
            f.write(raw)
        f.write(digest.digest())


def encode(snapshot: KVSnapshot, meta: Mapping[str, object]) -> Encoded:
    """Lay out `snapshot` and `meta`; ``ValueError`` if an array or `meta` cannot be stored.

    Layout, all integers little-endian::

        preamble   12 bytes   magic b"EAKV", u16 format version, u16 flags (0), u32 header length
        header     JSON       {"model_sha256", "tokens", "meta",
                               "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}
        data       raw bytes  each array C-ordered at header-relative "offset" (back to back)
        trailer    32 bytes   sha256 of every byte before it

    `read_header` reads only the preamble and header (cheap: used to list and to scan); the checksum
    is verified by `read_snapshot`, which reads the arrays straight into fresh numpy arrays.
    """
    specs: list[dict[str, object]] = []
    offset = 0
    for name, a in snapshot.arrays.items():
        if a.dtype.kind not in DTYPE_KINDS:
            raise ValueError(f"array {name!r} has dtype {a.dtype}; only plain numeric dtypes")
        size = int(a.nbytes)
        specs.append(
            {
                "name": name,
                "dtype": a.dtype.str,
                "shape": list(a.shape),
                "offset": offset,
                "nbytes": size,
            }
        )
        offset += size
    header = {
        "model_sha256": snapshot.model_sha256,
        "tokens": list(snapshot.tokens),
        "meta": dict(meta),
        "arrays": specs,
    }
    try:
        text = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata is not plain JSON: {exc}") from exc
    head = PREAMBLE.pack(MAGIC, VERSION, 0, len(text)) + text
    return Encoded(head, tuple(snapshot.arrays.values()))


def read_header(f: Reader, file_size: int) -> Header:
    """Read and check the preamble and header of a file of `file_size` bytes at position 0."""
    pre = f.read(PREAMBLE.size)
    if len(pre) < PREAMBLE.size:
        raise ValueError(f"truncated at {file_size} bytes")
    magic, version, flags, length = PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise ValueError("not a saved session (bad magic)")
    if version != VERSION or flags != 0:
        raise ValueError(f"unknown format version {version}.{flags}")
    if PREAMBLE.size + length + DIGEST_BYTES > file_size:
        raise ValueError(f"truncated at {file_size} bytes")
    text = f.read(length)
    try:
        header = _parse(json.loads(text), pre + text)
    except KeyError as exc:
        raise ValueError(f"malformed header (no {exc})") from exc
    except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise ValueError(f"malformed header ({exc})") from exc
    if header.file_bytes != file_size:
        raise ValueError(f"{file_size} bytes where the header says {header.file_bytes}")
    return header


def read_snapshot(f: Reader, header: Header) -> KVSnapshot:
    """Read the arrays after `header` (the file positioned just after it); verify the checksum."""
    digest = hashlib.sha256(header.raw)
    arrays: dict[str, NDArray[Any]] = {}
    for spec in header.arrays:
        a = np.empty(spec.shape, dtype=np.dtype(spec.dtype))
        raw = a.reshape(-1).view(np.uint8).data  # a writable view of a's bytes
        _read_exact(f, raw)
        digest.update(raw)
        arrays[spec.name] = a
    if f.read(DIGEST_BYTES) != digest.digest():
        raise ValueError("checksum mismatch")
    return KVSnapshot(header.model_sha256, header.tokens, arrays)


def _read_exact(f: Reader, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise ValueError("truncated")
        done += n


def _parse(doc: Any, raw: bytes) -> Header:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    model, tokens, meta = doc["model_sha256"], doc["tokens"], doc["meta"]
    if not isinstance(model, str) or not isinstance(meta, dict) or not isinstance(tokens, list):
        raise ValueError("wrong field types")
    if not all(type(t) is int for t in tokens):
        raise ValueError("tokens are not integers")
    specs: list[ArraySpec] = []
    offset = 0
    for i, d in enumerate(doc["arrays"]):
        spec = ArraySpec(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"])
        if not isinstance(spec.name, str) or not isinstance(spec.dtype, str):
            raise ValueError(f"array #{i}: wrong field types")
        dtype = np.dtype(spec.dtype)
        if (
            dtype.kind not in DTYPE_KINDS
            or not all(type(n) is int and n >= 0 for n in spec.shape)
            or spec.offset != offset
            or spec.nbytes != math.prod(spec.shape) * dtype.itemsize
        ):
            raise ValueError(f"array #{i} ({spec.name!r}): inconsistent dtype, shape or offset")
        specs.append(spec)
        offset += spec.nbytes
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("duplicate array names")
    return Header(model, tuple(tokens), meta, tuple(specs), raw)
