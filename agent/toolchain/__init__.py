"""The model toolchain: train, convert, quantize and evaluate decoders for edge-agent.

This package is the only place that imports torch and litert-torch (the ``toolchain``
extra). The daemon never imports it.

Importing the package puts a stand-in for ``tensorflow.lite.python.schema_py_generated``
on ``sys.path`` (litert-torch 0.10.0 imports it; tensorflow is not one of its dependencies).
Submodules import torch / litert_torch lazily so that ``agent.toolchain.corpus`` and
``agent.toolchain.tokenizer`` stay light.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SHIM = Path(__file__).resolve().parent / "_shim"


def _install_shim() -> None:
    try:
        have_tf = importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        have_tf = False
    if not have_tf and str(_SHIM) not in sys.path:
        sys.path.append(str(_SHIM))


_install_shim()
