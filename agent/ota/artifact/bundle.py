"""Update bundles: one uncompressed tar of ``manifest.pb`` (a SignedManifest) then
``payload.bin`` (the delta), made by the operator with ``edge-agent update make``.

The payload stays where it is inside the tar (`Payload` is the file, offset and size), so the
device or the publisher streams it without extracting. A directory holding the same two files
is read the same way.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.base.errors import AgentError
from agent.model.directory import METADATA_FILE, ModelMeta, Variant, load_model_dir, sha256_file
from agent.ota.artifact.manifest import FORMAT_VERSION, UpdateRejected, check_consistent
from agent.ota.artifact.signing import MAX_MANIFEST_BYTES, parse_signed, sign
from agent.ota.delta import files as delta
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

log = logging.getLogger(__name__)

MANIFEST_MEMBER = "manifest.pb"
PAYLOAD_MEMBER = "payload.bin"
DEFAULT_EXPIRES_IN_S = 7 * 86400.0
CHUNK = 1 << 20


class BundleError(AgentError):
    """A bundle cannot be made or read; the message names the file."""


@dataclass(frozen=True, slots=True)
class Payload:
    """Where a bundle's payload is: `size` bytes of `path` from `offset`."""

    path: Path
    offset: int
    size: int

    def chunks(self, chunk: int = CHUNK) -> Iterator[bytes]:
        """The payload's bytes, in chunks."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            left = self.size
            while left > 0:
                block = f.read(min(chunk, left))
                if not block:
                    raise BundleError(f"{self.path}: payload truncated ({left} bytes missing)")
                left -= len(block)
                yield block

    def sha256(self) -> str:
        h = hashlib.sha256()
        for block in self.chunks():
            h.update(block)
        return h.hexdigest()

    def extract(self, dest: Path) -> Path:
        """Copy the payload to its own file (for tools that want a path)."""
        with open(dest, "wb") as f:
            for block in self.chunks():
                f.write(block)
        return dest


# ----------------------------------------------------------------------------- make


def target_variant(meta: ModelMeta, quantization: str | None = None) -> Variant:
    """The variant an update serves: `quantization`, else int8 if present, else the first."""
    if quantization:
        return meta.variant(quantization)
    for v in meta.variants:
        if v.quantization == "int8":
            return v
    return meta.variants[0]


FileHashes = dict[str, tuple[str, int]]  # file name -> (sha256, size)


def _hash_dir(directory: Path) -> FileHashes:
    """sha256 and size of every file of a model directory (hashed once per bundle)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    if not any(p.name == METADATA_FILE for p in files):
        raise BundleError(f"{directory}: not a model directory (no {METADATA_FILE})")
    return {p.name: (sha256_file(p), p.stat().st_size) for p in files}


def _check_variants(meta: ModelMeta, files: FileHashes) -> None:
    """The operator's model directory must be what its metadata.json says."""
    for v in meta.variants:
        if v.file not in files:
            raise BundleError(f"{meta.path_of(v)}: listed in {METADATA_FILE} but missing")
        sha, size = files[v.file]
        if (sha, size) != (v.sha256, v.size):
            raise BundleError(
                f"{meta.path_of(v)}: sha256/size do not match {METADATA_FILE} "
                f"({sha[:16]}… vs {v.sha256[:16]}…); regenerate the metadata"
            )


def _file_targets(new: FileHashes, base: FileHashes, payload: Path) -> list[opb.FileTarget]:
    """One FileTarget per new file, with the base file the delta rebuilds it from."""
    base_shas = {sha for sha, _ in base.values()}
    header = {e.name: e for e in delta.read_header(payload)}
    if set(header) != set(new):
        raise BundleError(
            f"the delta rebuilds {sorted(header)}, the new model directory has {sorted(new)}"
        )
    targets = []
    for name, (sha, size) in new.items():
        entry = header[name]
        if (entry.sha256, entry.size) != (sha, size):
            raise BundleError(f"the delta's entry for {name} does not match the file")
        if entry.base_sha256 and entry.base_sha256 not in base_shas:
            raise BundleError(f"the delta rebuilds {name} from a file not in the base directory")
        targets.append(
            opb.FileTarget(
                name=name,
                sha256=sha,
                size=size,
                base_sha256=entry.base_sha256,
                base_size=entry.base_size if entry.base_sha256 else 0,
            )
        )
    return targets


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = int(mtime)
    return info


def write_bundle(signed: opb.SignedManifest, payload: Path, out: Path) -> None:
    """Write the tar (manifest first, then payload) atomically: temp file, fsync, rename."""
    data = signed.SerializeToString()
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with (
            open(tmp, "wb") as raw,
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            mtime = time.time()
            tar.addfile(_tarinfo(MANIFEST_MEMBER, len(data), mtime), io.BytesIO(data))
            with open(payload, "rb") as p:
                tar.addfile(_tarinfo(PAYLOAD_MEMBER, payload.stat().st_size, mtime), p)
            tar.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_bundle(
    base_dir: Path,
    new_dir: Path,
    private_keys: Sequence[Ed25519PrivateKey],
    out: Path,
    *,
    version: int,
    update_id: str | None = None,
    expires_in_s: float = DEFAULT_EXPIRES_IN_S,
    payload_url: str = "",
    compatible_profiles: Iterable[str] = (),
    compatible_arch: Iterable[str] = (),
    min_agent_version: str = "",
    canary: opb.Canary | None = None,
    quantization: str | None = None,
    now: float | None = None,
) -> opb.SignedManifest:
    """Diff `base_dir` -> `new_dir`, sign a manifest for it with every key, write the bundle.

    The target variant is `quantization` (default: int8 if the new directory has it, else its
    first variant); the base is the same quantization in `base_dir` (what devices serving that
    variant have installed).
    """
    base_meta, new_meta = load_model_dir(base_dir), load_model_dir(new_dir)
    if base_meta.name != new_meta.name:
        raise BundleError(
            f"{new_dir} is model {new_meta.name!r}, {base_dir} is {base_meta.name!r}; "
            "an update keeps the model name"
        )
    base_files, new_files = _hash_dir(base_dir), _hash_dir(new_dir)
    _check_variants(base_meta, base_files)
    _check_variants(new_meta, new_files)
    target = target_variant(new_meta, quantization)
    try:
        base = base_meta.variant(target.quantization)
    except AgentError as exc:
        raise BundleError(f"{base_dir}: no {target.quantization} variant to diff against") from exc
    issued = time.time() if now is None else now
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = out.with_name(f".{out.name}.payload")
    try:
        stats = delta.diff_dirs(base_dir, new_dir, payload)
        log.info("delta %s -> %s: %s", base_dir, new_dir, stats)
        payload_sha, payload_size = sha256_file(payload), payload.stat().st_size
        manifest = opb.Manifest(
            format_version=FORMAT_VERSION,
            update_id=update_id or uuid.uuid4().hex,
            model_name=new_meta.name,
            version=version,
            version_label=new_meta.version,
            files=_file_targets(new_files, base_files, payload),
            base_model_sha256=base.sha256,
            target_model_sha256=target.sha256,
            quantization=target.quantization,
            payload_sha256=payload_sha,
            payload_size=payload_size,
            payload_format=delta.FORMAT,
            payload_url=payload_url,
            issued_unix=issued,
            expires_unix=issued + expires_in_s,
            compatible_profiles=list(compatible_profiles),
            compatible_arch=list(compatible_arch),
            min_agent_version=min_agent_version,
            metadata_json=(new_dir / METADATA_FILE).read_text(encoding="utf-8"),
        )
        if canary is not None:
            manifest.canary.CopyFrom(canary)
        try:
            check_consistent(manifest, max(payload_size, 1))
        except UpdateRejected as exc:
            raise BundleError(f"the manifest would be rejected: {exc.message}") from exc
        signed = sign(manifest, private_keys)
        write_bundle(signed, payload, out)
    finally:
        payload.unlink(missing_ok=True)
    log.info(
        "bundle %s: %s v%d (%s), payload %d bytes, signed by %s",
        out,
        manifest.model_name,
        manifest.version,
        manifest.update_id,
        payload_size,
        ", ".join(s.key_id for s in signed.signatures),
    )
    return signed


# ----------------------------------------------------------------------------- read


def _read_dir(path: Path) -> tuple[bytes, Payload]:
    mpath, ppath = path / MANIFEST_MEMBER, path / PAYLOAD_MEMBER
    for p in (mpath, ppath):
        if not p.is_file():
            raise BundleError(
                f"{path}: a bundle directory needs {MANIFEST_MEMBER} and "
                f"{PAYLOAD_MEMBER}; {p.name} is missing"
            )
    if mpath.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{mpath}: larger than {MAX_MANIFEST_BYTES} bytes")
    return mpath.read_bytes(), Payload(ppath, 0, ppath.stat().st_size)


def _read_tar(path: Path) -> tuple[bytes, Payload]:
    try:
        with tarfile.open(path, mode="r:") as tar:
            members = tar.getmembers()
            names = [m.name for m in members]
            if names != [MANIFEST_MEMBER, PAYLOAD_MEMBER]:
                raise BundleError(
                    f"{path}: a bundle holds {MANIFEST_MEMBER} then {PAYLOAD_MEMBER}, "
                    f"this one holds {names}"
                )
            man, pay = members
            if not (man.isfile() and pay.isfile()):
                raise BundleError(f"{path}: bundle members must be regular files")
            if man.size > MAX_MANIFEST_BYTES:
                raise BundleError(f"{path}: {MANIFEST_MEMBER} is larger than {MAX_MANIFEST_BYTES}")
            f: IO[bytes] | None = tar.extractfile(man)
            if f is None:
                raise BundleError(f"{path}: cannot read {MANIFEST_MEMBER}")
            data = f.read()
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{path}: not a readable bundle (uncompressed tar): {exc}") from exc
    return data, Payload(path, pay.offset_data, pay.size)


def read_bundle(path: Path) -> tuple[opb.SignedManifest, Payload]:
    """The signed manifest (not verified: see `manifest.verify`) and where the payload is."""
    data, payload = _read_dir(path) if path.is_dir() else _read_tar(path)
    try:
        signed = parse_signed(data)
    except UpdateRejected as exc:
        raise BundleError(f"{path}: {MANIFEST_MEMBER}: {exc.message}") from exc
    return signed, payload
