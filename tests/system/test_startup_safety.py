"""What `edge-agent run` does to the host before it serves and after: real daemons in real
processes, real unix sockets, real gRPC (and an independent gRPC client, grpclib, for the v1
reflection service).

A second daemon never takes over a live socket or a state directory in use; a path that is not
a socket is never removed; a bad path or model is one line and exit 2 with nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from agent.api.grpc.client import Client, build_request
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from tests.support.daemon_harness import Daemon

PROFILE = "generic-x86_64"


def run_agent(
    tmp: Path, model: Path, *args: str, config_text: str = "", timeout: float = 90.0
) -> tuple[int | None, str]:
    """`edge-agent run` that is expected to refuse to start: (exit code, stderr). A daemon that
    starts instead is stopped after `timeout` (exit code None)."""
    config = tmp / "run.toml"
    config.write_text(config_text)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent",
            "run",
            "--profile",
            PROFILE,
            "--model",
            str(model),
            "--config",
            str(config),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        return None, err


def refusal(rc: int | None, err: str) -> str:
    """The one error line of a start-up refused with exit 2 (and no traceback)."""
    assert rc == 2, f"exit {rc}:\n{err[-3000:]}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("edge-agent: ")]
    assert len(lines) == 1, err
    return lines[0]


def req(n: int = 4) -> pb.GenerateRequest:
    return build_request(
        "def f(x):", None, max_tokens=n, temperature=None, top_k=None, top_p=None, seed=1,
        stop=[], session=None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def first(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = Daemon(tmp_path_factory.mktemp("first"), tiny_model_dir, "[watchdog]\ntick_s = 0.2\n")
    yield d
    assert d.stop() == 0, d.read_log()
    assert not os.path.lexists(d.socket)  # its own socket goes with it


def assert_serving(d: Daemon, inode: int) -> None:
    """`d` still answers on the socket it bound (same file)."""
    st = os.lstat(d.socket)
    assert stat.S_ISSOCK(st.st_mode) and st.st_ino == inode
    c = d.client()
    assert c.health() == "SERVING"
    assert c.generate(req()).finish_reason in ("length", "stop")
    c.close()


# ----------------------------------------------------------------------------- another daemon


def test_a_second_daemon_on_a_live_socket_exits_2_naming_the_first_ones_pid(
    first: Daemon, tiny_model_dir: Path, tmp_path: Path
) -> None:
    inode = os.lstat(first.socket).st_ino
    rc, err = run_agent(
        tmp_path, tiny_model_dir, "--socket", str(first.socket), "--state-dir", str(tmp_path / "s")
    )
    line = refusal(rc, err)
    assert str(first.socket) in line and f"pid {first.proc.pid}" in line, line
    assert not (tmp_path / "s").exists()  # refused before it made anything
    assert_serving(first, inode)


def test_a_second_daemon_on_a_state_directory_in_use_exits_2_naming_the_pid(
    first: Daemon, tiny_model_dir: Path, tmp_path: Path
) -> None:
    inode = os.lstat(first.socket).st_ino
    state = first.tmp / "state"
    rc, err = run_agent(
        tmp_path, tiny_model_dir, "--socket", str(tmp_path / "x.sock"), "--state-dir", str(state)
    )
    line = refusal(rc, err)
    assert str(state) in line and f"pid {first.proc.pid}" in line, line
    assert (state / "agent.lock").read_text() == f"{first.proc.pid}\n"
    assert not os.path.lexists(tmp_path / "x.sock")
    assert_serving(first, inode)


def test_a_kill_9ed_daemons_lock_and_stale_socket_do_not_block_the_next_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    a = Daemon(tmp_path, tiny_model_dir)
    a.proc.kill()  # SIGKILL: no shutdown, the socket file stays
    a.proc.wait()
    a.stop()
    stale = os.lstat(a.socket)
    assert stat.S_ISSOCK(stale.st_mode)
    b = Daemon(tmp_path, tiny_model_dir)  # same socket, same state directory
    try:
        assert (tmp_path / "state" / "agent.lock").read_text() == f"{b.proc.pid}\n"
        assert b.client().health() == "SERVING"
        assert "removed stale socket" in b.read_log()
    finally:
        assert b.stop() == 0, b.read_log()


# ----------------------------------------------------------------------------- paths


def _target_kinds(tmp: Path) -> dict[str, tuple[Path, Path]]:
    """Paths given as --socket that must survive: name -> (the path, what must be unchanged)."""
    important = tmp / "important.txt"
    important.write_bytes(os.urandom(4096))
    folder = tmp / "folder"
    folder.mkdir()
    (folder / "inside").write_text("x")
    link = tmp / "link-to-file"
    link.symlink_to(important)
    other = tmp / "elsewhere"
    other.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(other / "stale.sock"))
    stale.close()  # bound, never listened: a stale socket
    to_socket = tmp / "link-to-socket"
    to_socket.symlink_to(other / "stale.sock")
    return {
        "regular file": (important, important),
        "directory": (folder, folder / "inside"),
        "symbolic link to a file": (link, important),
        "symbolic link to a socket": (to_socket, other / "stale.sock"),
    }


def _snapshot(p: Path) -> tuple[int, int, bytes]:
    st = os.lstat(p)
    return st.st_ino, st.st_mode, p.read_bytes() if stat.S_ISREG(st.st_mode) else b""


@pytest.mark.parametrize(
    "kind",
    ["regular file", "directory", "symbolic link to a file", "symbolic link to a socket"],
)
def test_a_socket_path_that_is_not_a_socket_is_left_as_it_is_and_refused(
    kind: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path, keep = _target_kinds(tmp_path)[kind]
    before = {p: _snapshot(p) for p in (path, keep)}
    rc, err = run_agent(
        tmp_path, tiny_model_dir, "--socket", str(path), "--state-dir", str(tmp_path / "s")
    )
    line = refusal(rc, err)
    assert str(path) in line and "not a unix socket" in line, line
    described = "a symbolic link" if kind.startswith("symbolic") else f"a {kind}"
    assert described in line, line
    assert {p: _snapshot(p) for p in (path, keep)} == before  # byte for byte, same inode


def test_a_socket_whose_parent_is_missing_is_refused_and_nothing_is_created(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "no" / "such" / "agent.sock"
    rc, err = run_agent(
        tmp_path, tiny_model_dir, "--socket", str(sock), "--state-dir", str(tmp_path / "s")
    )
    line = refusal(rc, err)
    assert str(sock.parent) in line and "does not exist" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_a_socket_path_too_long_for_af_unix_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / ("s" * max(1, 108 - len(os.fsencode(tmp_path))))  # 109 bytes or more
    assert len(os.fsencode(sock)) > 107
    rc, err = run_agent(
        tmp_path, tiny_model_dir, "--socket", str(sock), "--state-dir", str(tmp_path / "s")
    )
    line = refusal(rc, err)
    assert "at most 107" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_the_socket_directory_is_created_as_its_last_level_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    d = Daemon(tmp_path, tiny_model_dir)  # --socket tmp/run/agent.sock, tmp/run missing
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o755
        assert stat.S_IMODE(os.stat(tmp_path / "state").st_mode) == 0o700
    finally:
        assert d.stop() == 0


def test_a_state_dir_that_is_a_file_is_one_line_and_exit_2(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.write_text("not a directory\n")
    rc, err = run_agent(
        tmp_path, tiny_model_dir, "--socket", str(tmp_path / "a.sock"), "--state-dir", str(state)
    )
    line = refusal(rc, err)
    assert str(state) in line and "a regular file" in line, line
    assert state.read_text() == "not a directory\n"
    assert not os.path.lexists(tmp_path / "a.sock")


def test_a_state_dir_that_cannot_be_created_is_one_line_and_exit_2(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    state = Path("/proc/self/edge-agent-state")  # /proc takes no new files, even from root
    rc, err = run_agent(
        tmp_path, tiny_model_dir, "--socket", str(tmp_path / "a.sock"), "--state-dir", str(state)
    )
    line = refusal(rc, err)
    assert "state directory" in line and "edge-agent-state" in line, line


def test_a_socket_group_that_does_not_exist_is_one_line_and_exit_2(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "a.sock"
    rc, err = run_agent(
        tmp_path,
        tiny_model_dir,
        *("--socket", str(sock), "--state-dir", str(tmp_path / "s")),
        config_text='[server]\nsocket_group = "no-such-group-here"\n',
    )
    line = refusal(rc, err)
    assert "socket_group = 'no-such-group-here'" in line, line
    assert not os.path.lexists(sock)


def test_a_socket_replaced_while_serving_is_left_at_shutdown(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    d = Daemon(tmp_path, tiny_model_dir)
    os.rename(d.socket, tmp_path / "moved.sock")
    d.socket.write_text("someone else's\n")
    assert d.stop() == 0, d.read_log()
    assert d.socket.read_text() == "someone else's\n"


# ----------------------------------------------------------------------------- model files


def _garble(tensors_at: bytearray) -> None:
    """Point one tensor of the first subgraph outside the file: the flatbuffer no longer holds
    together (LiteRT itself refuses it), while its first bytes and identifier stay right."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs(tensors_at, 0)
    sg = model.Subgraphs(0)
    vector = sg._tab.Vector(sg._tab.Offset(4))  # field 0 of SubGraph: tensors
    struct.pack_into("<I", tensors_at, vector + 4 * (sg.TensorsLength() // 2), 0x7FFFFFF0)


def test_a_garbled_tflite_whose_sha256_matches_is_one_line_naming_the_file(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from ai_edge_litert.interpreter import Interpreter

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    meta = json.loads((model / "metadata.json").read_text())
    for v in meta["variants"]:
        data = bytearray((model / v["file"]).read_bytes())
        _garble(data)
        (model / v["file"]).write_bytes(data)
        v["sha256"], v["size"] = hashlib.sha256(data).hexdigest(), len(data)
    (model / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a valid Flatbuffer"):  # the reference agrees
        Interpreter(model_path=str(model / "model_int8.tflite"))
    rc, err = run_agent(
        tmp_path, model, "--socket", str(tmp_path / "a.sock"), "--state-dir", str(tmp_path / "s")
    )
    line = refusal(rc, err)
    assert str(model / "model_int8.tflite") in line and "corrupt TFLite flatbuffer" in line, line
    assert not os.path.lexists(tmp_path / "a.sock")


# ----------------------------------------------------------------------- TCP, reflection, logs


def test_tcp_port_0_binds_an_ephemeral_port_and_says_which(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    d = Daemon(tmp_path, tiny_model_dir, args=("--tcp", "127.0.0.1:0"))
    try:
        m = re.search(r"tcp 127\.0\.0\.1:(\d+)", d.ready["STATUS"])
        assert m, d.ready
        port = int(m.group(1))
        assert port > 0
        assert f"127.0.0.1:{port}" in d.read_log()
        c = Client(f"127.0.0.1:{port}", timeout=30)
        assert c.health() == "SERVING"
        assert c.generate(req()).finish_reason in ("length", "stop")
        c.close()
    finally:
        assert d.stop() == 0, d.read_log()


# grpc.reflection.v1 through grpclib (its own HTTP/2 client and its own v1 protos), in a fresh
# interpreter: grpclib's v1 protos and grpcio-reflection's define the same symbols, and one
# process's default descriptor pool takes only one of them (an in-process daemon of another
# test registers grpcio's). It prints what the daemon answered as base64 descriptor bytes.
_REFLECT_V1 = """
import asyncio, base64, json, sys
from grpclib.client import Channel
from grpclib.reflection.v1 import reflection_pb2 as v1
from grpclib.reflection.v1.reflection_grpc import ServerReflectionStub

async def main(path):
    channel = Channel(path=path)
    try:
        stub = ServerReflectionStub(channel)
        async with stub.ServerReflectionInfo.open() as stream:
            replies = []
            for r in [
                v1.ServerReflectionRequest(list_services=""),
                v1.ServerReflectionRequest(file_containing_symbol="edge_agent.v1.Agent"),
                v1.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection"
                ),
            ]:
                await stream.send_message(r)
                replies.append(await stream.recv_message())
            await stream.end()
    finally:
        channel.close()
    files = lambda r: [base64.b64encode(b).decode() for b in
                       r.file_descriptor_response.file_descriptor_proto]
    print(json.dumps({
        "listed": [s.name for s in replies[0].list_services_response.service],
        "agent": files(replies[1]),
        "reflection": files(replies[2]),
        "reference": base64.b64encode(v1.DESCRIPTOR.serialized_pb).decode(),
    }))

asyncio.run(main(sys.argv[1]))
"""


def test_reflection_v1_lists_and_describes_the_services(first: Daemon) -> None:
    import base64

    from google.protobuf import descriptor_pb2

    done = subprocess.run(
        [sys.executable, "-c", _REFLECT_V1, str(first.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert {
        "edge_agent.v1.Agent",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= set(got["listed"])

    def files(key: str) -> list[descriptor_pb2.FileDescriptorProto]:
        return [
            descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(b)) for b in got[key]
        ]

    agent = [f for f in files("agent") if f.package == "edge_agent.v1"]
    assert agent and "Agent" in {s.name for f in agent for s in f.service}
    # the v1 file the daemon serves is grpc's v1 protocol as grpclib ships it, field for field
    served = next(f for f in files("reflection") if f.package == "grpc.reflection.v1")
    reference = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(got["reference"]))

    def shape(f: descriptor_pb2.FileDescriptorProto) -> object:
        return (
            sorted(
                (m.name, sorted((x.name, x.number, x.type, x.label, x.type_name) for x in m.field))
                for m in f.message_type
            ),
            [
                (s.name, [(x.name, x.input_type, x.output_type) for x in s.method])
                for s in f.service
            ],
        )

    assert shape(served) == shape(reference)


def test_start_up_log_lines_are_printed_once(first: Daemon) -> None:
    lines = first.read_log().splitlines()
    ready = next(i for i, line in enumerate(lines) if "agent.daemon: ready in" in line)
    ours = [line for line in lines[: ready + 1] if re.match(r"(INFO|WARNING|ERROR) agent\.", line)]
    assert sum("auto quantization ->" in line for line in ours) == 1, ours
    twice = [line for line, n in Counter(ours).items() if n > 1]
    assert not twice, twice
