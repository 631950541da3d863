"""Generate the protobuf/gRPC modules from `proto/` into `agent/pb/` (at build time).

`setup.py` calls this before `setup()`, so wheels and editable installs carry the generated
modules; nothing generated is committed. The `.proto` files import each other by paths relative
to ``proto/`` (``import "edge_agent/v1/agent.proto";``), so any stock ``protoc -I proto``
compiles them; their Python modules live under ``agent.pb``, so the generated imports
(``from edge_agent.v1 import agent_pb2``) are given that prefix here, as protoc has no option
for it. The descriptors keep the plain names (``edge_agent/v1/agent.proto``), the names the
reflection service shows and a client's ``-import-path proto`` finds.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PACKAGE = ROOT / "agent" / "pb"
PREFIX = "agent.pb"

# `from edge_agent.v1 import agent_pb2 as ...` and `import edge_agent.v1.agent_pb2` in generated
# code; well-known types (google.protobuf) are not ours and stay as they are
_IMPORT = re.compile(r"^(\s*)(from|import) (edge_agent)\b", re.MULTILINE)
# the module name the message classes get as their __module__
_MODULE = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')(edge_agent\.)")


def prefix_imports(text: str, prefix: str = PREFIX) -> str:
    """Generated code with its imports of our own modules (and the module names it gives its
    classes) moved under `prefix`."""
    return _MODULE.sub(rf"\1{prefix}.\2", _IMPORT.sub(rf"\1\2 {prefix}.\3", text))


def generate(
    proto_dir: Path = PROTO_DIR, out_root: Path = ROOT, prefix: str = PREFIX
) -> list[Path]:
    """Run grpc_tools.protoc on every .proto under `proto_dir` into the package `prefix` under
    `out_root` (the daemon's `agent.pb`; the client distribution's `edge_agent_client.pb`);
    return the files written."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency (grpcio-tools)

    protos = sorted(proto_dir.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_dir}")
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    pb = out_root.joinpath(*prefix.split("."))
    written = []
    with tempfile.TemporaryDirectory(prefix="edge-agent-protoc-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={proto_dir}",
            f"--proto_path={include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(p.relative_to(proto_dir).as_posix() for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        for made in sorted(Path(tmp).rglob("*_pb2*.py*")):
            target = pb / made.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            partial.write_text(prefix_imports(made.read_text(), prefix))
            os.replace(partial, target)  # a running process never imports half a module
            written.append(target)
    for d in [pb, *[p for p in pb.rglob("*") if p.is_dir()]]:
        init = d / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/ at build time; do not edit."""\n')
        written.append(init)
    return written


if __name__ == "__main__":
    for path in generate():
        print(path)
