"""Update keys and manifests: key files, canonical bytes, signatures (with key rotation), and
every reason `check` refuses an update for."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.ota.artifact import keys
from agent.ota.artifact.manifest import (
    CLOCK_SKEW_S,
    CODES,
    InstallContext,
    UpdateRejected,
    check,
    version_tuple,
)
from agent.ota.artifact.signing import canonical, sign, verify
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

NOW = 1_750_000_000.0
OLD_KEY = Ed25519PrivateKey.generate()
NEW_KEY = Ed25519PrivateKey.generate()
STRANGER = Ed25519PrivateKey.generate()
BOTH = {keys.key_id(k.public_key()): k.public_key() for k in (OLD_KEY, NEW_KEY)}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


BASE_SHA = _sha("base int8")
TARGET_SHA = _sha("new int8")
TOKENIZER_SHA = _sha("tokenizer")


def _metadata(name: str = "demo") -> str:
    return json.dumps(
        {
            "format": 1,
            "name": name,
            "version": "1.1.0",
            "variants": [
                {
                    "file": "model_int8.tflite",
                    "quantization": "int8",
                    "sha256": TARGET_SHA,
                    "size": 1000,
                },
            ],
        }
    )


def make_manifest(**over: object) -> opb.Manifest:
    """A manifest that `check` accepts under `CTX` at `NOW`, with fields overridden."""
    meta = _metadata()
    m = opb.Manifest(
        format_version=1,
        update_id="u-0001",
        model_name="demo",
        version=4,
        version_label="1.1.0",
        files=[
            opb.FileTarget(
                name="metadata.json",
                sha256=_sha(meta),
                size=len(meta),
                base_sha256=_sha("old meta"),
                base_size=800,
            ),
            opb.FileTarget(
                name="model_int8.tflite",
                sha256=TARGET_SHA,
                size=1000,
                base_sha256=BASE_SHA,
                base_size=1000,
            ),
            opb.FileTarget(
                name="tokenizer.model",
                sha256=TOKENIZER_SHA,
                size=50,
                base_sha256=TOKENIZER_SHA,
                base_size=50,
            ),
        ],
        base_model_sha256=BASE_SHA,
        target_model_sha256=TARGET_SHA,
        quantization="int8",
        payload_sha256=_sha("payload"),
        payload_size=300,
        payload_format="ea-delta-1",
        issued_unix=NOW - 60,
        expires_unix=NOW + 7 * 86400,
        compatible_profiles=["rpi5-8gb", "generic-x86_64"],
        compatible_arch=["aarch64", "x86_64"],
        min_agent_version="0.9.1",
        metadata_json=meta,
    )
    for key, value in over.items():
        if isinstance(value, list):
            m.ClearField(key)
            getattr(m, key).extend(value)
        else:
            setattr(m, key, value)
    return m


CTX = InstallContext(
    model_name="demo",
    installed_version=3,
    installed_sha256=BASE_SHA,
    profile="rpi5-8gb",
    arch="aarch64",
    agent_version="0.10.0",
    finished_update_ids=frozenset({"u-0000"}),
    max_payload_bytes=1 << 20,
)


def _rejected(fn: Callable[[], object]) -> UpdateRejected:
    with pytest.raises(UpdateRejected) as info:
        fn()
    assert info.value.code in CODES
    return info.value


# ----------------------------------------------------------------------------- keys


def test_generate_writes_a_private_0600_and_a_one_line_public_key(tmp_path: Path) -> None:
    kid = keys.generate(tmp_path / "a.key", tmp_path / "a.pub", comment="ops laptop")
    assert len(kid) == 16 and int(kid, 16) >= 0
    assert stat.S_IMODE((tmp_path / "a.key").stat().st_mode) == 0o600
    assert (tmp_path / "a.key").read_text().startswith("-----BEGIN PRIVATE KEY-----")
    kind, b64, comment = (tmp_path / "a.pub").read_text().rstrip("\n").split(" ", 2)
    assert (kind, comment) == ("ed25519", "ops laptop")
    assert len(base64.b64decode(b64)) == 32
    private = keys.load_private(tmp_path / "a.key")
    assert keys.key_id(private.public_key()) == kid
    assert keys.load_trusted(tmp_path) == {kid: keys.load_public(tmp_path / "a.pub")}
    assert keys.key_id(keys.load_public(tmp_path / "a.pub")) == kid


def test_generate_refuses_to_overwrite(tmp_path: Path) -> None:
    keys.generate(tmp_path / "a.key", tmp_path / "a.pub")
    before = (tmp_path / "a.key").read_bytes()
    with pytest.raises(keys.KeyFileError, match="already exists"):
        keys.generate(tmp_path / "a.key", tmp_path / "b.pub")
    with pytest.raises(keys.KeyFileError, match="already exists"):
        keys.generate(tmp_path / "b.key", tmp_path / "a.pub")
    assert (tmp_path / "a.key").read_bytes() == before
    assert not (tmp_path / "b.key").exists() and not (tmp_path / "b.pub").exists()


def test_load_trusted_reads_every_pub_and_names_a_malformed_one(tmp_path: Path) -> None:
    for k, name in ((OLD_KEY, "old"), (NEW_KEY, "new")):
        (tmp_path / f"{name}.pub").write_text(keys.public_line(k.public_key(), name))
    (tmp_path / "notes.txt").write_text("not a key")
    assert set(keys.load_trusted(tmp_path)) == set(BOTH)
    (tmp_path / "broken.pub").write_text("ed25519 AAAA too-short\n")
    with pytest.raises(keys.KeyFileError, match=r"broken\.pub.*32 bytes"):
        keys.load_trusted(tmp_path)
    (tmp_path / "broken.pub").write_text("ssh-rsa AAAA x\n")
    with pytest.raises(keys.KeyFileError, match=r"broken\.pub"):
        keys.load_trusted(tmp_path)


def test_no_trusted_keys_rejects_every_update(tmp_path: Path) -> None:
    assert keys.load_trusted(tmp_path / "missing") == {}
    assert keys.load_trusted(tmp_path) == {}
    signed = sign(make_manifest(), [OLD_KEY])
    err = _rejected(lambda: verify(signed, keys.load_trusted(tmp_path)))
    assert err.code == "unknown_key"
    assert "no trusted keys are configured" in err.message


def test_load_private_rejects_a_public_key_file(tmp_path: Path) -> None:
    (tmp_path / "x.pub").write_text(keys.public_line(OLD_KEY.public_key()))
    with pytest.raises(keys.KeyFileError, match=r"x\.pub"):
        keys.load_private(tmp_path / "x.pub")


# ----------------------------------------------------------------------------- signing


def test_canonical_is_deterministic_and_signed_bytes_are_canonical() -> None:
    m = make_manifest()
    assert canonical(m) == canonical(opb.Manifest.FromString(canonical(m)))
    signed = sign(m, [OLD_KEY])
    assert signed.manifest == canonical(m)
    assert verify(signed, BOTH) == m
    assert verify(signed.SerializeToString(), BOTH) == m


@pytest.mark.parametrize(
    ("signers", "trusted", "ok"),
    [
        ([OLD_KEY], [OLD_KEY], True),
        ([OLD_KEY], [OLD_KEY, NEW_KEY], True),  # rotation: both trusted, old signs
        ([NEW_KEY], [OLD_KEY, NEW_KEY], True),  # rotation: both trusted, new signs
        ([OLD_KEY, NEW_KEY], [OLD_KEY], True),  # co-signed during rotation: old devices
        ([OLD_KEY, NEW_KEY], [NEW_KEY], True),  # co-signed: devices already rotated
        ([NEW_KEY], [OLD_KEY], False),  # not yet rotated
        ([OLD_KEY], [NEW_KEY], False),  # old key retired
    ],
)
def test_rotation(
    signers: list[Ed25519PrivateKey], trusted: list[Ed25519PrivateKey], ok: bool
) -> None:
    signed = sign(make_manifest(), signers)
    assert [s.key_id for s in signed.signatures] == [keys.key_id(k.public_key()) for k in signers]
    pinned = {keys.key_id(k.public_key()): k.public_key() for k in trusted}
    if ok:
        assert verify(signed, pinned).update_id == "u-0001"
    else:
        err = _rejected(lambda: verify(signed, pinned))
        assert err.code == "unknown_key"
        assert signed.signatures[0].key_id in err.message


def test_one_valid_trusted_signature_is_enough() -> None:
    signed = sign(make_manifest(), [OLD_KEY, NEW_KEY])
    signed.signatures[0].signature = bytes(64)
    assert verify(signed, BOTH).version == 4


def test_bad_signature_by_a_trusted_key() -> None:
    signed = sign(make_manifest(), [OLD_KEY])
    sig = bytearray(signed.signatures[0].signature)
    sig[5] ^= 1
    signed.signatures[0].signature = bytes(sig)
    err = _rejected(lambda: verify(signed, BOTH))
    assert err.code == "bad_signature"
    assert signed.signatures[0].key_id in err.message


def test_a_trusted_key_id_on_a_strangers_signature_is_a_bad_signature() -> None:
    signed = sign(make_manifest(), [STRANGER])
    signed.signatures[0].key_id = keys.key_id(OLD_KEY.public_key())
    assert _rejected(lambda: verify(signed, BOTH)).code == "bad_signature"


def test_unknown_key() -> None:
    signed = sign(make_manifest(), [STRANGER])
    err = _rejected(lambda: verify(signed, BOTH))
    assert err.code == "unknown_key"
    assert keys.key_id(STRANGER.public_key()) in err.message


def test_tampered_manifest_bytes() -> None:
    signed = sign(make_manifest(), [OLD_KEY])
    tampered = opb.Manifest.FromString(signed.manifest)
    tampered.version = 99
    signed.manifest = canonical(tampered)
    assert _rejected(lambda: verify(signed, BOTH)).code == "bad_signature"


def _signed_raw(data: bytes) -> opb.SignedManifest:
    """Signed by a trusted key, whatever the bytes are (what a careless signer could do)."""
    return opb.SignedManifest(
        manifest=data,
        signatures=[
            opb.Signature(key_id=keys.key_id(OLD_KEY.public_key()), signature=OLD_KEY.sign(data))
        ],
    )


def test_non_canonical_bytes_are_rejected_even_when_validly_signed() -> None:
    data = canonical(make_manifest())
    unknown_field = b"\xa8\x06\x01"  # field 101, varint 1
    assert _rejected(lambda: verify(_signed_raw(data + unknown_field), BOTH)).code == (
        "not_canonical"
    )
    repeated_scalar = canonical(opb.Manifest(version=4)) + data  # version twice: last wins
    err = _rejected(lambda: verify(_signed_raw(repeated_scalar), BOTH))
    assert (err.code, err.message) == ("not_canonical", "manifest bytes are not canonical")


def test_malformed() -> None:
    assert _rejected(lambda: verify(_signed_raw(b"\xff\xff\xff"), BOTH)).code == "malformed"
    assert _rejected(lambda: verify(b"\x0a\xff\x01", BOTH)).code == "malformed"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_single_byte_change_of_the_signed_bytes_is_rejected(data: st.DataObject) -> None:
    signed = sign(make_manifest(), [OLD_KEY])
    raw = bytearray(signed.manifest)
    i = data.draw(st.integers(0, len(raw) - 1), label="index")
    raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    signed.manifest = bytes(raw)
    with pytest.raises(UpdateRejected):
        verify(signed, BOTH)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_single_byte_change_of_the_whole_signed_manifest_is_rejected(
    data: st.DataObject,
) -> None:
    raw = bytearray(sign(make_manifest(), [OLD_KEY]).SerializeToString())
    i = data.draw(st.integers(0, len(raw) - 1), label="index")
    raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(UpdateRejected):
        verify(bytes(raw), BOTH)


# ----------------------------------------------------------------------------- checks


def test_a_good_manifest_passes() -> None:
    check(verify(sign(make_manifest(), [OLD_KEY]), BOTH), CTX, NOW)


def test_a_full_payload_needs_no_base() -> None:
    check(make_manifest(payload_format="full-1", base_model_sha256=""), CTX, NOW)
    check(
        make_manifest(payload_format="full-1", base_model_sha256=""),
        dataclasses.replace(CTX, installed_sha256=""),
        NOW,
    )


def test_empty_compatibility_lists_mean_any() -> None:
    m = make_manifest(compatible_profiles=[], compatible_arch=[], min_agent_version="")
    check(m, dataclasses.replace(CTX, profile="anything", arch="riscv64"), NOW)


def test_clock_skew_allowance() -> None:
    check(make_manifest(issued_unix=NOW + CLOCK_SKEW_S - 1), CTX, NOW)


def _bad_metadata() -> str:
    return _metadata("someone-else")


CASES: list[tuple[str, dict[str, object], dict[str, object], str]] = [
    # (case id, manifest overrides, context overrides, code)
    ("model name differs", {}, {"model_name": "other"}, "wrong_model"),
    ("same version (rollback)", {"version": 3}, {}, "rollback"),
    ("older version (rollback)", {"version": 2}, {}, "rollback"),
    ("expired (freeze)", {"issued_unix": NOW - 100, "expires_unix": NOW - 1}, {}, "expired"),
    ("expires right now", {"issued_unix": NOW - 100, "expires_unix": NOW}, {}, "expired"),
    (
        "issued in the future",
        {"issued_unix": NOW + CLOCK_SKEW_S + 60, "expires_unix": NOW + 9 * 86400},
        {},
        "not_yet_valid",
    ),
    ("base is not the installed model", {}, {"installed_sha256": _sha("other")}, "base_mismatch"),
    ("nothing installed, delta", {}, {"installed_sha256": ""}, "base_mismatch"),
    ("incompatible profile", {}, {"profile": "rpi4-4gb"}, "incompatible"),
    ("incompatible arch", {}, {"arch": "armv7l"}, "incompatible"),
    ("agent too old", {"min_agent_version": "0.10.1"}, {}, "agent_too_old"),
    (
        "agent too old (numeric)",
        {"min_agent_version": "1.0"},
        {"agent_version": "0.99.0"},
        "agent_too_old",
    ),
    ("replay after success", {"update_id": "u-0000"}, {}, "replay"),
    ("format version", {"format_version": 2}, {}, "unsupported_format"),
    ("no format version", {"format_version": 0}, {}, "unsupported_format"),
    ("payload format", {"payload_format": "bsdiff4"}, {}, "unknown_payload_format"),
    ("payload size 0", {"payload_size": 0}, {}, "bad_payload_size"),
    ("payload too large", {"payload_size": (1 << 20) + 1}, {}, "bad_payload_size"),
    ("target not among files", {"target_model_sha256": _sha("x")}, {}, "inconsistent"),
    ("no files", {"files": []}, {}, "inconsistent"),
    (
        "path in file name",
        {"files": [opb.FileTarget(name="../model_int8.tflite", sha256=TARGET_SHA, size=1)]},
        {},
        "inconsistent",
    ),
    (
        "file listed twice",
        {
            "files": [
                opb.FileTarget(name="a", sha256=TARGET_SHA, size=1),
                opb.FileTarget(name="a", sha256=TARGET_SHA, size=1),
            ]
        },
        {},
        "inconsistent",
    ),
    ("update id is a path", {"update_id": "../../etc/passwd"}, {}, "inconsistent"),
    ("empty update id", {"update_id": ""}, {}, "inconsistent"),
    ("version 0", {"version": 0}, {"installed_version": 0}, "inconsistent"),
    ("delta without base", {"base_model_sha256": ""}, {}, "inconsistent"),
    ("full payload with base", {"payload_format": "full-1"}, {}, "inconsistent"),
    ("payload sha256 not hex", {"payload_sha256": "abc"}, {}, "inconsistent"),
    ("url scheme", {"payload_url": "file:///etc/shadow"}, {}, "inconsistent"),
    (
        "expires before issued",
        {"issued_unix": NOW + 10, "expires_unix": NOW + 5},
        {},
        "inconsistent",
    ),
    ("min agent version not a version", {"min_agent_version": "latest"}, {}, "inconsistent"),
    ("metadata of another model", {"metadata_json": _bad_metadata()}, {}, "inconsistent"),
    ("metadata quantization", {"quantization": "int4_block32"}, {}, "inconsistent"),
]


@pytest.mark.parametrize(
    ("over", "ctx_over", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_check_rejects(over: dict[str, object], ctx_over: dict[str, object], code: str) -> None:
    m = make_manifest(**over)
    ctx = dataclasses.replace(CTX, **ctx_over)  # type: ignore[arg-type]
    err = _rejected(lambda: check(m, ctx, NOW))
    assert err.code == code, err.message
    assert err.message and code in str(err)


def test_every_code_is_tested() -> None:
    tested = {c[3] for c in CASES} | {
        "malformed",
        "unknown_key",
        "bad_signature",
        "not_canonical",
    }
    assert tested == set(CODES)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("0.10.0", (0, 10)),
        ("0.9.1", (0, 9, 1)),
        ("1.0", (1,)),
        ("1.2.0rc1", (1, 2)),
        ("v1", None),
        ("", None),
    ],
)
def test_version_tuple(text: str, parsed: tuple[int, ...] | None) -> None:
    assert version_tuple(text) == parsed
    assert version_tuple("0.10.0") > version_tuple("0.9.1")  # type: ignore[operator]
