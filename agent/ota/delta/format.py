"""The ``ea-delta-1`` container: header, op encoding and trailer (no diffing, no patching). The
layout: `encode_header`; the ops: `encode_op`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from typing import Any, Protocol

from agent.base.errors import AgentError

FORMAT = "ea-delta-1"
MAGIC = FORMAT.encode("ascii") + b"\n"
END_MAGIC = b"ea-delta-end"
MAX_HEADER = 16 << 20

END, COPY, DATA, PATCH, ADD = 0, 1, 2, 3, 4
OP_NAMES = {END: "END", COPY: "COPY", DATA: "DATA", PATCH: "PATCH", ADD: "ADD"}
# the u64 fields after the kind byte; the last one of DATA/PATCH/ADD is the payload length
OP_FIELDS = {END: 0, COPY: 2, DATA: 2, PATCH: 4, ADD: 3}

_HEX64 = re.compile(r"[0-9a-f]{64}")


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class DeltaError(AgentError):
    """A delta cannot be made or applied: corrupt or truncated delta, wrong base, bad output."""


@dataclass(frozen=True, slots=True)
class DeltaEntry:
    """One target file of a delta, as its header describes it."""

    name: str
    sha256: str  # of the rebuilt file
    size: int
    base_sha256: str  # of the base file it is rebuilt from; "" when carried whole
    base_name: str = ""
    base_size: int = 0
    method: str = "generic"  # "tflite" (per tensor buffer), "generic" (whole file) or "same"


def encode_header(entries: list[DeltaEntry]) -> bytes:
    """MAGIC, length, JSON header and its sha256.

    Layout (integers little-endian)::

        MAGIC                      b"ea-delta-1\\n"
        u32 header length N
        N bytes header             UTF-8 JSON {"format": "ea-delta-1", "files": [entry, ...]}
        32 bytes                   sha256(MAGIC + u32 + header)
        per file, in header order: an op stream, ended by an END op
        END_MAGIC                  b"ea-delta-end"
        32 bytes                   sha256 of every byte before these 32

    An entry is ``{"name", "size", "sha256", "base", "base_size", "base_sha256", "method"}``;
    ``base`` is "" when the file is carried whole (then "base_size" is 0 and "base_sha256" "").
    """
    doc = {
        "format": FORMAT,
        "files": [
            {
                "name": e.name,
                "size": e.size,
                "sha256": e.sha256,
                "base": e.base_name,
                "base_size": e.base_size,
                "base_sha256": e.base_sha256,
                "method": e.method,
            }
            for e in entries
        ],
    }
    body = json.dumps(doc, sort_keys=True).encode("utf-8")
    head = MAGIC + struct.pack("<I", len(body)) + body
    return head + hashlib.sha256(head).digest()


def read_exact(f: Reader, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise DeltaError(f"delta truncated: {what} needs {n} bytes, {len(data)} left")
    return data


def decode_header(f: Reader) -> list[DeltaEntry]:
    """Read and check the header from the start of `f` (left positioned at the first op)."""
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        raise DeltaError(f"not an {FORMAT} delta (starts with {magic[:16]!r})")
    (n,) = struct.unpack("<I", read_exact(f, 4, "header length"))
    if n > MAX_HEADER:
        raise DeltaError(f"header length {n} exceeds {MAX_HEADER} bytes: corrupt delta")
    body = read_exact(f, n, "header")
    digest = read_exact(f, 32, "header checksum")
    if hashlib.sha256(MAGIC + struct.pack("<I", n) + body).digest() != digest:
        raise DeltaError("header checksum mismatch: corrupt delta")
    try:
        doc = json.loads(body)
        if doc["format"] != FORMAT:
            raise DeltaError(f"header format {doc['format']!r}, expected {FORMAT!r}")
        entries = [_entry(e) for e in doc["files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DeltaError(f"malformed header: {exc!r}") from exc
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise DeltaError(f"header names a file twice: {names}")
    return entries


def _entry(raw: dict[str, Any]) -> DeltaEntry:
    e = DeltaEntry(
        name=raw["name"],
        sha256=raw["sha256"],
        size=raw["size"],
        base_sha256=raw["base_sha256"],
        base_name=raw["base"],
        base_size=raw["base_size"],
        method=raw["method"],
    )
    for name in (e.name, e.base_name):
        if not isinstance(name, str) or "/" in name or "\\" in name or name in (".", ".."):
            raise DeltaError(f"header: {name!r} is not a plain file name")
    if not e.name or not _HEX64.fullmatch(e.sha256):
        raise DeltaError(f"header: entry {e.name!r} has no valid name and sha256")
    if bool(e.base_name) != bool(e.base_sha256) or (
        e.base_sha256 and not _HEX64.fullmatch(e.base_sha256)
    ):
        raise DeltaError(f"header: entry {e.name!r} has an inconsistent base")
    for n in (e.size, e.base_size):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DeltaError(f"header: entry {e.name!r} has a bad size {n!r}")
    return e


def encode_op(kind: int, *fields: int) -> bytes:
    """The op's kind byte and u64 fields (a payload, if any, follows).

    Ops (one kind byte, then u64 fields; ``payload`` is one zstd frame of ``payload_len`` bytes)::

        END   0x00
        COPY  0x01 base_off, length                      the base file's bytes
        DATA  0x02 length, payload_len, payload          zstd of the bytes
        PATCH 0x03 base_off, base_len, length, payload_len, payload
                   zstd of the bytes with base[base_off:+base_len] as raw-content dictionary
        ADD   0x04 base_off, length, payload_len, payload
                   zstd of (new - base[base_off:+length]) mod 256, byte by byte
    """
    return struct.pack(f"<B{len(fields)}Q", kind, *fields)


def decode_op(f: Reader, where: str) -> tuple[int, tuple[int, ...]]:
    """The next op's kind and fields (a payload, if any, is left to read)."""
    kind = read_exact(f, 1, f"{where}: op")[0]
    if kind not in OP_FIELDS:
        raise DeltaError(f"{where}: unknown op kind {kind}: corrupt delta")
    n = OP_FIELDS[kind]
    fields = struct.unpack(f"<{n}Q", read_exact(f, 8 * n, f"{where}: {OP_NAMES[kind]} op"))
    return kind, fields


class HashingReader:
    """Reads a file sequentially and hashes every byte read (for the trailer check)."""

    def __init__(self, f: Reader) -> None:
        self._f = f
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha.update(data)
        return data


class Bounded:
    """At most `n` bytes of a reader: what a zstd stream reader may consume for one op."""

    def __init__(self, f: HashingReader, n: int, where: str) -> None:
        self._f = f
        self.left = n
        self._where = where

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = read_exact(self._f, size, self._where) if size else b""
        self.left -= len(data)
        return data


def check_trailer(r: HashingReader, f: Reader) -> None:
    """The END_MAGIC, the whole-delta sha256, then end of file."""
    if read_exact(r, len(END_MAGIC), "trailer") != END_MAGIC:
        raise DeltaError("trailer missing: corrupt delta")
    expect = r.sha.digest()
    if read_exact(f, 32, "trailer checksum") != expect:
        raise DeltaError("delta checksum mismatch: corrupt delta")
    if f.read(1):
        raise DeltaError("bytes after the trailer: corrupt delta")
