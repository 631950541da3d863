"""Build hook of the client distribution: the version is the daemon's, the gRPC/protobuf modules
are generated from the repository's ``proto/`` into ``edge_agent_client/pb/`` (by the daemon's
own `agent/_protogen.py`, loaded as a file so that building never imports the `agent` package),
and the ``.proto`` files ship as package data under ``edge_agent_client/proto/`` for other
languages' stock ``protoc``.

It builds from a checkout of the repository (``pip wheel client/``): the protos and the version
live one directory up.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
PROTO = REPO / "proto"
PACKAGE = "edge_agent_client"


def daemon_version() -> str:
    """`__version__` of ``agent/__init__.py``, read without importing it."""
    tree = ast.parse((REPO / "agent" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            if isinstance(value, str):
                return value
    raise RuntimeError(f"no __version__ in {REPO / 'agent' / '__init__.py'}")


_spec = importlib.util.spec_from_file_location("_protogen", REPO / "agent" / "_protogen.py")
assert _spec is not None and _spec.loader is not None
_protogen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_protogen)
_protogen.generate(PROTO, ROOT, f"{PACKAGE}.pb")


class BuildWithProtos(build_py):  # type: ignore[misc]
    """`build_py`, plus the .proto files under ``edge_agent_client/proto/``."""

    def run(self) -> None:
        super().run()
        protos = sorted(PROTO.rglob("*.proto"))
        if not protos:
            raise RuntimeError(f"no .proto files under {PROTO}: the wheel would lack them")
        for path in protos:
            target = Path(self.build_lib) / PACKAGE / "proto" / path.relative_to(PROTO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


setup(version=daemon_version(), cmdclass={"build_py": BuildWithProtos})
