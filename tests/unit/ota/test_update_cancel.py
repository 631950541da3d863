"""Signed cancels (agent/ota/artifact/cancel.py): made and checked with real Ed25519 keys; the
signature
is checked with `cryptography` directly over the documented bytes, not through our verifier."""

from __future__ import annotations

import time

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.ota.artifact.cancel import CANCEL_CONTEXT, check_cancellable, sign_cancel, verify_cancel
from agent.ota.artifact.keys import key_id
from agent.ota.artifact.manifest import UpdateRejected
from agent.ota.artifact.signing import canonical, sign
from agent.ota.updater import CANCELLABLE
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

KEY = Ed25519PrivateKey.generate()
OTHER = Ed25519PrivateKey.generate()
TRUSTED = {key_id(KEY.public_key()): KEY.public_key()}


def code(data: bytes, now: float | None = None) -> str:
    with pytest.raises(UpdateRejected) as info:
        verify_cancel(data, TRUSTED, time.time() if now is None else now)
    return info.value.code


def test_the_signature_is_over_the_context_and_the_canonical_cancel() -> None:
    signed = sign_cancel("u-42", [KEY], reason="bad build", expires_in_s=600, now=1000.0)
    (sig,) = signed.signatures
    assert sig.key_id == key_id(KEY.public_key())
    KEY.public_key().verify(sig.signature, b"edge-agent cancel v1\x00" + signed.cancel)
    with pytest.raises(InvalidSignature):  # not over the bare bytes
        KEY.public_key().verify(sig.signature, signed.cancel)
    c = opb.Cancel.FromString(signed.cancel)
    assert (c.update_id, c.issued_unix, c.expires_unix, c.reason) == (
        "u-42",
        1000.0,
        1600.0,
        "bad build",
    )
    assert signed.cancel == c.SerializeToString(deterministic=True)
    got, kid = verify_cancel(signed.SerializeToString(), TRUSTED, 1001.0)
    assert got == c and kid == sig.key_id


def test_every_refusal_has_its_code() -> None:
    now = time.time()
    good = sign_cancel("u-42", [KEY], now=now)
    assert code(sign_cancel("u-42", [OTHER]).SerializeToString()) == "unknown_key"
    assert code(b"\xff\xff\xff") == "malformed"
    assert code(b"x" * 5000) == "malformed"
    flipped = opb.SignedCancel()
    flipped.CopyFrom(good)
    flipped.signatures[0].signature = (
        bytes([good.signatures[0].signature[0] ^ 1]) + (good.signatures[0].signature[1:])
    )
    assert code(flipped.SerializeToString()) == "bad_signature"
    assert code(good.SerializeToString(), now=now + 3601) == "expired"
    future = sign_cancel("u-42", [KEY], now=now + 2 * 86400)
    assert code(future.SerializeToString(), now=now) == "not_yet_valid"
    # a signed manifest presented as a cancel: its signature is over other bytes
    m = opb.Manifest(format_version=1, update_id="u-42", model_name="demo", version=2)
    sm = sign(m, [KEY])
    assert canonical(m) == sm.manifest
    as_cancel = opb.SignedCancel(cancel=sm.manifest, signatures=sm.signatures)
    assert code(as_cancel.SerializeToString()) == "bad_signature"
    # validly signed bytes that are not canonical, or not a sane cancel
    raw = good.cancel + b"\x2a\x01x"  # an unknown field 5
    odd = opb.SignedCancel(cancel=raw)
    odd.signatures.add(key_id=good.signatures[0].key_id, signature=KEY.sign(CANCEL_CONTEXT + raw))
    assert code(odd.SerializeToString()) == "not_canonical"
    bad_id = opb.Cancel(update_id="../etc", issued_unix=now, expires_unix=now + 60)
    data = bad_id.SerializeToString(deterministic=True)
    bad = opb.SignedCancel(cancel=data)
    bad.signatures.add(key_id=good.signatures[0].key_id, signature=KEY.sign(CANCEL_CONTEXT + data))
    assert code(bad.SerializeToString()) == "inconsistent"
    with pytest.raises(ValueError):
        sign_cancel("../etc", [KEY])


def test_only_the_update_in_progress_before_its_model_loads_can_be_cancelled() -> None:
    R = opb.UpdateRecord
    m = opb.Manifest(format_version=1, update_id="u-42", model_name="demo", version=2)
    cancel = opb.Cancel(update_id="u-42", issued_unix=1.0, expires_unix=2.0)

    def record(state: int, update_id: str = "u-42") -> opb.UpdateRecord:
        other = opb.Manifest(format_version=1, update_id=update_id, model_name="demo", version=2)
        return R(signed=opb.SignedManifest(manifest=canonical(other)), state=state)  # type: ignore[arg-type]

    def refusal(running: opb.UpdateRecord | None, last: opb.UpdateRecord | None) -> str:
        try:
            check_cancellable(cancel, running, last, CANCELLABLE)
        except UpdateRejected as exc:
            return exc.code
        return ""

    assert canonical(m) == record(R.RECEIVED).signed.manifest
    for state in (R.RECEIVED, R.DOWNLOADING, R.VERIFIED, R.STAGED):
        assert refusal(record(state), record(state)) == ""
    for state in (R.ACTIVATING, R.TRIAL):
        assert refusal(record(state), record(state)) == "too_late"
    assert refusal(record(R.DOWNLOADING, "u-7"), record(R.DOWNLOADING, "u-7")) == "not_in_progress"
    assert refusal(None, record(R.REJECTED)) == "not_in_progress"  # a replay after the cancel
    assert refusal(None, None) == "not_in_progress"
