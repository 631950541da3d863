"""Update bundles from the demo model: make, read, inspect, verify, apply; and the operator CLI
(`keys generate`, `update make`, `update inspect`)."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from ai_edge_litert import schema_py_generated as schema
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.cli.common import parse_duration
from agent.cli.update import add_keys_parser, add_update_parser
from agent.model.directory import (
    ModelMeta,
    demo_model_dir,
    load_model_dir,
    sha256_file,
    write_model_dir_metadata,
)
from agent.ota.artifact import keys
from agent.ota.artifact.bundle import (
    MANIFEST_MEMBER,
    PAYLOAD_MEMBER,
    BundleError,
    make_bundle,
    read_bundle,
)
from agent.ota.artifact.manifest import DELTA_FORMAT, InstallContext, check
from agent.ota.artifact.signing import verify
from agent.ota.delta import files as delta
from agent.ota.inspection import describe, inspect

FILES = ("model_int8.tflite", "tokenizer.model")


def _write_meta(d: Path, demo: ModelMeta, version: str, name: str | None = None) -> None:
    write_model_dir_metadata(
        d,
        name=name or demo.name,
        version=version,
        context_length=demo.context_length,
        bos_id=demo.bos_id,
        eos_id=demo.eos_id,
        stop_token_ids=demo.stop_token_ids,
        chat_template=demo.chat_template,
        variants=[("model_int8.tflite", "int8")],
    )


def _largest_buffer(data: bytes) -> tuple[int, int]:
    """(offset, length) of the largest tensor buffer of a .tflite."""
    model = schema.Model.GetRootAs(data, 0)
    best = (0, 0)
    for i in range(model.BuffersLength()):
        b = model.Buffers(i)
        vec = b._tab.Offset(4)
        if vec and b._tab.VectorLen(vec):
            span = (b._tab.Vector(vec), b._tab.VectorLen(vec))
        elif b.Size() > 0:
            span = (b.Offset(), b.Size())
        else:
            continue
        best = max(best, span, key=lambda s: s[1])
    assert best[1] > 0
    return best


@dataclass(frozen=True)
class Dirs:
    base: Path
    new: Path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Dirs:
    """The demo model's int8 variant (base, "1.0.0") and a copy with 4 KiB of one tensor
    buffer changed (new, "1.0.1")."""
    root = tmp_path_factory.mktemp("models")
    demo = load_model_dir(demo_model_dir())
    base, new = root / "base", root / "new"
    for d in (base, new):
        d.mkdir()
        for f in FILES:
            shutil.copy(demo_model_dir() / f, d / f)
    _write_meta(base, demo, "1.0.0")
    data = bytearray((new / "model_int8.tflite").read_bytes())
    start, length = _largest_buffer(bytes(data))
    for i in range(start + length // 2, start + length // 2 + 4096):
        data[i] ^= 0x11
    (new / "model_int8.tflite").write_bytes(bytes(data))
    _write_meta(new, demo, "1.0.1")
    return Dirs(base, new)


OLD = Ed25519PrivateKey.generate()
NEW = Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def trusted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    (d / "old.pub").write_text(keys.public_line(OLD.public_key(), "old"))
    (d / "new.pub").write_text(keys.public_line(NEW.public_key(), "new"))
    return d


@pytest.fixture(scope="module")
def bundle(dirs: Dirs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "update.tar"
    make_bundle(
        dirs.base,
        dirs.new,
        [OLD, NEW],
        out,
        version=2,
        update_id="u-demo-2",
        expires_in_s=3600,
        payload_url="https://updates.example/u-demo-2.bin",
        compatible_profiles=["raspberry-pi-5"],
        compatible_arch=["aarch64"],
        min_agent_version="0.1.0",
    )
    return out


def test_delta_format_names_agree() -> None:
    assert delta.FORMAT == DELTA_FORMAT


def test_bundle_is_a_tar_of_manifest_then_payload(bundle: Path) -> None:
    with tarfile.open(bundle, "r:") as tar:
        assert tar.getnames() == [MANIFEST_MEMBER, PAYLOAD_MEMBER]
    signed, payload = read_bundle(bundle)
    m = verify(signed, _both())
    assert payload.size == m.payload_size
    assert payload.sha256() == m.payload_sha256
    assert payload.size < 100_000  # 4 KiB of one tensor changed, not the 6 MiB file


def _both() -> dict[str, Ed25519PublicKey]:
    return {keys.key_id(k.public_key()): k.public_key() for k in (OLD, NEW)}


def test_manifest_describes_the_new_directory(bundle: Path, dirs: Dirs, trusted_dir: Path) -> None:
    signed, _ = read_bundle(bundle)
    assert [s.key_id for s in signed.signatures] == [
        keys.key_id(OLD.public_key()),
        keys.key_id(NEW.public_key()),
    ]
    m = verify(signed, keys.load_trusted(trusted_dir))
    base_meta, new_meta = load_model_dir(dirs.base), load_model_dir(dirs.new)
    assert (m.model_name, m.version, m.version_label) == (new_meta.name, 2, "1.0.1")
    assert m.update_id == "u-demo-2"
    assert m.base_model_sha256 == base_meta.variant("int8").sha256
    assert m.target_model_sha256 == new_meta.variant("int8").sha256
    assert m.quantization == "int8"
    assert m.payload_format == DELTA_FORMAT
    assert m.metadata_json == (dirs.new / "metadata.json").read_text()
    assert m.expires_unix - m.issued_unix == pytest.approx(3600)
    files = {f.name: f for f in m.files}
    assert sorted(files) == sorted(p.name for p in dirs.new.iterdir())
    for name, f in files.items():
        assert (f.sha256, f.size) == (
            sha256_file(dirs.new / name),
            (dirs.new / name).stat().st_size,
        )
        assert f.base_sha256 == sha256_file(dirs.base / name)
        assert f.base_size == (dirs.base / name).stat().st_size
    assert files["tokenizer.model"].sha256 == files["tokenizer.model"].base_sha256

    ctx = InstallContext(
        model_name=base_meta.name,
        installed_version=0,
        installed_sha256=base_meta.variant("int8").sha256,
        profile="raspberry-pi-5",
        arch="aarch64",
        agent_version="0.1.0",
    )
    check(m, ctx, m.issued_unix + 60)


def test_payload_applies_to_the_base_and_rebuilds_the_manifests_files(
    bundle: Path, dirs: Dirs, tmp_path: Path
) -> None:
    signed, payload = read_bundle(bundle)
    m = verify(signed, _both())
    rebuilt = delta.patch_dirs(
        dirs.base, payload.extract(tmp_path / "payload.bin"), tmp_path / "out"
    )
    assert sorted(rebuilt) == sorted((f.name, f.sha256, f.size) for f in m.files)
    for f in m.files:
        assert sha256_file(tmp_path / "out" / f.name) == f.sha256
    assert load_model_dir(tmp_path / "out").version == "1.0.1"


def test_inspect(bundle: Path, trusted_dir: Path, tmp_path: Path) -> None:
    doc = inspect(bundle, keys.load_trusted(trusted_dir))
    assert doc["verified"] is True and doc["rejected"] is None
    assert [(s["trusted"], s["valid"]) for s in doc["signatures"]] == [(True, True)] * 2
    assert doc["payload"]["size_ok"] and doc["payload"]["sha256_ok"]
    assert doc["manifest"]["files"][0]["name"] == "metadata.json"
    json.dumps(doc)  # JSON-ready
    assert "verified    yes" in describe(doc)

    plain = inspect(bundle)
    assert plain["verified"] is None
    assert [s["trusted"] for s in plain["signatures"]] == [None, None]

    only_new = tmp_path / "keys"
    only_new.mkdir()
    (only_new / "other.pub").write_text(keys.public_line(Ed25519PrivateKey.generate().public_key()))
    doc = inspect(bundle, keys.load_trusted(only_new))
    assert doc["verified"] is False and doc["rejected"]["code"] == "unknown_key"
    assert [s["trusted"] for s in doc["signatures"]] == [False, False]


def test_inspect_sees_a_damaged_payload(bundle: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.tar"
    shutil.copy(bundle, damaged)
    _, payload = read_bundle(damaged)
    with open(damaged, "r+b") as f:
        f.seek(payload.offset + payload.size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    doc = inspect(damaged, _both())
    assert doc["verified"] is True  # the manifest is intact
    assert doc["payload"]["size_ok"] and not doc["payload"]["sha256_ok"]


def test_a_bundle_directory_reads_like_the_tar(bundle: Path, tmp_path: Path) -> None:
    signed, payload = read_bundle(bundle)
    (tmp_path / MANIFEST_MEMBER).write_bytes(signed.SerializeToString())
    payload.extract(tmp_path / PAYLOAD_MEMBER)
    signed2, payload2 = read_bundle(tmp_path)
    assert signed2 == signed
    assert payload2.sha256() == payload.sha256()


def test_read_bundle_refuses_other_tars(tmp_path: Path) -> None:
    (tmp_path / "payload.bin").write_bytes(b"x")
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        tar.add(tmp_path / "payload.bin", arcname=PAYLOAD_MEMBER)
    with pytest.raises(BundleError, match=r"manifest\.pb then payload\.bin"):
        read_bundle(tmp_path / "bad.tar")
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(BundleError, match=r"junk\.tar"):
        read_bundle(tmp_path / "junk.tar")


def test_make_bundle_refuses_another_model_and_lying_metadata(dirs: Dirs, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(dirs.new, other)
    _write_meta(other, load_model_dir(dirs.new), "2.0.0", name="someone-else")
    with pytest.raises(BundleError, match="keeps the model name"):
        make_bundle(dirs.base, other, [OLD], tmp_path / "x.tar", version=2)
    lying = tmp_path / "lying"
    shutil.copytree(dirs.new, lying)
    with open(lying / "model_int8.tflite", "ab") as f:
        f.write(b"!")
    with pytest.raises(BundleError, match=r"model_int8\.tflite.*do not match"):
        make_bundle(dirs.base, lying, [OLD], tmp_path / "x.tar", version=2)
    assert not (tmp_path / "x.tar").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------- CLI


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edge-agent")
    parser.add_argument("--profile")
    sub = parser.add_subparsers(dest="command", required=True)
    add_keys_parser(sub)
    add_update_parser(sub)
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_cli_keys_generate_refuses_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "signing"
    assert _run(["keys", "generate", "--out-dir", str(out), "--name", "ops"]) == 0
    kid = capsys.readouterr().out.strip()
    assert keys.key_id(keys.load_private(out / "ops.key").public_key()) == kid
    assert list(keys.load_trusted(out)) == [kid]
    before = (out / "ops.key").read_bytes()
    assert _run(["keys", "generate", "--out-dir", str(out), "--name", "ops"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and "ops.key" in err
    assert (out / "ops.key").read_bytes() == before
    assert _run(["keys", "generate", "--out-dir", str(out), "--name", "../x"]) == 2


def test_cli_update_make_and_inspect(
    dirs: Dirs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("old", "new"):
        assert _run(["keys", "generate", "--out-dir", str(tmp_path / "k"), "--name", name]) == 0
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(tmp_path / "k" / "new.pub", trusted)
    capsys.readouterr()
    out = tmp_path / "b.tar"
    argv = [
        "update", "make", str(dirs.base), str(dirs.new),
        "--key", str(tmp_path / "k" / "old.key"), "--key", str(tmp_path / "k" / "new.key"),
        "-o", str(out), "--version", "7", "--expires-in", "12h",
        "--compatible-profile", "raspberry-pi-5", "--compatible-profile", "raspberry-pi-4",
        "--arch", "aarch64",
        "--min-agent-version", "0.1.0", "--url", "https://updates.example/b.bin", "--json",
    ]  # fmt: skip
    assert _run(argv) == 0
    made = json.loads(capsys.readouterr().out)
    m = made["manifest"]
    assert (m["version"], m["version_label"]) == (7, "1.0.1")
    assert m["compatible_profiles"] == ["raspberry-pi-5", "raspberry-pi-4"]
    assert m["compatible_arch"] == ["aarch64"]
    assert m["expires_unix"] - m["issued_unix"] == pytest.approx(12 * 3600)
    assert len(made["signatures"]) == 2

    assert _run(["update", "inspect", str(out), "--trusted-keys", str(trusted), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is True
    assert [s["trusted"] for s in doc["signatures"]] == [False, True]  # rotated to the new key
    assert doc["manifest"] == m

    assert _run(["update", "inspect", str(out)]) == 0
    assert "raspberry-pi-5, raspberry-pi-4" in capsys.readouterr().out
    assert _run(["update", "inspect", str(out), "--trusted-keys", str(tmp_path / "none")]) == 1
    assert "verified    NO" in capsys.readouterr().out


@pytest.fixture(scope="module")
def expired_bundle(dirs: Dirs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Signed by a trusted key two hours ago, valid for one: expired an hour ago."""
    out = tmp_path_factory.mktemp("expired") / "old.tar"
    issued = time.time() - 7200
    make_bundle(dirs.base, dirs.new, [OLD], out, version=2, expires_in_s=3600, now=issued)
    return out


def test_cli_inspect_says_an_expired_bundle_is_expired(
    expired_bundle: Path, trusted_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    signed, _ = read_bundle(expired_bundle)
    m = verify(signed, keys.load_trusted(trusted_dir))  # the signature itself is good
    assert m.expires_unix < time.time() - 3000  # and the manifest expired: the reference

    assert _run(["update", "inspect", str(expired_bundle), "--trusted-keys", str(trusted_dir)]) == 3
    text = capsys.readouterr().out
    assert "verified    yes" not in text
    (line,) = [x for x in text.split("\n") if x.startswith("verified")]
    assert "EXPIRED" in line and "signature valid" in line
    (line,) = [x for x in text.split("\n") if x.startswith("expires")]
    assert "EXPIRED" in line

    argv = ["update", "inspect", str(expired_bundle), "--trusted-keys", str(trusted_dir), "--json"]
    assert _run(argv) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is True and doc["expired"] is True
    assert doc["expires_in_s"] == pytest.approx(m.expires_unix - time.time(), abs=60)
    # without keys the expiry is still known, and still not a success
    assert _run(["update", "inspect", str(expired_bundle)]) == 3
    assert "EXPIRED" in capsys.readouterr().out


def test_cli_inspect_a_fresh_bundle_is_not_expired(
    bundle: Path, trusted_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(["update", "inspect", str(bundle), "--trusted-keys", str(trusted_dir)]) == 0
    text = capsys.readouterr().out
    assert "verified    yes" in text and "EXPIRED" not in text
    assert _run(["update", "inspect", str(bundle), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expired"] is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--expires-in", "soon"], "--expires-in"),
        (["--version", "0"], "versions start at 1"),
        (["--key", "/nonexistent.key"], "nonexistent.key"),
        (["--canary-tokens", "3"], "--canary-prompt"),
    ],
)
def test_cli_update_make_errors_are_one_line(
    extra: list[str],
    message: str,
    dirs: Dirs,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    keys.generate(tmp_path / "a.key", tmp_path / "a.pub")
    argv = ["update", "make", str(dirs.base), str(dirs.new), "--key", str(tmp_path / "a.key")]
    argv += ["-o", str(tmp_path / "b.tar"), "--version", "2", *extra]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "b.tar").exists()


def test_cli_update_make_with_a_canary(
    dirs: Dirs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.daemon.canary import engine_model
    from agent.engine.engine import Engine
    from agent.ota import canary
    from agent.profile import resolve_profile

    profile = "generic-aarch64" if platform.machine() == "aarch64" else "generic-x86_64"
    keys.generate(tmp_path / "a.key", tmp_path / "a.pub")
    argv = ["update", "make", str(dirs.base), str(dirs.new), "--key", str(tmp_path / "a.key")]
    argv += ["-o", str(tmp_path / "b.tar"), "--version", "2", "--json"]
    argv += ["--canary-prompt", "def main():", "--canary-tokens", "3", "--canary-profile", profile]
    assert _run(argv) == 0
    c = json.loads(capsys.readouterr().out)["manifest"]["canary"]
    assert c["prompt"] == "def main():" and len(c["expected_tokens"]) == 3

    signed, _ = read_bundle(tmp_path / "b.tar")
    m = verify(signed, keys.load_trusted(tmp_path))
    engine = Engine.load(resolve_profile(profile)[0], dirs.new)
    try:
        assert canary.check(engine_model(engine), m.canary) is None  # the device's check passes
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("45s", 45), ("15m", 900), ("12h", 43200), ("7d", 604800)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_update_make_profile_flag_was_renamed(dirs: Dirs, tmp_path: Path) -> None:
    """`--profile` means "run with this profile" everywhere else: on `update make` it is
    refused with the new name, never taken as the devices allowed to install."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "agent", "update", "make", str(dirs.base), str(dirs.new),
         "--key", str(tmp_path / "none.key"), "-o", str(tmp_path / "b.tar"), "--version", "2",
         "--profile", "raspberry-pi-5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--compatible-profile" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "b.tar").exists()
