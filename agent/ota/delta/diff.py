"""The diff side of ``ea-delta-1``: choose and encode the ops that rebuild one target file.

Runs where updates are made (memory is not bounded by the op size here: a region is
compressed whole). Each region of the target is a COPY when equal to a region of the base
(found by tensor name, by position among the gaps, then by content hash), else the smallest of
DATA, PATCH and ADD against the base region of the same tensor. Adjacent COPYs of contiguous
base bytes and adjacent DATAs are merged into one op.
"""

from __future__ import annotations

import hashlib
import mmap
from dataclasses import dataclass
from typing import IO

import numpy as np
import zstandard as zstd

from agent.ota.delta.format import ADD, COPY, DATA, END, PATCH, encode_op
from agent.ota.delta.regions import Region

DEFAULT_LEVEL = 19
MAX_DATA_OP = 64 << 20  # merged DATA ops stay below this many target bytes
MIN_HASH_MATCH = 64  # shorter regions are not worth a COPY from elsewhere in the base
MIN_TABLES_MATCH = 4096  # shorter changed gaps are not diffed against the base's tables
GENERIC_PATCH_MAX = 256 << 20  # PATCH holds the whole base region in memory when applied

Bytes = bytes | mmap.mmap


@dataclass(slots=True)
class Counts:
    """Target bytes produced by each kind of op, and how many ops (mutable accumulator)."""

    copied: int = 0
    data: int = 0
    patched: int = 0
    ops: int = 0


def compress(data: bytes, level: int) -> bytes:
    return zstd.ZstdCompressor(level=level, write_checksum=True).compress(data)


def compress_against(data: bytes, base: bytes, level: int) -> bytes:
    """zstd of `data` with `base` as a raw-content dictionary (what ``zstd --patch-from`` does):
    the window covers the dictionary and the data, so matches reach all of the base."""
    window = max(10, (len(base) + len(data)).bit_length())
    params = zstd.ZstdCompressionParameters.from_level(
        level,
        source_size=len(data),
        dict_size=len(base),
        window_log=min(31, window),
        write_checksum=True,
    )
    d = zstd.ZstdCompressionDict(base, dict_type=zstd.DICT_TYPE_RAWCONTENT)
    return zstd.ZstdCompressor(compression_params=params, dict_data=d).compress(data)


def byte_difference(new: bytes, base: bytes) -> bytes:
    """(new - base) mod 256, byte by byte: mostly zeros when a fine-tune nudges int8 weights."""
    return (np.frombuffer(new, np.uint8) - np.frombuffer(base, np.uint8)).tobytes()


class OpWriter:
    """Encodes one file's op stream into `out` (hashing every byte for the trailer)."""

    def __init__(self, out: IO[bytes], sha: hashlib._Hash, new: Bytes, level: int) -> None:
        self._out = out
        self._sha = sha
        self._new = new
        self._level = level
        self.counts = Counts()
        self._copy: tuple[int, int] | None = None  # pending (base offset, length)
        self._data: tuple[int, int, bytes | None] | None = None  # pending (start, end, payload)

    def _write(self, b: bytes) -> None:
        self._out.write(b)
        self._sha.update(b)

    def _op(self, kind: int, *fields: int, payload: bytes = b"") -> None:
        self._write(encode_op(kind, *fields))
        if payload:
            self._write(payload)
        self.counts.ops += 1

    def flush(self) -> None:
        if self._copy is not None:
            off, length = self._copy
            self._op(COPY, off, length)
            self.counts.copied += length
            self._copy = None
        if self._data is not None:
            start, end, payload = self._data
            if payload is None:
                payload = compress(bytes(self._new[start:end]), self._level)
            self._op(DATA, end - start, len(payload), payload=payload)
            self.counts.data += end - start
            self._data = None

    def copy(self, base_off: int, length: int) -> None:
        if self._copy is not None and self._copy[0] + self._copy[1] == base_off:
            self._copy = (self._copy[0], self._copy[1] + length)
            return
        self.flush()
        self._copy = (base_off, length)

    def data(self, start: int, end: int, payload: bytes | None) -> None:
        if self._data is not None and end - self._data[0] <= MAX_DATA_OP:
            self._data = (self._data[0], end, None)  # merged: compressed again at flush
            return
        self.flush()
        self._data = (start, end, payload)

    def encode(self, start: int, content: bytes, refs: list[tuple[int, bytes]]) -> None:
        """The smallest of DATA and, per base region in `refs` ((offset, bytes)), PATCH and
        (same length) ADD, for a changed region."""
        best: tuple[int, bytes, int, int] = (DATA, compress(content, self._level), 0, 0)
        for base_off, base in refs:
            if len(base) == len(content):
                add = compress(byte_difference(content, base), self._level)
                if len(add) < len(best[1]):
                    best = (ADD, add, base_off, len(base))
            if 0 < len(base) <= GENERIC_PATCH_MAX:
                patch = compress_against(content, base, self._level)
                if len(patch) < len(best[1]):
                    best = (PATCH, patch, base_off, len(base))
        kind, payload, base_off, base_len = best
        if kind == DATA:
            self.data(start, start + len(content), payload)
            return
        self.flush()
        if kind == ADD:
            self._op(ADD, base_off, len(content), len(payload), payload=payload)
        else:
            self._op(PATCH, base_off, base_len, len(content), len(payload), payload=payload)
        self.counts.patched += len(content)

    def end(self) -> None:
        self.flush()
        self._op(END)
        self.counts.ops -= 1  # END is framing, not an op that writes


def diff_regions(
    w: OpWriter, new: Bytes, base: Bytes, new_regions: list[Region], base_regions: list[Region]
) -> None:
    """Ops for a `.tflite` parsed into regions on both sides."""
    by_key = {r.key: r for r in reversed(base_regions) if r.key}
    by_index = {r.ordinal: r for r in base_regions if r.key}
    gaps = [r for r in base_regions if not r.key]
    # the flatbuffer's tables and strings: what a changed structure region is best diffed against
    tables = max(gaps, key=lambda r: r.length, default=None)
    by_hash: dict[bytes, Region] = {}
    for r in base_regions:
        if r.length >= MIN_HASH_MATCH:
            by_hash.setdefault(hashlib.sha256(base[r.offset : r.end]).digest(), r)
    for r in new_regions:
        content = bytes(new[r.offset : r.end])
        refs: list[Region] = []
        if r.key:
            if (ref := by_key.get(r.key)) is not None:
                refs.append(ref)
            elif (ref := by_index.get(r.ordinal)) is not None and ref.length == r.length:
                refs.append(ref)  # renamed in place
        else:
            if r.ordinal < len(gaps):
                refs.append(gaps[r.ordinal])
            if tables is not None and tables not in refs and r.length >= MIN_TABLES_MATCH:
                refs.append(tables)
        if refs and refs[0].length == r.length and base[refs[0].offset : refs[0].end] == content:
            w.copy(refs[0].offset, r.length)
            continue
        if r.length >= MIN_HASH_MATCH:
            hit = by_hash.get(hashlib.sha256(content).digest())
            if hit is not None and base[hit.offset : hit.end] == content:
                w.copy(hit.offset, r.length)
                continue
        w.encode(r.offset, content, [(x.offset, bytes(base[x.offset : x.end])) for x in refs])
    w.end()


def diff_whole(w: OpWriter, new: Bytes, base: Bytes | None) -> None:
    """Ops for a file diffed whole (tokenizer, metadata, a `.tflite` that does not parse)."""
    if len(new):
        w.encode(0, bytes(new), [(0, bytes(base))] if base is not None and len(base) else [])
    w.end()
