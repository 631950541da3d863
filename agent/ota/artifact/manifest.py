"""Update manifests (proto/edge_agent/ota/v1/ota.proto): what an update is, and the checks
before an install. After the signatures (`agent.ota.artifact.signing.verify`), `check` decides
whether this device may install it; every refusal is an `UpdateRejected` with a stable `code`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from agent.base.errors import InvalidRequest
from agent.model.directory import METADATA_FILE, model_digest
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

FORMAT_VERSION = 1
DELTA_FORMAT = "ea-delta-1"  # agent.ota.delta.files.FORMAT
FULL_FORMAT = "full-1"
PAYLOAD_FORMATS = (DELTA_FORMAT, FULL_FORMAT)
# A manifest issued further in the future than this is refused (the signer's clock or ours is
# wrong, or someone is pre-staging updates); clocks on boards without an RTC drift.
CLOCK_SKEW_S = 86400.0
DEFAULT_MAX_PAYLOAD_BYTES = 4 << 30

# Stable reason codes, in the order `verify` and `check` test them.
CODES = (
    "malformed",  # the SignedManifest or the Manifest bytes do not parse
    "unknown_key",  # no signature by a trusted key (or no trusted keys at all)
    "bad_signature",  # signatures by trusted keys, none of them valid
    "not_canonical",  # signed bytes are not the canonical serialization
    "unsupported_format",  # format_version is not one this agent reads
    "unknown_payload_format",
    "bad_payload_size",  # 0 or above the device's limit
    "inconsistent",  # the manifest contradicts itself (file list, ids, urls, metadata)
    "wrong_model",  # another model's update
    "replay",  # this update_id was received here before and has ended (whatever its end)
    "rollback",  # version not newer than the installed one
    "expired",  # expires_unix <= now (freeze attack)
    "not_yet_valid",  # issued more than CLOCK_SKEW_S in the future
    "base_mismatch",  # the delta is for another installed variant
    "incompatible",  # profile or arch not in the manifest's lists
    "agent_too_old",  # min_agent_version newer than this agent
)

_HEX64 = re.compile(r"[0-9a-f]{64}")
_UPDATE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
UPDATE_ID_RE = _UPDATE_ID  # update ids name files on the device
_VERSION = re.compile(r"(\d+(?:\.\d+)*)")


class UpdateRejected(InvalidRequest):
    """An update may not be installed: a stable short `code` and a message for people."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"update rejected ({code}): {message}")


@dataclass(frozen=True, slots=True)
class InstallContext:
    """What `check` needs to know about this device and its installed model."""

    model_name: str
    installed_version: int  # the update version of the serving model (0: as shipped)
    installed_sha256: str  # of the serving variant's file
    profile: str
    arch: str  # platform.machine(): "aarch64", "x86_64", ...
    agent_version: str
    finished_update_ids: frozenset[str] = frozenset()
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    # where loading a model writes its prepared copy and packed weights (the no_space checks
    # count a first load there, agent/ota/space.py); None: nowhere on disk
    cache_dir: Path | None = None


def version_tuple(text: str) -> tuple[int, ...] | None:
    """The leading dotted numbers of a version, trailing zeros dropped so that "1.0" equals
    "1.0.0": "0.10.0" -> (0, 10), "1.2.3rc1" -> (1, 2, 3); None if it starts with no digit."""
    m = _VERSION.match(text.strip())
    if m is None:
        return None
    parts = [int(p) for p in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:  # "1.0" == "1.0.0"
        parts.pop()
    return tuple(parts)


def _safe_name(name: str) -> bool:
    return (
        bool(name)
        and len(name) <= 255
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
        and name.isprintable()
    )


def _inconsistent(message: str) -> UpdateRejected:
    return UpdateRejected("inconsistent", message)


def _check_files(m: opb.Manifest) -> None:
    if not m.files:
        raise _inconsistent("the manifest lists no files")
    names: set[str] = set()
    for f in m.files:
        if not _safe_name(f.name):
            raise _inconsistent(f"file name {f.name!r} is not a plain file name")
        if f.name in names:
            raise _inconsistent(f"file {f.name!r} is listed twice")
        names.add(f.name)
        if not _HEX64.fullmatch(f.sha256):
            raise _inconsistent(f"file {f.name}: sha256 {f.sha256!r} is not 64 lowercase hex")
        if f.base_sha256 and not _HEX64.fullmatch(f.base_sha256):
            raise _inconsistent(f"file {f.name}: base_sha256 {f.base_sha256!r} is not hex")
        if not f.base_sha256 and f.base_size:
            raise _inconsistent(f"file {f.name}: base_size without base_sha256")
    by_sha = {f.sha256 for f in m.files}
    if m.target_model_sha256 not in by_sha:
        raise _inconsistent(
            f"target_model_sha256 {m.target_model_sha256[:16]!r} is not among the files"
        )


def _check_metadata(m: opb.Manifest) -> None:
    """metadata_json agrees with the file list, the model name and the quantization."""
    if not m.metadata_json:
        return
    try:
        meta = json.loads(m.metadata_json)
    except ValueError as exc:
        raise _inconsistent(f"metadata_json is not JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise _inconsistent("metadata_json is not a JSON object")
    if meta.get("name") != m.model_name:
        raise _inconsistent(
            f"metadata_json names model {meta.get('name')!r}, the manifest {m.model_name!r}"
        )
    files = {f.name: f for f in m.files}
    entry = files.get("metadata.json")
    if entry is not None:
        digest = hashlib.sha256(m.metadata_json.encode("utf-8")).hexdigest()
        if digest != entry.sha256:
            raise _inconsistent("metadata_json is not the metadata.json of the file list")
    variants = meta.get("variants")
    if not isinstance(variants, list):
        raise _inconsistent("metadata_json has no variants list")
    target_quant = None
    for v in variants:
        if not isinstance(v, dict):
            raise _inconsistent("metadata_json: a variant is not an object")
        f = files.get(str(v.get("file")))
        if f is None or f.sha256 != v.get("sha256") or f.size != v.get("size"):
            raise _inconsistent(
                f"metadata_json variant {v.get('file')!r} does not match the file list"
            )
        if f.sha256 == m.target_model_sha256:
            target_quant = v.get("quantization")
    if target_quant != m.quantization:
        raise _inconsistent(
            f"the target variant's quantization is {target_quant!r} in metadata_json, "
            f"{m.quantization!r} in the manifest"
        )


def check_consistent(m: opb.Manifest, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
    """The checks that need nothing but the manifest (also run by `check`)."""
    if m.format_version != FORMAT_VERSION:
        raise UpdateRejected(
            "unsupported_format",
            f"manifest format_version {m.format_version} is not supported "
            f"(this agent reads {FORMAT_VERSION})",
        )
    if m.payload_format not in PAYLOAD_FORMATS:
        raise UpdateRejected(
            "unknown_payload_format",
            f"payload format {m.payload_format!r} is unknown (known: {', '.join(PAYLOAD_FORMATS)})",
        )
    if m.payload_size == 0:
        raise UpdateRejected("bad_payload_size", "the payload size is 0")
    if m.payload_size > max_payload_bytes:
        raise UpdateRejected(
            "bad_payload_size",
            f"the payload is {m.payload_size} bytes, more than this device's limit of "
            f"{max_payload_bytes}",
        )
    if not _UPDATE_ID.fullmatch(m.update_id):
        raise _inconsistent(
            f"update_id {m.update_id!r} is not 1-128 of [A-Za-z0-9._-] (starting alphanumeric)"
        )
    if not m.model_name:
        raise _inconsistent("model_name is empty")
    if m.version == 0:
        raise _inconsistent("version is 0 (versions start at 1)")
    if not _HEX64.fullmatch(m.payload_sha256):
        raise _inconsistent(f"payload_sha256 {m.payload_sha256!r} is not 64 lowercase hex")
    if m.base_model_sha256 and not _HEX64.fullmatch(m.base_model_sha256):
        raise _inconsistent(f"base_model_sha256 {m.base_model_sha256!r} is not hex")
    if m.payload_format == DELTA_FORMAT and not m.base_model_sha256:
        raise _inconsistent(f"a {DELTA_FORMAT} payload needs a base_model_sha256")
    if m.payload_format == FULL_FORMAT and m.base_model_sha256:
        raise _inconsistent(f"a {FULL_FORMAT} payload has no base_model_sha256")
    if m.payload_url and not m.payload_url.startswith(("https://", "http://")):
        raise _inconsistent(f"payload_url {m.payload_url!r} is not http(s)")
    if m.expires_unix <= m.issued_unix:
        raise _inconsistent("expires_unix is not after issued_unix")
    if m.min_agent_version and version_tuple(m.min_agent_version) is None:
        raise _inconsistent(f"min_agent_version {m.min_agent_version!r} is not a version")
    if m.HasField("canary"):
        c = m.canary
        if not c.prompt:
            raise _inconsistent("the canary has no prompt")
        if c.logits_sha256 and not _HEX64.fullmatch(c.logits_sha256):
            raise _inconsistent("the canary's logits_sha256 is not hex")
    _check_files(m)
    _check_metadata(m)


def check_times(m: opb.Manifest, now: float) -> None:
    """Raise UpdateRejected ("expired", "not_yet_valid") unless `now` is in the manifest's
    validity window. `now` must come from a synchronized clock (agent.base.clock)."""
    if m.expires_unix <= now:
        raise UpdateRejected("expired", f"the manifest expired {now - m.expires_unix:.0f} s ago")
    if m.issued_unix > now + CLOCK_SKEW_S:
        raise UpdateRejected(
            "not_yet_valid",
            f"the manifest is issued {m.issued_unix - now:.0f} s in the future "
            f"(more than the {CLOCK_SKEW_S:.0f} s clock skew allowed); check the clock",
        )


def check(manifest: opb.Manifest, ctx: InstallContext, now: float | None) -> None:
    """Raise UpdateRejected unless this device may install `manifest` at time `now` (None: the
    wall clock is not synchronized, and the validity window is left to `check_times` later).

    Verify the signature first (`verify`); this only judges the content.

    A `Manifest` (proto/edge_agent/ota/v1/ota.proto) says what an update is: the model and its
    monotonic version, every file of the model directory after the update (sha256, size, the base
    file it is rebuilt from), the base variant it applies to, the payload (sha256, size, format),
    its validity window, what it is compatible with, and an optional canary.
    """
    m = manifest
    check_consistent(m, ctx.max_payload_bytes)
    if m.model_name != ctx.model_name:
        raise UpdateRejected(
            "wrong_model",
            f"the update is for model {m.model_name!r}, this device serves {ctx.model_name!r}",
        )
    if m.update_id in ctx.finished_update_ids:
        raise UpdateRejected(
            "replay",
            f"update {m.update_id} was already received on this device and has ended (committed, "
            "rolled back, rejected, given up or cancelled); an update id is used once: a "
            "re-issue needs a new one (`update make` gives every bundle a new id)",
        )
    if m.version <= ctx.installed_version:
        raise UpdateRejected(
            "rollback",
            f"version {m.version} is not newer than the installed version {ctx.installed_version}",
        )
    if now is not None:
        check_times(m, now)
    if m.base_model_sha256 and m.base_model_sha256 != ctx.installed_sha256:
        raise UpdateRejected(
            "base_mismatch",
            f"the delta applies to {m.base_model_sha256[:16]}…, the installed variant is "
            f"{ctx.installed_sha256[:16] or 'none'}…",
        )
    if m.compatible_profiles and ctx.profile not in m.compatible_profiles:
        raise UpdateRejected(
            "incompatible",
            f"profile {ctx.profile!r} is not one of {', '.join(m.compatible_profiles)}",
        )
    if m.compatible_arch and ctx.arch not in m.compatible_arch:
        raise UpdateRejected(
            "incompatible", f"arch {ctx.arch!r} is not one of {', '.join(m.compatible_arch)}"
        )
    if m.min_agent_version:
        need = version_tuple(m.min_agent_version) or ()
        have = version_tuple(ctx.agent_version) or ()
        if have < need:
            raise UpdateRejected(
                "agent_too_old",
                f"the update needs agent {m.min_agent_version}, this is {ctx.agent_version}",
            )


def manifest_digest(m: opb.Manifest) -> str:
    """`agent.model.directory.model_digest` of the model directory the manifest describes (its
    metadata.json, the tokenizer and the variants it names); "" if the manifest does not say."""
    try:
        meta = json.loads(m.metadata_json)
        names = {METADATA_FILE, str(meta["tokenizer"])}
        names |= {str(v["file"]) for v in meta["variants"]}
    except (ValueError, KeyError, TypeError):
        return ""
    files = {f.name: f.sha256 for f in m.files if f.name in names}
    return model_digest(files) if set(files) == names else ""
