"""Manifest signatures: canonical bytes and Ed25519 signatures, checked before anything else.

Signing: the manifest is serialized deterministically (`canonical`) and each private key signs
those bytes; `SignedManifest` carries the bytes and one signature per key (key id + Ed25519
signature), so during a key rotation a manifest can be signed by the old and the new key.
`verify` authenticates the bytes *before* parsing them as a `Manifest`, then insists that they
are canonical (re-serializing the parsed message gives the same bytes, no unknown fields).
Then `agent.ota.artifact.manifest.check` judges the content.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError

from agent.ota.artifact.keys import key_id
from agent.ota.artifact.manifest import UpdateRejected
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 1 << 20


def canonical(manifest: opb.Manifest) -> bytes:
    """The deterministic serialization of `manifest`: what is signed and what is verified."""
    data: bytes = manifest.SerializeToString(deterministic=True)
    return data


def sign(manifest: opb.Manifest, private_keys: Iterable[Ed25519PrivateKey]) -> opb.SignedManifest:
    """Sign the canonical bytes with every key (one signature per distinct key)."""
    data = canonical(manifest)
    signed = opb.SignedManifest(manifest=data)
    seen: set[str] = set()
    for key in private_keys:
        kid = key_id(key.public_key())
        if kid in seen:
            continue
        seen.add(kid)
        signed.signatures.add(key_id=kid, signature=key.sign(data))
    if not seen:
        raise ValueError("sign() needs at least one private key")
    return signed


def parse_signed(data: bytes) -> opb.SignedManifest:
    """Parse a serialized SignedManifest (UpdateRejected "malformed" if it does not parse)."""
    signed = opb.SignedManifest()
    try:
        signed.ParseFromString(data)
    except DecodeError as exc:
        raise UpdateRejected("malformed", f"the signed manifest does not parse: {exc}") from exc
    return signed


def verify(
    signed: opb.SignedManifest | bytes, trusted: Mapping[str, Ed25519PublicKey]
) -> opb.Manifest:
    """The authenticated Manifest, if at least one signature is by a trusted key and valid.

    Raises UpdateRejected: "malformed", "unknown_key", "bad_signature", "not_canonical".
    """
    if isinstance(signed, bytes):
        signed = parse_signed(signed)
    data = signed.manifest
    if len(data) > MAX_MANIFEST_BYTES:
        raise UpdateRejected(
            "malformed", f"the manifest is {len(data)} bytes (limit {MAX_MANIFEST_BYTES})"
        )
    authenticate(signed.signatures, data, trusted, "manifest")
    manifest = opb.Manifest()
    try:
        manifest.ParseFromString(data)
    except DecodeError as exc:
        raise UpdateRejected("malformed", f"the manifest does not parse: {exc}") from exc
    manifest.DiscardUnknownFields()
    if canonical(manifest) != data:
        raise UpdateRejected("not_canonical", "manifest bytes are not canonical")
    return manifest


def authenticate(
    signatures: Iterable[opb.Signature],
    data: bytes,
    trusted: Mapping[str, Ed25519PublicKey],
    what: str,
) -> str:
    """The id of a trusted key with a valid signature over `data` (a `what`: "manifest").

    Raises UpdateRejected: "unknown_key", "bad_signature".
    """
    signatures = list(signatures)
    ids = [s.key_id for s in signatures]
    bad: list[str] = []
    good = ""
    for sig in signatures:
        key = trusted.get(sig.key_id)
        if key is None:
            continue
        try:
            key.verify(sig.signature, data)
        except InvalidSignature:
            bad.append(sig.key_id)
            continue
        good = sig.key_id
        break
    if not good:
        if bad:
            raise UpdateRejected("bad_signature", f"bad signature by key {', '.join(bad)}")
        if not trusted:
            raise UpdateRejected(
                "unknown_key",
                f"not signed by a trusted key (key ids: {', '.join(ids) or 'none'}); "
                "no trusted keys are configured",
            )
        raise UpdateRejected(
            "unknown_key",
            f"not signed by a trusted key (key ids: {', '.join(ids) or 'none'}; "
            f"trusted: {', '.join(sorted(trusted))})",
        )
    if bad:
        log.warning("%s has a bad signature by key %s (accepted by %s)", what, bad, good)
    return good
