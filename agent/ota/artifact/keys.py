"""Ed25519 key files for signing model updates and the device's pinned trusted keys. A device
trusts every ``*.pub`` in its keys directory, which is how a key is rotated (docs/UPDATES.md).
The file formats: `parse_public`, `load_trusted`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.base.errors import AgentError

log = logging.getLogger(__name__)

DEFAULT_KEYS_DIR = Path("/etc/edge-agent/keys")
KEY_TYPE = "ed25519"
PUBLIC_SUFFIX = ".pub"
PRIVATE_SUFFIX = ".key"


class KeyFileError(AgentError):
    """A key file cannot be written, read or parsed; the message names the file."""


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: Ed25519PublicKey) -> str:
    """First 16 hex digits of sha256 of the raw 32-byte public key."""
    return hashlib.sha256(_raw(public_key)).hexdigest()[:16]


def public_line(public_key: Ed25519PublicKey, comment: str = "") -> str:
    """The one-line text form of a public key (with a trailing newline)."""
    b64 = base64.b64encode(_raw(public_key)).decode("ascii")
    comment = " ".join(comment.split())  # one line, no stray whitespace
    return f"{KEY_TYPE} {b64} {comment}".rstrip() + "\n"


def parse_public(text: str, where: str) -> Ed25519PublicKey:
    """Parse the text of a ``.pub`` file; `where` names it in errors.

    * Private key: PEM, PKCS#8, unencrypted, mode 0600 (``NAME.key``). Keep it off the devices.
    * Public key: one line of text (``NAME.pub``)::

          ed25519 <base64 of the raw 32-byte key> <comment>

      Lines that are empty or start with ``#`` are ignored; exactly one key line per file.
    * Key id: the first 16 hex digits of sha256 of the raw 32-byte public key; signatures name the
      key they were made with by this id.
    """
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(lines) != 1:
        raise KeyFileError(
            f"{where}: expected one line '{KEY_TYPE} <base64 key> [comment]', found {len(lines)}"
        )
    parts = lines[0].split(maxsplit=2)
    if len(parts) < 2 or parts[0] != KEY_TYPE:
        raise KeyFileError(f"{where}: expected '{KEY_TYPE} <base64 key> [comment]'")
    try:
        raw = base64.b64decode(parts[1], validate=True)
    except binascii.Error as exc:
        raise KeyFileError(f"{where}: the key is not valid base64") from exc
    if len(raw) != 32:
        raise KeyFileError(f"{where}: an Ed25519 public key is 32 bytes, this one is {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def load_public(path: Path) -> Ed25519PublicKey:
    """Read one ``.pub`` file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read public key: {exc}") from exc
    return parse_public(text, str(path))


def load_private(path: Path) -> Ed25519PrivateKey:
    """Read a PEM PKCS#8 Ed25519 private key (unencrypted)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read private key: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{path}: not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: not an Ed25519 key ({type(key).__name__})")
    return key


def _write_new(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as exc:
        raise KeyFileError(f"{path}: already exists; not overwriting a key") from exc
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot create: {exc}") from exc
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits away; set exactly what we mean
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def generate(private_path: Path, public_path: Path, comment: str = "") -> str:
    """Write a new key pair; refuses to overwrite either file. Returns the key id."""
    for p in (private_path, public_path):
        if p.exists() or p.is_symlink():
            raise KeyFileError(f"{p}: already exists; not overwriting a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_new(private_path, pem, 0o600)
    pub = key.public_key()
    _write_new(public_path, public_line(pub, comment).encode("ascii"), 0o644)
    kid = key_id(pub)
    log.info("generated key %s: %s, %s", kid, private_path, public_path)
    return kid


def load_trusted(directory: Path = DEFAULT_KEYS_DIR) -> dict[str, Ed25519PublicKey]:
    """Every ``*.pub`` in `directory`, by key id.

    A missing or empty directory gives no keys (every update is then rejected as not signed by
    a trusted key); a malformed file is an error naming it.

    The device trusts every ``*.pub`` in its keys directory (default ``/etc/edge-agent/keys``). Two
    or more files may be there at once, which is how a key is rotated: ship the new public key, sign
    with both for a while, then remove the old one.
    """
    if not directory.is_dir():
        if directory.exists():
            raise KeyFileError(f"{directory}: trusted keys path is not a directory")
        log.warning("no trusted update keys: %s does not exist", directory)
        return {}
    trusted: dict[str, Ed25519PublicKey] = {}
    for path in sorted(directory.glob(f"*{PUBLIC_SUFFIX}")):
        key = load_public(path)
        trusted[key_id(key)] = key
    if not trusted:
        log.warning("no trusted update keys: no *%s file in %s", PUBLIC_SUFFIX, directory)
    return trusted
