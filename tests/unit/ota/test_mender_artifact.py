"""`update make --mender` (issue 38 item 4, first part): the Mender Artifact carrying a signed
bundle, read and checked by Debian's real `mender-artifact` (3.9), unsigned and signed with
RSA and ECDSA P-256 keys made by openssl; the bundle inside is the bundle, byte for byte."""

from __future__ import annotations

import gzip
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from agent.ota.artifact import keys
from agent.ota.mender.artifact import PAYLOAD_TYPE, PROVIDES_KEY, ArtifactSpec, write_artifact
from tests.unit.ota.test_bundle import Dirs, _run, dirs  # noqa: F401  (fixture)


def mender_artifact(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["mender-artifact", *args], capture_output=True, text=True, timeout=120, check=False
    )


def _pem(tmp: Path, name: str, key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> Path:
    """The private key as PKCS#8 PEM, and its public half beside it (`<name>.pub`)."""
    priv = tmp / f"{name}.pem"
    priv.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (tmp / f"{name}.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv


def _make(dirs: Dirs, tmp: Path, *extra: str) -> int:  # noqa: F811
    if not (tmp / "a.key").exists():
        keys.generate(tmp / "a.key", tmp / "a.pub")
    argv = ["update", "make", str(dirs.base), str(dirs.new), "--key", str(tmp / "a.key")]
    return _run([*argv, "-o", str(tmp / "b.tar"), "--version", "3", "--json", *extra])


def test_the_artifact_is_read_by_mender_artifact_and_carries_the_bundle(
    dirs: Dirs,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    art = tmp_path / "m.mender"
    rc = _make(dirs, tmp_path, "--mender", str(art), "--mender-device-type", "raspberrypi5")
    assert rc == 0
    made = json.loads(capsys.readouterr().out)["manifest"]
    r = mender_artifact("read", str(art))
    assert r.returncode == 0, r.stderr
    name = f"{made['model_name']}-3"
    assert f"Name: {name}" in r.stdout and "Compatible devices: '[raspberrypi5]'" in r.stdout
    assert f"Type:   {PAYLOAD_TYPE}" in r.stdout and f"{PROVIDES_KEY}: {name}" in r.stdout
    assert f'"update_id": "{made["update_id"]}"' in r.stdout
    assert "Signature: no signature" in r.stdout
    bundle = (tmp_path / "b.tar").read_bytes()
    assert "name:     b.tar" in r.stdout and f"size:     {len(bundle)}" in r.stdout
    v = mender_artifact("validate", str(art))
    assert v.returncode == 0, v.stdout + v.stderr
    # the payload is the bundle, byte for byte
    with tarfile.open(art) as outer:
        data = outer.extractfile("data/0000.tar.gz")
        assert data is not None
        with tarfile.open(fileobj=gzip.GzipFile(fileobj=data)) as inner:
            got = inner.extractfile("b.tar")
            assert got is not None and got.read() == bundle
    # the same bundle and options give the same bytes
    spec = ArtifactSpec(name, ("raspberrypi5",), (("update_id", made["update_id"]),))
    write_artifact(tmp_path / "b.tar", tmp_path / "1.mender", spec)
    write_artifact(tmp_path / "b.tar", tmp_path / "2.mender", spec)
    assert (tmp_path / "1.mender").read_bytes() == (tmp_path / "2.mender").read_bytes()


@pytest.mark.parametrize(
    "make_key",
    [
        lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
        lambda: ec.generate_private_key(ec.SECP256R1()),
    ],
    ids=["rsa", "ecdsa-p256"],
)
def test_a_signed_artifact_verifies_with_its_key_and_not_another(
    make_key,  # type: ignore[no-untyped-def]
    dirs: Dirs,  # noqa: F811
    tmp_path: Path,
) -> None:
    pem = _pem(tmp_path, "mender", make_key())
    _pem(tmp_path, "other", make_key())
    art = tmp_path / "s.mender"
    extra = ("--mender", str(art), "--mender-device-type", "pi4", "--mender-device-type", "pi5")
    assert (
        _make(dirs, tmp_path, *extra, "--mender-key", str(pem), "--mender-artifact-name", "m-7")
        == 0
    )
    r = mender_artifact("read", "-k", str(tmp_path / "mender.pub"), str(art))
    assert r.returncode == 0, r.stderr
    assert "Signature: signed and verified correctly" in r.stdout, r.stdout
    assert "Name: m-7" in r.stdout and "Compatible devices: '[pi4 pi5]'" in r.stdout
    ok = mender_artifact("validate", "-k", str(tmp_path / "mender.pub"), str(art))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = mender_artifact("validate", "-k", str(tmp_path / "other.pub"), str(art))
    assert bad.returncode != 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--mender", "X.mender"), "--mender needs --mender-device-type"),
        (("--mender-device-type", "pi5"), "need --mender"),
        (("--mender", "X.mender", "--mender-device-type", "pi 5"), "device type 'pi 5'"),
        (
            (
                "--mender",
                "X.mender",
                "--mender-device-type",
                "pi5",
                *("--mender-artifact-name", "a b"),
            ),
            "artifact name 'a b'",
        ),
        (("--mender", "X.mender", "--mender-device-type", "pi5", "--mender-key", "KEY"), "KEY"),
    ],
)
def test_bad_mender_options_are_one_line_and_exit_2(
    extra: tuple[str, ...],
    message: str,
    dirs: Dirs,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    small = tmp_path / "KEY"
    small.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=1024).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )  # too short for Mender
    extra = tuple(str(tmp_path / e) if e in ("X.mender", "KEY") else e for e in extra)
    capsys.readouterr()
    assert _make(dirs, tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "X.mender").exists() and not (tmp_path / "b.tar").exists()
