"""The patch side of ``ea-delta-1``: run one file's op stream, streaming.

The delta is read sequentially and the target written sequentially, CHUNK bytes at a time.
Memory per op: COPY, DATA and ADD hold a chunk or two (plus the zstd window of a DATA frame,
at most 8 MiB at level 19); PATCH holds its base region (the dictionary) plus the decoder's
window, about the region's size — so the peak is a small multiple of the largest tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import IO, cast

import numpy as np
import zstandard as zstd

from agent.ota.delta.format import (
    ADD,
    COPY,
    DATA,
    END,
    PATCH,
    Bounded,
    DeltaEntry,
    DeltaError,
    HashingReader,
    decode_op,
    read_exact,
)

CHUNK = 256 << 10
MAX_WINDOW = 1 << 31


class _Output:
    """The target being written: counts and hashes, refuses to grow past the declared size."""

    def __init__(self, f: IO[bytes], entry: DeltaEntry) -> None:
        self._f = f
        self._entry = entry
        self.sha = hashlib.sha256()
        self.pos = 0

    def room(self, length: int, what: str) -> None:
        if self.pos + length > self._entry.size:
            raise DeltaError(
                f"{self._entry.name}: {what} would write past the declared size "
                f"{self._entry.size} (at {self.pos} + {length}): corrupt delta"
            )

    def write(self, chunk: bytes) -> None:
        self._f.write(chunk)
        self.sha.update(chunk)
        self.pos += len(chunk)


def _frame(
    r: HashingReader, payload_len: int, length: int, dctx: zstd.ZstdDecompressor, where: str
) -> Iterator[bytes]:
    """The decompressed bytes of one op's zstd frame, CHUNK at a time, exactly `length`."""
    src = Bounded(r, payload_len, where)
    left = length
    try:
        with dctx.stream_reader(cast(IO[bytes], src), read_size=CHUNK, closefd=False) as z:
            while left:
                chunk = z.read(min(CHUNK, left))
                if not chunk:
                    raise DeltaError(f"{where}: payload ends {left} bytes early: corrupt delta")
                left -= len(chunk)
                yield chunk
            if z.read(1):
                raise DeltaError(f"{where}: payload longer than declared: corrupt delta")
    except zstd.ZstdError as exc:
        raise DeltaError(f"{where}: payload does not decompress ({exc}): corrupt delta") from exc
    if src.left:
        raise DeltaError(f"{where}: {src.left} bytes after the payload's frame: corrupt delta")


def _base_range(
    base: IO[bytes] | None, entry: DeltaEntry, off: int, length: int, op: str
) -> IO[bytes]:
    if base is None or off + length > entry.base_size:
        raise DeltaError(
            f"{entry.name}: {op} reads base bytes {off}..{off + length} but the base "
            f"{entry.base_name or '(none)'} has {entry.base_size}: corrupt delta"
        )
    base.seek(off)
    return base


def apply_ops(r: HashingReader, entry: DeltaEntry, base: IO[bytes] | None, f: IO[bytes]) -> None:
    """Write `entry`'s file to `f` from its op stream in `r`; checks size and sha256."""
    out = _Output(f, entry)
    plain = zstd.ZstdDecompressor(max_window_size=MAX_WINDOW)
    while True:
        kind, fields = decode_op(r, entry.name)
        where = f"{entry.name} at {out.pos}"
        if kind == END:
            break
        if kind == COPY:
            off, length = fields
            out.room(length, "COPY")
            src = _base_range(base, entry, off, length, "COPY")
            while length:
                chunk = read_exact(src, min(CHUNK, length), f"{entry.name}: base")
                out.write(chunk)
                length -= len(chunk)
        elif kind == DATA:
            length, plen = fields
            out.room(length, "DATA")
            for chunk in _frame(r, plen, length, plain, where):
                out.write(chunk)
        elif kind == PATCH:
            off, base_len, length, plen = fields
            out.room(length, "PATCH")
            src = _base_range(base, entry, off, base_len, "PATCH")
            raw = read_exact(src, base_len, f"{entry.name}: base")
            try:
                d = zstd.ZstdCompressionDict(raw, dict_type=zstd.DICT_TYPE_RAWCONTENT)
                dctx = zstd.ZstdDecompressor(dict_data=d, max_window_size=MAX_WINDOW)
            except zstd.ZstdError as exc:
                raise DeltaError(f"{where}: bad PATCH base region ({exc}): corrupt delta") from exc
            for chunk in _frame(r, plen, length, dctx, where):
                out.write(chunk)
            del raw, d, dctx
        elif kind == ADD:
            off, length, plen = fields
            out.room(length, "ADD")
            src = _base_range(base, entry, off, length, "ADD")
            for chunk in _frame(r, plen, length, plain, where):
                old = read_exact(src, len(chunk), f"{entry.name}: base")
                out.write((np.frombuffer(chunk, np.uint8) + np.frombuffer(old, np.uint8)).tobytes())
    if out.pos != entry.size:
        raise DeltaError(
            f"{entry.name}: rebuilt {out.pos} bytes, the delta declares {entry.size}: corrupt delta"
        )
    if out.sha.hexdigest() != entry.sha256:
        raise DeltaError(
            f"{entry.name}: rebuilt file has sha256 {out.sha.hexdigest()[:16]}…, "
            f"the delta declares {entry.sha256[:16]}…"
        )
