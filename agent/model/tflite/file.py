"""Read a `.tflite` file's structure without running it: signatures, tensors, ops, weights
(the types: `agent.model.tflite.info`), for ``model inspect``, memory accounting and the
fused-graph check. Reading a large graph is slow in Python, so the runtime keeps what it read
beside the packed weights (``cache``) and later starts read that instead.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from agent.base.errors import ModelFormatError
from agent.model.tflite.info import ModelFile, SignatureIO, TensorInfo

# Bumped whenever `modelparse` reads a file differently, so an older cached reading is not used.
PARSE_FORMAT: Final = 1


def read_model_file(path: Path, cache: Path | None = None) -> ModelFile:
    """Parse a `.tflite` file's structure (signatures, ops, weight types).

    With `cache`, a JSON file: the reading kept there by an earlier call is used when it was
    made of this very file (same size, modification time and inode) by this `PARSE_FORMAT`,
    and a new reading is kept there (best effort: a cache that cannot be written is skipped).
    """
    try:
        with open(path, "rb") as f:
            stamp = _stamp(os.fstat(f.fileno()))
            known = _cached(cache, stamp, path) if cache is not None else None
            if known is not None:
                return known
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot read: {exc}") from exc
    try:
        if len(data) < 8 or data[4:8] != b"TFL3":
            raise ModelFormatError(f"{path}: not a TFLite flatbuffer (no TFL3 identifier)")
        from agent.model.tflite.parse import parse

        model = parse(path, data)
    except ModelFormatError:
        raise
    except Exception as exc:  # a corrupt flatbuffer can fail anywhere in the generated code
        raise ModelFormatError(
            f"{path}: corrupt TFLite flatbuffer ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        # After a failed parse, views of the map (numpy arrays of the generated accessors)
        # live on in the error's traceback, and closing would raise BufferError over the
        # error: the map is then unmapped when the last view goes.
        with contextlib.suppress(BufferError):
            data.close()
    if cache is not None:
        _keep(cache, stamp, model)
    return model


def _stamp(st: os.stat_result) -> list[int]:
    return [PARSE_FORMAT, st.st_size, st.st_mtime_ns, st.st_ino]


def _cached(cache: Path, stamp: list[int], path: Path) -> ModelFile | None:
    """The reading kept in `cache` if it was made of the file `stamp` describes, else None."""
    try:
        kept = json.loads(cache.read_text())
        if kept["stamp"] != stamp:
            return None
        m = kept["model"]

        def tensors(rows: list[dict[str, Any]]) -> tuple[TensorInfo, ...]:
            return tuple(TensorInfo(t["name"], tuple(t["shape"]), t["dtype"]) for t in rows)

        return ModelFile(
            path=path,
            size=m["size"],
            signatures=tuple(
                SignatureIO(
                    s["key"],
                    s["subgraph_index"],
                    tensors(s["inputs"]),
                    tensors(s["outputs"]),
                    s["activation_bytes"],
                )
                for s in m["signatures"]
            ),
            op_counts=tuple((str(k), int(n)) for k, n in m["op_counts"]),
            composites=tuple((str(k), int(n)) for k, n in m["composites"]),
            weights=tuple((str(a), str(b), int(c), int(d)) for a, b, c, d in m["weights"]),
            weight_bytes=m["weight_bytes"],
        )
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one we wrote: read again
        return None


def _keep(cache: Path, stamp: list[int], model: ModelFile) -> None:
    fields = asdict(model)
    fields.pop("path")  # the file it describes is the one it is read for
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=cache.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"stamp": stamp, "model": fields}, f)
            os.replace(tmp, cache)
        except OSError:
            os.unlink(tmp)
            raise
