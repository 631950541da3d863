"""Build hook: generate the gRPC/protobuf modules from proto/ before setuptools looks for packages,
and carry the checkout's shipped data into the wheel.

Generation runs before `setup()` so that `agent.pb.*` exists when packages are discovered, for
wheels and editable installs alike. Nothing generated is committed.

`build_py` copies ``firmware_profiles/``, ``systemd/`` and ``proto/`` (top-level in the checkout,
where the docs name them) to ``agent/data/`` in the build, where `agent.base.shipped` finds them in an
installed wheel through `importlib.resources`. An editable install reads the checkout's own
files instead, so nothing is copied for one.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# the checkout's shipped directories and the files of each that the wheel carries
SHIPPED = {"firmware_profiles": "*.toml", "systemd": "edge-agent.*", "proto": "**/*.proto"}

_spec = importlib.util.spec_from_file_location("_protogen", ROOT / "agent" / "_protogen.py")
assert _spec is not None and _spec.loader is not None
_protogen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_protogen)
_protogen.generate()


class BuildWithData(build_py):  # type: ignore[misc]
    """`build_py`, plus the shipped data under ``agent/data/`` (not for editable installs)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for name, pattern in SHIPPED.items():
            source = ROOT / name
            files = sorted(p for p in source.glob(pattern) if p.is_file())
            if not files:
                raise RuntimeError(f"no {pattern} in {source}: the wheel would lack its {name}")
            for path in files:
                target = Path(self.build_lib) / "agent" / "data" / name / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)


setup(cmdclass={"build_py": BuildWithData})
