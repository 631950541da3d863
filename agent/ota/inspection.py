"""`edge-agent update inspect` (and what `update make` prints): a bundle as a report, the
manifest's fields, its signatures against trusted keys, whether it is valid now, and the
payload against what the manifest declares."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from google.protobuf.message import DecodeError

from agent.ota.artifact.bundle import BundleError, read_bundle
from agent.ota.artifact.manifest import CLOCK_SKEW_S, UpdateRejected
from agent.ota.artifact.manifest_json import manifest_to_dict
from agent.ota.artifact.signing import verify
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb


def inspect(
    path: Path, trusted: Mapping[str, Ed25519PublicKey] | None = None, now: float | None = None
) -> dict[str, Any]:
    """A bundle as a JSON-ready dict: the manifest's fields, its signatures (with `trusted`:
    whether each key is trusted and its signature valid, and the verdict of `verify`), whether
    it is valid at `now` (default: the clock; `expired`, `not_yet_valid`, `expires_in_s`), and
    the payload's actual size and sha256 against the declared ones."""
    at = time.time() if now is None else now
    signed, payload = read_bundle(path)
    manifest = opb.Manifest()
    try:
        manifest.ParseFromString(signed.manifest)
    except DecodeError as exc:
        raise BundleError(f"{path}: the manifest does not parse: {exc}") from exc
    sigs: list[dict[str, Any]] = []
    for s in signed.signatures:
        entry: dict[str, Any] = {"key_id": s.key_id, "trusted": None, "valid": None}
        if trusted is not None:
            key = trusted.get(s.key_id)
            entry["trusted"] = key is not None
            if key is not None:
                try:
                    key.verify(s.signature, signed.manifest)
                    entry["valid"] = True
                except InvalidSignature:
                    entry["valid"] = False
        sigs.append(entry)
    actual_sha = payload.sha256()
    doc: dict[str, Any] = {
        "bundle": str(path),
        "manifest": manifest_to_dict(manifest),
        "signatures": sigs,
        "verified": None,
        "rejected": None,
        "expired": manifest.expires_unix <= at,
        "not_yet_valid": manifest.issued_unix > at + CLOCK_SKEW_S,
        "expires_in_s": manifest.expires_unix - at,
        "payload": {
            "size": payload.size,
            "sha256": actual_sha,
            "size_ok": payload.size == manifest.payload_size,
            "sha256_ok": actual_sha == manifest.payload_sha256,
        },
    }
    if manifest.HasField("canary"):  # the fields manifest_to_dict predates
        doc["manifest"]["canary"]["max_mean_nll"] = manifest.canary.max_mean_nll
        doc["manifest"]["canary"]["base_mean_nll"] = manifest.canary.base_mean_nll
    if trusted is not None:
        try:
            verify(signed, trusted)
            doc["verified"] = True
        except UpdateRejected as exc:
            doc["verified"] = False
            doc["rejected"] = {"code": exc.code, "message": exc.message}
    return doc


def describe(doc: Mapping[str, Any]) -> str:
    """`inspect`'s dict for people."""
    m = doc["manifest"]
    p = doc["payload"]
    lines = [
        f"bundle      {doc['bundle']}",
        f"model       {m['model_name']} version {m['version']} ({m['version_label']}), "
        f"{m['quantization']}",
        f"update id   {m['update_id']}",
        f"base        {m['base_model_sha256'] or '(full payload)'}",
        f"target      {m['target_model_sha256']}",
        f"payload     {m['payload_format']}, {m['payload_size']} bytes declared, "
        f"{p['size']} in the bundle ({'ok' if p['size_ok'] else 'MISMATCH'}), sha256 "
        f"{'ok' if p['sha256_ok'] else 'MISMATCH'}",
        f"url         {m['payload_url'] or '(over MQTT)'}",
        f"issued      {_utc(m['issued_unix'])}",
        f"expires     {_utc(m['expires_unix'])}{_validity(doc)}",
        f"profiles    {', '.join(m['compatible_profiles']) or 'any'}",
        f"arch        {', '.join(m['compatible_arch']) or 'any'}",
        f"min agent   {m['min_agent_version'] or 'any'}",
    ]
    c = m["canary"]
    if c is not None:
        prompt = c["prompt"] if len(c["prompt"]) <= 60 else c["prompt"][:57] + "..."
        if c.get("max_mean_nll"):
            lines.append(
                f"canary      mean NLL <= {c['max_mean_nll']:.2f} nats/token (base model "
                f"{c['base_mean_nll']:.2f}) on {prompt!r}"
            )
        if c["expected_tokens"] or not c.get("max_mean_nll"):
            lines.append(f"canary      {prompt!r} -> {c['expected_tokens']}")
    else:
        lines.append("canary      none")
    lines.append("files")
    for f in m["files"]:
        base = f"from {f['base_sha256'][:12]}…" if f["base_sha256"] else "new"
        lines.append(f"  {f['name']:32} {f['size']:>12}  {f['sha256'][:12]}…  {base}")
    lines.append("signatures")
    for s in doc["signatures"]:
        state = ""
        if s["trusted"] is not None:
            state = "untrusted" if not s["trusted"] else ("valid" if s["valid"] else "BAD")
        lines.append(f"  {s['key_id']}  {state}".rstrip())
    if doc["verified"] is not None:
        r = doc["rejected"]
        if not doc["verified"]:
            lines.append(f"verified    NO: {r['message']}")
        elif doc["expired"] or doc["not_yet_valid"]:
            why = "EXPIRED" if doc["expired"] else "NOT YET VALID"
            lines.append(f"verified    {why}: signature valid, but devices refuse it now")
        else:
            lines.append("verified    yes")
    return "\n".join(lines)


def _validity(doc: Mapping[str, Any]) -> str:
    left = float(doc["expires_in_s"])
    if doc["expired"]:
        return f"  EXPIRED {_span(-left)} ago"
    if doc["not_yet_valid"]:
        return "  NOT YET VALID: issued more than a day in the future (check the clocks)"
    return f"  (in {_span(left)})"


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
