"""A Mender Artifact (format version 3, a module-image) that carries one signed edge-agent
bundle, for fleets that deploy through Mender (docs/UPDATES.md, "Deploying with Mender").

The payload type is `PAYLOAD_TYPE`: Mender's client hands the bundle to the Update Module of
that name on the device, which gives it to the daemon, and the daemon verifies the bundle's own
Ed25519 signatures, stages, activates, trials and commits or rolls back as with an MQTT update.
Mender's signature of the artifact (`manifest.sig`, RSA PKCS#1 v1.5 or ECDSA P-256 over SHA-256,
as `mender-artifact sign` makes) is optional and checked by Mender's client, not by us.

Layout (mendersoftware/mender-artifact, Documentation/artifact-format-v3.md): an outer tar of
`version`, `manifest` (sha256 of `version`, `header.tar.gz` and each payload file), the optional
`manifest.sig`, `header.tar.gz` (`header-info`, `headers/0000/type-info`, `meta-data`) and
`data/0000.tar.gz` holding the bundle. Every member has mtime 0 and owner 0, so the same bundle
and options give the same bytes. Written atomically (`agent.base.fsutil.atomic_write`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, utils

from agent.base.errors import AgentError
from agent.base.fsutil import atomic_write

PAYLOAD_TYPE: Final = "edge-agent-model"
FORMAT_VERSION: Final = 3
# what Mender's own module-image writer provides and clears for a module's payload, so that
# `mender show-provides` names the model version the device runs (and the next one replaces it)
PROVIDES_KEY: Final = f"rootfs-image.{PAYLOAD_TYPE}.version"
CLEARS: Final = (f"rootfs-image.{PAYLOAD_TYPE}.*",)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+:-]{0,127}$")
_CHUNK = 1 << 20


class MenderError(AgentError):
    """An artifact that cannot be written as asked (bad name, device type or key)."""


@dataclass(frozen=True, slots=True)
class ArtifactSpec:
    """What the artifact says besides its payload; checks itself."""

    name: str  # artifact_name: what `mender show-artifact` reports once installed
    device_types: tuple[str, ...]  # artifact_depends.device_type: at least one
    meta: tuple[tuple[str, Any], ...] = ()  # the payload's meta-data (JSON object)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise MenderError(
                f"artifact name {self.name!r}: 1-128 characters of letters, digits and ._+:- "
                "starting with a letter or digit"
            )
        if not self.device_types:
            raise MenderError(
                "a Mender artifact names at least one device type (--mender-device-type)"
            )
        for t in self.device_types:
            if not _NAME.match(t):
                raise MenderError(
                    f"device type {t!r}: 1-128 characters of letters, digits and ._+:-"
                )


def load_signing_key(path: Path) -> rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey:
    """A PEM private key Mender can verify: RSA (2048 bits or more) or ECDSA P-256."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise MenderError(f"{path}: not a PEM private key without a password ({exc})") from None
    if isinstance(key, rsa.RSAPrivateKey) and key.key_size >= 2048:
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise MenderError(f"{path}: Mender signs with RSA (>= 2048 bits) or ECDSA P-256 keys only")


def sign_manifest(manifest: bytes, key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    """`manifest.sig`: base64 of the signature over SHA-256 of `manifest` (RSA: PKCS#1 v1.5;
    ECDSA: r and s as two 32-byte big-endian integers, the form Mender's tools write)."""
    if isinstance(key, rsa.RSAPrivateKey):
        raw = key.sign(manifest, padding.PKCS1v15(), hashes.SHA256())
    else:
        r, s = utils.decode_dss_signature(key.sign(manifest, ec.ECDSA(hashes.SHA256())))
        raw = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return base64.b64encode(raw)


def _info(name: str, size: int, mode: int = 0o600) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _gz_tar(members: Sequence[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        for name, data in members:
            tar.addfile(_info(name, len(data)), io.BytesIO(data))
    return buf.getvalue()


def _json(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def header(spec: ArtifactSpec) -> bytes:
    """`header.tar.gz`: header-info first, then the payload's type-info and meta-data."""
    info = {
        "payloads": [{"type": PAYLOAD_TYPE}],
        "artifact_provides": {"artifact_name": spec.name},
        "artifact_depends": {"device_type": list(spec.device_types)},
    }
    type_info = {
        "type": PAYLOAD_TYPE,
        "artifact_provides": {PROVIDES_KEY: spec.name},
        "clears_artifact_provides": list(CLEARS),
    }
    members = [("header-info", _json(info)), ("headers/0000/type-info", _json(type_info))]
    if spec.meta:
        members.append(("headers/0000/meta-data", _json(dict(spec.meta))))
    return _gz_tar(members)


def write_artifact(
    bundle: Path,
    out: Path,
    spec: ArtifactSpec,
    key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | None = None,
) -> None:
    """Write the artifact carrying `bundle` (as `data/0000/<bundle's name>`) to `out`."""
    version = _json({"format": "mender", "version": FORMAT_VERSION})
    head = header(spec)
    digest = hashlib.sha256()
    size = bundle.stat().st_size
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out.parent) as data:
        with (
            gzip.GzipFile(fileobj=data, mode="wb", mtime=0) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
            open(bundle, "rb") as src,
        ):
            tar.addfile(_info(bundle.name, size, 0o644), _Hashing(src, digest))
        lines = sorted(
            [
                f"{digest.hexdigest()}  data/0000/{bundle.name}",
                f"{hashlib.sha256(head).hexdigest()}  header.tar.gz",
                f"{hashlib.sha256(version).hexdigest()}  version",
            ],
            key=lambda line: line.split("  ", 1)[1],
        )
        manifest = ("\n".join(lines) + "\n").encode()

        def write(raw: IO[bytes]) -> None:
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
                tar.addfile(_info("version", len(version)), io.BytesIO(version))
                tar.addfile(_info("manifest", len(manifest)), io.BytesIO(manifest))
                if key is not None:
                    sig = sign_manifest(manifest, key)
                    tar.addfile(_info("manifest.sig", len(sig)), io.BytesIO(sig))
                tar.addfile(_info("header.tar.gz", len(head)), io.BytesIO(head))
                n = data.seek(0, os.SEEK_END)
                data.seek(0)
                tar.addfile(_info("data/0000.tar.gz", n), data)

        atomic_write(out, write, mode=0o644)


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through it (the payload is read once)."""

    def __init__(self, src: io.BufferedReader, digest: Any) -> None:
        self._src, self._digest = src, digest

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._src.read(_CHUNK if n is None or n < 0 else n)
        self._digest.update(data)
        return data
