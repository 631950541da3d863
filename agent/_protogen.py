"""Generate the protobuf/gRPC modules from `proto/` into `agent/pb/` (at build time).

`setup.py` calls this from `build_py`, so wheels and editable installs carry the generated
modules; nothing generated is committed. The `.proto` files are mapped to the virtual path
``agent/pb/`` so that the generated imports are ``agent.pb.edge_agent.v1...``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PACKAGE = ROOT / "agent" / "pb"


def generate(proto_dir: Path = PROTO_DIR, out_root: Path = ROOT) -> list[Path]:
    """Run grpc_tools.protoc on every .proto under `proto_dir`; return the files written."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency (grpcio-tools)

    protos = sorted(proto_dir.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_dir}")
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"--proto_path=agent/pb={proto_dir}",
        f"--proto_path={include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"agent/pb/{p.relative_to(proto_dir).as_posix()}" for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    written = []
    pb = out_root / "agent" / "pb"
    for d in [pb, *[p for p in pb.rglob("*") if p.is_dir()]]:
        init = d / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/ at build time; do not edit."""\n')
        written.append(init)
    written += sorted(pb.rglob("*_pb2*.py*"))
    return written


if __name__ == "__main__":
    for path in generate():
        print(path)
