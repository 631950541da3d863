"""Signed cancels: the operator's order to stop an update in progress (docs/UPDATES.md).

A cancel is an authority, not a request anyone may send: it is an Ed25519 signature by a key
the device trusts (the same pinned keys as manifests) over `CANCEL_CONTEXT` followed by the
canonical bytes of a `Cancel` (update id, issued and expiry times, a reason). The context
prefix keeps a manifest's signature from ever verifying as a cancel's (a canonical manifest
starts with its `format_version` field, byte 0x08). Replays are bounded by the expiry, and a
cancelled update id is finished on the device: a replayed cancel finds nothing to stop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError

from agent.ota.artifact.keys import key_id
from agent.ota.artifact.manifest import CLOCK_SKEW_S, UPDATE_ID_RE, UpdateRejected
from agent.ota.artifact.signing import authenticate
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

CANCEL_CONTEXT = b"edge-agent cancel v1\x00"
DEFAULT_EXPIRES_S = 3600.0
MAX_CANCEL_BYTES = 4096


def canonical(cancel: opb.Cancel) -> bytes:
    """The deterministic serialization of `cancel`."""
    data: bytes = cancel.SerializeToString(deterministic=True)
    return data


def sign_cancel(
    update_id: str,
    private_keys: Iterable[Ed25519PrivateKey],
    *,
    reason: str = "",
    expires_in_s: float = DEFAULT_EXPIRES_S,
    now: float | None = None,
) -> opb.SignedCancel:
    """A cancel of `update_id`, signed with every key (one signature per distinct key)."""
    if not UPDATE_ID_RE.fullmatch(update_id):
        raise ValueError(f"update id {update_id!r}: 1-128 of [A-Za-z0-9._-], alphanumeric first")
    if expires_in_s <= 0:
        raise ValueError(f"a cancel must expire in the future, not in {expires_in_s} s")
    issued = time.time() if now is None else now
    data = canonical(
        opb.Cancel(
            update_id=update_id,
            issued_unix=issued,
            expires_unix=issued + expires_in_s,
            reason=reason,
        )
    )
    signed = opb.SignedCancel(cancel=data)
    seen: set[str] = set()
    for key in private_keys:
        kid = key_id(key.public_key())
        if kid not in seen:
            seen.add(kid)
            signed.signatures.add(key_id=kid, signature=key.sign(CANCEL_CONTEXT + data))
    if not seen:
        raise ValueError("sign_cancel() needs at least one private key")
    return signed


def verify_cancel(
    data: bytes, trusted: Mapping[str, Ed25519PublicKey], now: float | None
) -> tuple[opb.Cancel, str]:
    """The authenticated, valid Cancel in the serialized SignedCancel `data`, and the id of
    the key that signed it. `now` None: the wall clock is not synchronized, and the cancel's
    times are not judged (a cancel only ever stops the one update it names, before its model
    loads: obeying a stale one is safe, refusing a fresh one on a wrong clock is not).

    Raises UpdateRejected: "malformed", "unknown_key", "bad_signature", "not_canonical",
    "inconsistent", "expired", "not_yet_valid".
    """
    if len(data) > MAX_CANCEL_BYTES:
        raise UpdateRejected("malformed", f"the cancel is {len(data)} bytes (limit 4096)")
    signed = opb.SignedCancel()
    try:
        signed.ParseFromString(data)
    except DecodeError as exc:
        raise UpdateRejected("malformed", f"the signed cancel does not parse: {exc}") from exc
    kid = authenticate(signed.signatures, CANCEL_CONTEXT + signed.cancel, trusted, "cancel")
    cancel = opb.Cancel()
    try:
        cancel.ParseFromString(signed.cancel)
    except DecodeError as exc:
        raise UpdateRejected("malformed", f"the cancel does not parse: {exc}") from exc
    cancel.DiscardUnknownFields()
    if canonical(cancel) != signed.cancel:
        raise UpdateRejected("not_canonical", "cancel bytes are not canonical")
    if not UPDATE_ID_RE.fullmatch(cancel.update_id):
        raise UpdateRejected("inconsistent", f"bad update id {cancel.update_id!r} in the cancel")
    if cancel.expires_unix <= cancel.issued_unix:
        raise UpdateRejected("inconsistent", "the cancel expires before it is issued")
    if now is None:
        return cancel, kid
    if cancel.expires_unix <= now:
        raise UpdateRejected("expired", f"the cancel expired {now - cancel.expires_unix:.0f} s ago")
    if cancel.issued_unix > now + CLOCK_SKEW_S:
        raise UpdateRejected(
            "not_yet_valid",
            f"the cancel is issued {cancel.issued_unix - now:.0f} s in the future; check the clock",
        )
    return cancel, kid


def check_cancellable(
    cancel: opb.Cancel,
    running: opb.UpdateRecord | None,
    last: opb.UpdateRecord | None,
    cancellable: Sequence[int],
) -> None:
    """Raise UpdateRejected unless `cancel` names the update in progress (`running`, its
    record; None when none runs; `last`: the last record) and it is in a `cancellable` state:
    "not_in_progress", "too_late"."""
    R = opb.UpdateRecord
    if running is None:
        if last is None:
            where = "no update ever ran"
        else:
            last_id = opb.Manifest.FromString(last.signed.manifest).update_id
            where = f"the last one, {last_id}, is {R.State.Name(last.state).lower()}"
        raise UpdateRejected(
            "not_in_progress", f"update {cancel.update_id} is not in progress here ({where})"
        )
    running_id = opb.Manifest.FromString(running.signed.manifest).update_id
    if running_id != cancel.update_id:
        raise UpdateRejected(
            "not_in_progress",
            f"update {cancel.update_id} is not in progress here ({running_id} is)",
        )
    if running.state not in cancellable:
        raise UpdateRejected(
            "too_late",
            f"update {running_id} is {R.State.Name(running.state).lower()}: the new model is "
            "loading or serving; it commits or rolls back by itself",
        )
