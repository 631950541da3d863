"""The TFLite flatbuffer schema module: LiteRT's own where ai-edge-litert is installed, else the
`tflite` package (boards on the legacy tflite-runtime backend, which ships no schema). Both are
generated from the same schema by flatc; the older `tflite` lacks the newest tables (e.g.
`BlockwiseQuantization`), which callers look up with `getattr`."""

from __future__ import annotations

from typing import Any


def _load() -> Any:
    try:
        from ai_edge_litert import schema_py_generated
    except ImportError:  # the legacy backend's environment
        import tflite

        return tflite
    return schema_py_generated


schema: Any = _load()

__all__ = ["schema"]
