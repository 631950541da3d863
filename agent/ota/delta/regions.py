"""Split a `.tflite` file into tensor buffers and the bytes between them.

A `.tflite` is a flatbuffer whose big data are ``Buffer`` tables: either an inline ``data``
vector inside the flatbuffer, or (large models) ``offset``/``size`` pointing past it. The
delta treats each buffer as one region keyed by the name of the first tensor using it, and
everything else (flatbuffer tables, strings, small buffers, padding) as "gap" regions in
between, so that together the regions cover the file exactly.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a delta is made: a board applying one never needs it
    from agent.model.tflite.schema import schema

log = logging.getLogger(__name__)

# Smaller buffers stay inside the gaps: an op of their own would cost more than it saves.
MIN_TENSOR_BYTES = 256


@dataclass(frozen=True, slots=True)
class Region:
    """`length` bytes at `offset`; `key` names a tensor buffer, "" marks a gap."""

    offset: int
    length: int
    key: str
    ordinal: int  # buffer index for a tensor, position among the gaps for a gap

    @property
    def end(self) -> int:
        return self.offset + self.length


def _buffer_keys(model: schema.Model) -> dict[int, str]:
    """Buffer index -> "subgraph/tensor name" of the first tensor that uses it."""
    keys: dict[int, str] = {}
    for s in range(model.SubgraphsLength()):
        sg = model.Subgraphs(s)
        for t in range(sg.TensorsLength()):
            tensor = sg.Tensors(t)
            name = tensor.Name()
            keys.setdefault(tensor.Buffer(), f"{s}/{name.decode('utf-8', 'replace')}")
    return keys


def _buffer_ranges(model: schema.Model, size: int) -> list[tuple[int, int, int]]:
    """(offset, length, buffer index) of every non-empty buffer that lies inside the file."""
    out = []
    for i in range(model.BuffersLength()):
        b = model.Buffers(i)
        vec = b._tab.Offset(4)  # the `data` field's vtable slot, as the generated code reads it
        if vec and b._tab.VectorLen(vec):
            start, length = b._tab.Vector(vec), b._tab.VectorLen(vec)
        elif b.Size() > 0:
            start, length = b.Offset(), b.Size()
        else:
            continue
        if start < 0 or start + length > size:
            raise ValueError(f"buffer {i} at {start}+{length} lies outside the {size}-byte file")
        out.append((start, length, i))
    return out


def tflite_regions(data: bytes | mmap.mmap, label: str) -> list[Region] | None:
    """The file's regions in file order (tensors and gaps, covering it exactly), or None if
    it is not a TFLite flatbuffer this code understands (the caller then diffs it whole)."""
    size = len(data)
    if size < 8 or bytes(data[4:8]) != b"TFL3":
        return None
    from agent.model.tflite.schema import schema

    try:
        model = schema.Model.GetRootAs(data, 0)
        keys = _buffer_keys(model)
        ranges = _buffer_ranges(model, size)
    except Exception as exc:  # a corrupt flatbuffer can fail anywhere in the generated code
        log.info("%s: not parsed as TFLite (%s); diffing it whole", label, exc)
        return None
    regions: list[Region] = []
    pos = gaps = 0
    for start, length, index in sorted(ranges):
        if length < MIN_TENSOR_BYTES or start < pos:  # small, or overlapping the previous one
            continue
        if start > pos:
            regions.append(Region(pos, start - pos, "", gaps))
            gaps += 1
        regions.append(Region(start, length, keys.get(index, f"#buffer{index}"), index))
        pos = start + length
    if pos < size:
        regions.append(Region(pos, size - pos, "", gaps))
    return regions
