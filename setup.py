"""Build hook: generate the gRPC/protobuf modules from proto/ before setuptools looks for packages.

Generation runs before `setup()` so that `agent.pb.*` exists when packages are discovered, for
wheels and editable installs alike. Nothing generated is committed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup

_spec = importlib.util.spec_from_file_location(
    "_protogen", Path(__file__).resolve().parent / "agent" / "_protogen.py"
)
assert _spec is not None and _spec.loader is not None
_protogen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_protogen)
_protogen.generate()

setup()
