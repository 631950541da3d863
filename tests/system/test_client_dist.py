"""The `edge-agent-client` distribution (client/): its wheel is built from this checkout and
installed into a bare directory; then, in a Python where every import outside the standard
library, grpc, protobuf and the client itself fails (no numpy, no LiteRT, no `agent`), its
`Client` and `AsyncClient` talk to a real daemon: streamed typed chunks, a completion, model
info, a session round trip, bad input → InvalidArgument, cancellation mid-generation (the
daemon's log shows that request cancelled early and the slot is free). And stock protoc
compiles the .proto files the wheel ships (Python and C++).

The daemon runs the shipped demo model; the cancellations go to a second one that runs it
without its stop token (tests/support/endless.py): a 900-token generation there takes about a second
whatever the sampler draws, so a cancel sent after its first chunk lands in the middle of it
(the tiny test model finishes 100 tokens before a cancel arrives, and the demo model itself
may draw its EOS early; structured output needs that EOS, so it stays on the first daemon).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

import agent
from agent.api import identity
from agent.api.grpc.client import build_request
from agent.model.directory import demo_model_dir
from tests.support.daemon_harness import Daemon
from tests.support.endless import endless_model_dir
from tests.support.paths import ROOT

REPO = ROOT
LONG = 900  # max_tokens of the generations the tests cancel (the demo model's context is 1024)

# Run first in the client's interpreter (python -S: no site, no .pth files, so not the
# checkout's editable `agent` either): only the standard library, grpc, protobuf and the
# installed client can be imported.
GUARD = """
import importlib.abc, sys
ALLOWED = {"grpc", "google", "edge_agent_client", "typing_extensions"}  # grpcio needs the last
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in ALLOWED or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        raise ImportError(f"{name} is not importable in the client's environment")
sys.meta_path.insert(0, Refuse())
sys.path[:0] = [SITE]
sys.path.append(VENV_SITE)
for name in ("numpy", "ai_edge_litert", "tflite_runtime", "agent"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{name} was importable")
"""

SCRIPT = r"""
import asyncio, dataclasses, json, re, sys, time
import edge_agent_client
from edge_agent_client import (
    AsyncClient, Chunk, Client, Completion, InvalidArgument, Message, ModelFigures, ModelInfo,
    NotFound, SessionInfo, Status,
)
from edge_agent_client import types
from edge_agent_client.pb.edge_agent.v1 import agent_pb2 as pb

assert edge_agent_client.__file__.startswith(SITE), edge_agent_client.__file__
for name in ("numpy", "ai_edge_litert", "agent"):
    assert name not in sys.modules, name
sock = sys.argv[1]
LONG = int(sys.argv[2])
long_sock = sys.argv[3]  # the model without a stop token: LONG tokens always take a while
out = {"version": edge_agent_client.__version__}

# every field of the API's messages is in the client's dataclasses
for cls, message in [
    (types.Stats, pb.RequestStats), (types.KVTiers, pb.KVTiers), (types.ModelInfo, pb.ModelInfo),
    (types.Status, pb.AgentStatus), (types.SessionInfo, pb.SessionInfo),
    (types.Percentiles, pb.Percentiles), (types.ModelFigures, pb.ModelFigures),
    (types.ProbeFigures, pb.ProbeFigures), (types.NamedModel, pb.NamedModel),
]:
    names = [f.name for f in dataclasses.fields(cls)]
    assert names == [f.name for f in message.DESCRIPTOR.fields], (cls, names)

def wait_idle(c):
    deadline = time.monotonic() + 60
    while c.status().active_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    return c.status().active_requests

with Client(sock, key="app-one") as c:
    out["health"] = c.health()
    info = c.model_info()
    assert isinstance(info, ModelInfo) and isinstance(info.signatures, tuple)
    # a file without batch signatures is served one request at a time, and says why
    assert info.batch_sizes == () and "batch signatures" in info.batch_problem, info
    out["model"] = info.name
    st = c.status()
    assert isinstance(st, Status) and st.state == "serving", st
    # the serving model's own figures; a first start has no model before it
    assert isinstance(st.run, ModelFigures) and st.run.sha256 == info.sha256, st.run
    assert st.previous is None and isinstance(st.run.errors, dict)
    ids = c.tokenize("def f():")
    assert isinstance(ids, tuple) and ids
    assert c.detokenize(ids) == "def f():"

    # streamed: typed chunks, the reason and stats on the last only
    chunks = list(c.generate("def f():", max_tokens=12, temperature=0.0))
    assert chunks and all(isinstance(ch, Chunk) for ch in chunks)
    assert all(ch.finish_reason is None and ch.stats is None for ch in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length") and last.stats is not None
    out["stream_text"] = "".join(ch.text for ch in chunks)
    out["stream_ids"] = [t for ch in chunks for t in ch.token_ids]
    assert last.stats.generated_tokens == len(out["stream_ids"])
    comp = c.complete("def f():", max_tokens=12, temperature=0.0)
    assert isinstance(comp, Completion)
    assert (comp.text, list(comp.token_ids)) == (out["stream_text"], out["stream_ids"])
    try:
        comp.text = "x"
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("Completion is not frozen")

    # constrained: the regex's language only
    digits = c.complete("x = ", regex="[0-9]{3}", max_tokens=8, temperature=1.0, seed=5)
    assert re.fullmatch("[0-9]{3}", digits.text), digits
    out["regex_text"] = digits.text

    # sessions: a second turn reuses the first's KV; another key cannot see or use them
    sid = c.create_session()
    t1 = c.complete([Message("user", "def f():")], session_id=sid, max_tokens=4, temperature=0.0)
    t2 = c.complete([("user", "def g():")], session_id=sid, max_tokens=4, temperature=0.0)
    assert t2.stats.cached_tokens >= t1.stats.prompt_tokens, (t1.stats, t2.stats)
    fork = c.fork_session(sid)
    listed = {s.id: s for s in c.list_sessions()}
    assert {sid, fork} <= set(listed) and all(isinstance(s, SessionInfo) for s in listed.values())
    assert listed[sid].tokens > 0, listed[sid]
    with Client(sock, key="app-two") as other:
        assert sid not in {s.id for s in other.list_sessions()}
        try:
            other.complete("x", session_id=sid, max_tokens=2)
        except NotFound as exc:
            out["other_key"] = [exc.code, str(exc)]
    c.delete_session(fork)
    c.delete_session(sid)
    assert not {sid, fork} & {s.id for s in c.list_sessions()}
    try:
        c.complete("x", session_id=sid, max_tokens=2)
    except NotFound as exc:
        out["deleted"] = [exc.code, str(exc)]

    # bad input: the daemon's message, and it keeps serving
    try:
        c.complete([("robot", "x")], max_tokens=3)
    except InvalidArgument as exc:
        out["bad_role"] = [exc.code, str(exc)]
    try:
        c.complete("x", max_tokens=3, temperature=-1.0)
    except InvalidArgument as exc:
        out["bad_temperature"] = [exc.code, str(exc)]
    assert c.complete("x", max_tokens=2).finish_reason in ("stop", "length")

# cancel mid-way: iteration ends, the completion says so, the slot is free
with Client(long_sock, key="app-one") as c:
    gen = c.generate("import os\n", max_tokens=LONG, temperature=1.0, seed=3)
    first = next(gen)
    assert first.finish_reason is None
    gen.cancel()
    rest = list(gen)
    cancelled = gen.completion()
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < LONG, cancelled
    out["sync_cancel"] = {"after": len(rest), "idle": wait_idle(c)}


async def main():
    async with AsyncClient(sock, key="app-one") as a:
        out["async_health"] = await a.health()
        assert (await a.model_info()).name == out["model"]
        chunks = [ch async for ch in a.generate("def f():", max_tokens=12, temperature=0.0)]
        assert all(isinstance(ch, Chunk) for ch in chunks)
        assert [t for ch in chunks for t in ch.token_ids] == out["stream_ids"]
        comp = await a.complete("def f():", max_tokens=12, temperature=0.0)
        assert comp.text == out["stream_text"]
        sid = await a.create_session()
        turn = await a.complete([("user", "hi")], session_id=sid, max_tokens=3, temperature=0.0)
        assert turn.finish_reason in ("stop", "length")
        assert sid in {s.id for s in await a.list_sessions()}
        await a.delete_session(sid)
        assert sid not in {s.id for s in await a.list_sessions()}
        try:
            await a.complete([("robot", "x")], max_tokens=3)
        except InvalidArgument as exc:
            out["async_bad_role"] = [exc.code, str(exc)]
    async with AsyncClient(long_sock, key="app-one") as a:
        gen = a.generate("import os\n", max_tokens=LONG, temperature=1.0, seed=4)
        first = await gen.__anext__()
        assert first.finish_reason is None
        gen.cancel()
        cancelled = await gen.completion()
        assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < LONG
        deadline = time.monotonic() + 60
        while (await a.status()).active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        out["async_cancel"] = {"idle": (await a.status()).active_requests}

asyncio.run(main())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client's wheel, built as a user would (`pip wheel client/`) from a copy of the
    files its build reads, so the checkout gets no build/ or egg-info."""
    tmp = tmp_path_factory.mktemp("client-wheel")
    src = tmp / "repo"
    shutil.copytree(
        REPO / "client",
        src / "client",
        ignore=shutil.ignore_patterns("pb", "build", "*.egg-info", "__pycache__"),
    )
    shutil.copytree(REPO / "proto", src / "proto")
    (src / "agent").mkdir()
    for name in ("__init__.py", "_protogen.py"):
        shutil.copyfile(REPO / "agent" / name, src / "agent" / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", str(src / "client"), "-w", tmp],
        check=True,
        timeout=120,
    )
    (built,) = tmp.glob("edge_agent_client-*.whl")
    return built


@pytest.fixture(scope="module")
def site(wheel: Path) -> Path:
    target = wheel.parent / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        check=True,
        timeout=120,
    )
    return target


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("client-daemon")
    d = Daemon(tmp, demo_model_dir(), "")
    yield d
    assert d.stop() == 0, d.read_log()


@pytest.fixture(scope="module")
def endless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("client-endless")
    d = Daemon(tmp, endless_model_dir(tmp / "model"), "")
    yield d
    assert d.stop() == 0, d.read_log()


def run_client(site: Path, script: str, *args: str) -> Any:
    prelude = f"SITE = {str(site)!r}\nVENV_SITE = {sysconfig.get_paths()['purelib']!r}\n"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", prelude + GUARD + script, *args],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_wheel_metadata_version_and_dependencies(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = z.read(meta_name).decode()
        shipped = {
            n.removeprefix("edge_agent_client/proto/"): z.read(n)
            for n in names
            if n.startswith("edge_agent_client/proto/")
        }
    assert re.search(rf"^Version: {re.escape(agent.__version__)}$", meta, re.M), meta
    requires = [Requirement(r) for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)]
    daemon_deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {Requirement(d).name: Requirement(d).specifier for d in daemon_deps}
    assert {r.name for r in requires} == {"grpcio", "protobuf"}
    for r in requires:
        assert r.specifier == ranges[r.name], (r, ranges[r.name])
    # decided: the daemon does not depend on the client (no index hosts it)
    assert "edge-agent-client" not in ranges
    assert {
        "edge_agent_client/py.typed",
        "edge_agent_client/pb/edge_agent/v1/agent_pb2.pyi",
    } <= names
    protos = {
        p.relative_to(REPO / "proto").as_posix(): p.read_bytes()
        for p in (REPO / "proto").rglob("*.proto")
    }
    assert shipped == protos


def test_stock_protoc_compiles_the_shipped_protos(site: Path, tmp_path: Path) -> None:
    """grpc_tools' protoc (stock protoc with only the Python generators built in: it has no
    --cpp_out) makes Python modules, stubs and gRPC stubs from the shipped files alone, and a
    descriptor set, the language-neutral form (buf, grpcurl and every language's plugins
    read it), holding exactly the descriptors the client's own modules carry."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    root = site / "edge_agent_client" / "proto"
    protos = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.proto"))
    assert "edge_agent/v1/agent.proto" in protos
    out, described = tmp_path / "out", tmp_path / "edge_agent.pb"
    out.mkdir()
    args = [f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    assert protoc.main(["protoc", f"-I{root}", *args, f"-o{described}", *protos]) == 0
    for name in protos:
        stem = name.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (out / f"{stem}{suffix}").is_file(), stem + suffix
    files = descriptor_pb2.FileDescriptorSet.FromString(described.read_bytes()).file
    assert sorted(f.name for f in files) == protos
    # the client's modules hold byte for byte the descriptors of the stock modules
    dump = (
        "import importlib, json, sys\n"
        "print(json.dumps({n: importlib.import_module(P + n).DESCRIPTOR.serialized_pb.hex()"
        " for n in N}))\n"
    )
    names = [p.removesuffix(".proto").replace("/", ".") + "_pb2" for p in protos]
    ours = run_client(site, f"P = 'edge_agent_client.pb.'\nN = {names!r}\n" + dump)
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"P = ''\nN = {names!r}\nsys_path = {str(out)!r}\n"
            + "import sys; sys.path.insert(0, sys_path)\n"
            + dump,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert ours == json.loads(done.stdout)
    (stock,) = [f for f in files if f.name == "edge_agent/v1/agent.proto"]
    assert [s.name for s in stock.service] == ["Agent"]


def test_identity_matches_the_daemon(site: Path) -> None:
    """The client sends its key under the daemon's metadata name, from the same environment
    variable and key file as `edge-agent client`."""
    script = (
        "from edge_agent_client import _wire\n"
        "import json\n"
        "print(json.dumps([_wire.METADATA_KEY, _wire.KEY_ENV, str(_wire.default_key_path())]))\n"
    )
    got = run_client(site, script)
    assert got == [identity.METADATA_KEY, identity.KEY_ENV, str(identity.default_key_path())]


def test_client_against_a_real_daemon(site: Path, daemon: Daemon, endless: Daemon) -> None:
    since = len(endless.read_log())
    out = run_client(site, SCRIPT, str(daemon.socket), str(LONG), str(endless.socket))
    assert out["version"] == agent.__version__
    assert out["health"] == out["async_health"] == "SERVING"
    # the typed stream is what the project's own client gets for the same request
    ref = daemon.client().generate(
        build_request(
            "def f():",
            None,
            max_tokens=12,
            temperature=0.0,
            top_k=None,
            top_p=None,
            seed=None,
            stop=[],
        )
    )
    assert (out["stream_text"], out["stream_ids"]) == (ref.text, ref.tokens)
    assert out["other_key"][0] == out["deleted"][0] == "NOT_FOUND"
    for key in ("bad_role", "bad_temperature", "async_bad_role"):
        code, message = out[key]
        assert code == "INVALID_ARGUMENT" and message, out[key]
    assert "robot" in out["bad_role"][1]
    # the daemon stopped both cancelled requests (the only ones) early and freed their slots
    assert out["sync_cancel"]["idle"] == out["async_cancel"]["idle"] == 0, out
    cut = re.findall(r"request r\d+ cancelled: \d+\+(\d+) tokens", endless.read_log()[since:])
    assert len(cut) == 2 and all(int(n) < LONG for n in cut), cut


def test_the_docs_example_runs_verbatim(site: Path, daemon: Daemon) -> None:
    """docs/API.md's "Python client" example, in the client-only interpreter, with this
    daemon's socket for the default."""
    doc = (REPO / "docs" / "API.md").read_text()
    pattern = r"<!-- tested: test_client_dist\.py[^>]*-->\n```python\n(.*?)```"
    (example,) = re.findall(pattern, doc, re.S)
    default = "/run/edge-agent/agent.sock"
    assert default in example
    prelude = f"SITE = {str(site)!r}\nVENV_SITE = {sysconfig.get_paths()['purelib']!r}\n"
    proc = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            prelude + GUARD + example.replace(default, str(daemon.socket)),
        ],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(" SERVING"), lines
    # (the streamed text before these has lines of its own)
    assert re.fullmatch(r"(stop|length) \d+", lines[-5]), lines
    assert re.fullmatch("[0-9]{3}", lines[-4]), lines
    assert re.fullmatch(r"[1-9]\d* tokens reused", lines[-3]), lines
    assert lines[-2] == "cancelled", lines
    assert lines[-1].startswith("INVALID_ARGUMENT "), lines
