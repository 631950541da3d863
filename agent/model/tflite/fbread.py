"""Reading a flatbuffer's tables from its bytes: where a field is, a vector's table places,
an int32 vector, a scalar. The generated accessors (LiteRT's schema module) cost microseconds
per field through several calls each; these read the same bytes with one `struct` call or one
numpy view, for the loops over a model's tens of thousands of tensors and operators
(`agent.model.tflite.parse`, `agent.runtime.prepare.overlay`)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

U32 = struct.Struct("<I")
I32 = struct.Struct("<i")
U16 = struct.Struct("<H")
U64 = struct.Struct("<Q")
U8 = struct.Struct("<B")
I8 = struct.Struct("<b")


def field(buf: Any, table: int, slot: int) -> int:
    """Where field `slot` of the table at `table` is, or 0 when absent."""
    vtable = table - I32.unpack_from(buf, table)[0]
    at = 4 + 2 * slot
    if at >= U16.unpack_from(buf, vtable)[0]:
        return 0
    off: int = U16.unpack_from(buf, vtable + at)[0]
    return table + off if off else 0


def tables(buf: Any, table: int, slot: int) -> list[int]:
    """The places of the tables in vector field `slot` of the table at `table`."""
    at = field(buf, table, slot)
    if not at:
        return []
    vec = at + U32.unpack_from(buf, at)[0]
    n = U32.unpack_from(buf, vec)[0]
    base = vec + 4 + 4 * np.arange(n, dtype=np.int64)
    found: list[int] = (base + np.frombuffer(buf, dtype="<u4", count=n, offset=vec + 4)).tolist()
    return found


def ints(buf: Any, table: int, slot: int) -> list[int]:
    """The int32 vector field `slot` of the table at `table`."""
    at = field(buf, table, slot)
    if not at:
        return []
    vec = at + U32.unpack_from(buf, at)[0]
    n = U32.unpack_from(buf, vec)[0]
    found: list[int] = np.frombuffer(buf, dtype="<i4", count=n, offset=vec + 4).tolist()
    return found


def scalar(buf: Any, table: int, slot: int, fmt: struct.Struct, default: int = 0) -> int:
    """Scalar field `slot` of the table at `table` (`default` when absent)."""
    at = field(buf, table, slot)
    return int(fmt.unpack_from(buf, at)[0]) if at else default


def table(buf: Any, table: int, slot: int) -> int:
    """Where the table (or vector, or string) that field `slot` refers to is, or 0."""
    at = field(buf, table, slot)
    return at + U32.unpack_from(buf, at)[0] if at else 0
