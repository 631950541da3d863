"""Models deployed through Mender (issue 38 item 4): Debian's real mender-client (3.4) in
standalone mode runs edge-agent's Update Module (`edge-agent mender install-module`) on artifacts
`update make --mender` wrote, against a real daemon over its admin socket.

Mender's client finds Update Modules only under /usr/share/mender/modules/v3 and reads the
current artifact from /etc/mender/artifact_info before its first install: each `mender` call
runs in a private mount namespace (`unshare -m`) where this test's own directories are bound
over those two (the mender-client package made them), so the machine's are never touched.
Mender's state lives in the test's data directory (`--data`).

One daemon, in order: a bundle signed by an untrusted key fails the install (the daemon
rejects it; Mender's artifact stays the factory one); a model that fails its canary fails the
install and is rolled back in both records; `mender install` then `mender rollback` serves the
shipped model again; `mender install` then `mender commit` serves the new model and Mender names
the artifact.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agent.api.grpc.admin import admin_socket
from agent.ota.artifact.bundle import read_bundle
from agent.ota.artifact.signing import sign
from agent.ota.mender.artifact import ArtifactSpec, write_artifact
from agent.ota.store import Store
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb
from tests.support.daemon_harness import Daemon
from tests.system.test_updates import (  # noqa: F401  (fixtures)
    STRANGER,
    TRUSTED,
    Models,
    _req,
    bundle,
    config,
    models,
    trusted,
)

R = opb.UpdateRecord
DEVICE_TYPE = "edge-test-board"


class Mender:
    """`mender` in standalone mode, in a private mount namespace (see the module docstring)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.modules = tmp / "mender-modules"
        self.etc = tmp / "mender-etc"
        self.data = tmp / "mender-data"
        for d in (self.modules, self.etc, self.data):
            d.mkdir()
        (self.etc / "artifact_info").write_text("artifact_name=factory\n")
        (self.data / "device_type").write_text(f"device_type={DEVICE_TYPE}\n")
        self.conf = tmp / "mender.conf"
        self.conf.write_text(
            json.dumps(
                {
                    "DeviceTypeFile": str(self.data / "device_type"),
                    "ArtifactScriptsPath": str(self.data / "scripts"),
                    "RootfsScriptsPath": str(self.data / "scripts"),
                }
            )
        )

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        conf = ["-c", str(self.conf), "-b", str(self.tmp / "none.conf"), "-d", str(self.data)]
        mender = shlex.join(["mender", *conf, "--no-syslog", "-l", "info", *args])
        binds = (
            f"mount --bind {shlex.quote(str(self.modules))} /usr/share/mender/modules/v3 && "
            f"mount --bind {shlex.quote(str(self.etc))} /etc/mender && exec {mender}"
        )
        return subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", binds],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    def artifact(self) -> str:
        r = self("show-artifact")
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()


def _artifact(path: Path, tmp: Path, name: str) -> Path:
    out = tmp / f"{name}.mender"
    write_artifact(path, out, ArtifactSpec(name, (DEVICE_TYPE,)))
    return out


def _resigned(path: Path, tmp: Path, edit, key=TRUSTED) -> Path:  # type: ignore[no-untyped-def]
    """The bundle at `path` with its manifest edited and signed by `key` (its payload kept)."""
    import tarfile

    signed, payload = read_bundle(path)
    m = opb.Manifest.FromString(signed.manifest)
    edit(m)
    out = tmp / f"resigned-{m.version}.tar"
    data = sign(m, [key]).SerializeToString()
    with tarfile.open(path) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            f = src.extractfile(member)
            if member.name == "manifest.pb":
                import io

                member.size = len(data)
                dst.addfile(member, io.BytesIO(data))
            else:
                dst.addfile(member, f)
    assert read_bundle(out)[1].size == payload.size
    return out


def _record(tmp: Path) -> opb.UpdateRecord:
    rec = Store(tmp / "state").record()
    assert rec is not None
    return rec


def test_mender_installs_rolls_back_and_commits_through_the_update_module(
    models: Models,  # noqa: F811
    trusted: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    mender = Mender(tmp_path)
    d = Daemon(tmp_path, models.base, config(trusted, 1.0))
    try:
        admin = admin_socket(d.socket)
        where = ["--admin-socket", str(admin), "--modules-dir", str(mender.modules)]
        inst = subprocess.run(
            [sys.executable, "-m", "agent", "mender", "install-module", *where],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert inst.returncode == 0, inst.stderr
        shipped = d.client().info()["sha256"]

        # 1. an untrusted signature: the install fails, nothing changes
        bad = _resigned(bundle(models, tmp_path, version=2), tmp_path, lambda m: None, STRANGER)
        r = mender("install", str(_artifact(bad, tmp_path, "untrusted-2")))
        assert r.returncode != 0, r.stdout + r.stderr
        assert ": REJECTED: " in r.stderr, r.stderr  # the module's line, in Mender's log
        assert Store(tmp_path / "state").record() is None  # refused before anything was written
        assert mender.artifact() == "factory"
        assert d.client().info()["sha256"] == shipped

        # 2. a model that fails its canary: the install fails and rolls back, in both records
        def wrong_canary(m: opb.Manifest) -> None:
            m.canary.prompt = "def f(x):"
            m.canary.expected_tokens[:] = [3, 3, 3, 3]  # not what the new model says

        failing = _resigned(bundle(models, tmp_path, version=3), tmp_path, wrong_canary)
        r = mender("install", str(_artifact(failing, tmp_path, "failing-3")))
        assert r.returncode != 0, r.stdout + r.stderr
        assert ": ROLLED_BACK: " in r.stderr and "canary" in r.stderr, r.stderr
        rec = _record(tmp_path)
        assert rec.state == R.ROLLED_BACK and "canary" in rec.reason, rec
        assert mender.artifact() == "factory"
        assert d.client().info()["sha256"] == shipped

        # 3. install, then Mender rolls back: the shipped model serves again
        r = mender("install", str(_artifact(bundle(models, tmp_path, version=4), tmp_path, "m-4")))
        assert r.returncode == 0, r.stdout + r.stderr
        rec = _record(tmp_path)
        assert rec.state == R.TRIAL and rec.commit_external and rec.local_payload, rec
        assert d.client().info()["sha256"] != shipped  # the new model serves, awaiting Mender
        r = mender("rollback")
        assert r.returncode == 0, r.stdout + r.stderr
        rec = _record(tmp_path)
        assert rec.state == R.ROLLED_BACK and "installer" in rec.reason, rec
        assert d.client().info()["sha256"] == shipped
        assert mender.artifact() == "factory"

        # 4. install, then Mender commits: the new model is the last known good one
        r = mender("install", str(_artifact(bundle(models, tmp_path, version=5), tmp_path, "m-5")))
        assert r.returncode == 0, r.stdout + r.stderr
        new = d.client().info()["sha256"]
        assert new != shipped
        r = mender("commit")
        assert r.returncode == 0, r.stdout + r.stderr
        assert _record(tmp_path).state == R.COMMITTED
        assert mender.artifact() == "m-5"
        assert d.client().info()["sha256"] == new
        assert d.client().generate(_req()).finish_reason in ("length", "stop")  # it serves
    finally:
        assert d.stop() == 0, d.read_log()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=300
    )


def test_update_install_commit_rollback_and_status_from_the_command_line(
    models: Models,  # noqa: F811
    trusted: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    d = Daemon(tmp_path, models.base, config(trusted, 1.0))
    try:
        sock = ["--admin-socket", str(admin_socket(d.socket))]
        shipped = d.client().info()["sha256"]
        # nothing installed yet: status is NOT_FOUND, one line, exit 2
        r = _cli("update", "status", *sock)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "none was installed" in r.stderr
        # malformed install streams and decisions: INVALID_ARGUMENT, nothing left behind
        _malformed_admin_calls(admin_socket(d.socket), models, tmp_path)
        assert not list((tmp_path / "state").rglob(".incoming-*"))
        # a file that is not a bundle: exit 2, one line, the daemon untouched
        junk = tmp_path / "junk.tar"
        junk.write_bytes(b"not a bundle")
        r = _cli("update", "install", str(junk), *sock)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        # installed with --commit external: it returns once the trial passed, waiting
        r = _cli(
            "update",
            "install",
            str(bundle(models, tmp_path, version=2)),
            "--commit",
            "external",
            *sock,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert ": TRIAL: trial passed; waiting" in r.stdout, r.stdout
        st = json.loads(_cli("update", "status", "--json", *sock).stdout)
        assert st["phase"] == "TRIAL" and d.client().info()["sha256"] != shipped
        r = _cli("update", "rollback", *sock)
        assert r.returncode == 0 and ": ROLLED_BACK: " in r.stdout, r.stdout + r.stderr
        assert d.client().info()["sha256"] == shipped
        # a commit of the update that rolled back: FAILED_PRECONDITION, exit 2
        r = _cli("update", "commit", st["update_id"], *sock)
        assert r.returncode == 2 and "cannot commit" in r.stderr, r.stderr
        # installed with the default (the trial commits): returns once committed
        r = _cli("update", "install", str(bundle(models, tmp_path, version=3)), *sock)
        assert r.returncode == 0 and ": COMMITTED: " in r.stdout, r.stdout + r.stderr
        assert d.client().info()["sha256"] != shipped
        # the same version again: rejected (exit 1, the reason printed)
        r = _cli("update", "install", str(bundle(models, tmp_path, version=3)), *sock)
        assert r.returncode == 1 and ": REJECTED: " in r.stdout, r.stdout + r.stderr
    finally:
        assert d.stop() == 0, d.read_log()
    # no daemon at the socket: exit 2 naming it
    r = _cli("update", "status", *sock)
    assert r.returncode == 2 and "no edge-agent daemon answers" in r.stderr, r.stderr


def _malformed_admin_calls(sock: Path, models: Models, tmp: Path) -> None:  # noqa: F811
    import grpc

    from agent.pb.edge_agent.admin.v1 import admin_pb2 as apb
    from agent.pb.edge_agent.admin.v1 import admin_pb2_grpc

    signed, payload = read_bundle(bundle(models, tmp, version=9))
    too_long = [b"\0" * (payload.size + 1)]
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        stub = admin_pb2_grpc.UpdatesStub(ch)  # type: ignore[no-untyped-call]
        for chunks in (
            [apb.InstallChunk(payload=b"x")],  # no manifest first
            [apb.InstallChunk(signed_manifest=b"\xff\x00junk")],  # not a SignedManifest
            [apb.InstallChunk(signed_manifest=signed.SerializeToString(), payload=too_long[0])],
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.Install(iter(chunks), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        with pytest.raises(grpc.RpcError) as e:
            stub.Decide(apb.DecideRequest(update_id="x"), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
