"""The .proto files as a third party compiles them: a stock ``protoc -I proto`` (grpc_tools'
protoc, nothing of ours), and our generated modules carrying exactly those descriptors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

from tests.support.paths import ROOT

PROTO = ROOT / "proto"
PROTOS = sorted(p.relative_to(PROTO).as_posix() for p in PROTO.rglob("*.proto"))
INCLUDE = str(Path(grpc_tools.__file__).parent / "_proto")  # the well-known types


def _stock(out: Path, *extra: str) -> int:
    out.mkdir(exist_ok=True)
    return protoc.main(["protoc", "-I", str(PROTO), "-I", INCLUDE, *extra, *PROTOS])


def test_plain_protoc_compiles_every_proto(tmp_path: Path) -> None:
    assert len(PROTOS) == 4
    out = tmp_path / "py"
    assert _stock(out, f"--python_out={out}", f"--grpc_python_out={out}") == 0
    # the stock modules import each other as protoc named them, with only `out` on the path
    probe = (
        "from edge_agent.fleet.v1 import fleet_pb2; from edge_agent.v1 import agent_pb2_grpc; "
        "print(fleet_pb2.DESCRIPTOR.dependencies[0].name)"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(out)!r}); {probe}"],
        capture_output=True,
        text=True,
        cwd=out,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "edge_agent/v1/agent.proto"


def test_package_descriptors_equal_plain_protoc(tmp_path: Path) -> None:
    """Our modules (agent.pb..., imports prefixed at build time) hold byte for byte the
    descriptors a plain protoc's modules hold, under the same file names (what reflection
    serves)."""
    from agent.pb.edge_agent.admin.v1 import admin_pb2
    from agent.pb.edge_agent.fleet.v1 import fleet_pb2
    from agent.pb.edge_agent.ota.v1 import ota_pb2
    from agent.pb.edge_agent.v1 import agent_pb2

    out = tmp_path / "py"
    assert _stock(out, f"--python_out={out}") == 0
    dump = (
        "import sys, importlib; sys.path.insert(0, sys.argv[1])\n"
        "for name in sys.argv[2:]:\n"
        "    m = importlib.import_module(name)\n"
        "    open(sys.argv[1] + '/' + name + '.bin', 'wb').write(m.DESCRIPTOR.serialized_pb)\n"
    )
    names = [
        "edge_agent.v1.agent_pb2",
        "edge_agent.fleet.v1.fleet_pb2",
        "edge_agent.ota.v1.ota_pb2",
        "edge_agent.admin.v1.admin_pb2",
    ]
    done = subprocess.run(
        [sys.executable, "-I", "-c", dump, str(out), *names], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    modules = (agent_pb2, fleet_pb2, ota_pb2, admin_pb2)
    for name, module in zip(names, modules, strict=True):
        assert module.DESCRIPTOR.serialized_pb == (out / f"{name}.bin").read_bytes(), name
    files = [m.DESCRIPTOR.name for m in modules]
    assert files == [
        "edge_agent/v1/agent.proto",
        "edge_agent/fleet/v1/fleet.proto",
        "edge_agent/ota/v1/ota.proto",
        "edge_agent/admin/v1/admin.proto",
    ]
    assert [d.name for d in admin_pb2.DESCRIPTOR.dependencies] == [
        "edge_agent/fleet/v1/fleet.proto"
    ]
    assert [d.name for d in fleet_pb2.DESCRIPTOR.dependencies] == ["edge_agent/v1/agent.proto"]
    assert fleet_pb2.Health.__module__ == "agent.pb.edge_agent.fleet.v1.fleet_pb2"
