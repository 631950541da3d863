"""Who owns a session: an opaque client key, sent as gRPC metadata and hashed by the server.

grpcio does not expose the peer credentials (SO_PEERCRED) of a unix-socket client — its auth
context is empty for UDS (grpc/grpc#15511, #28755) — so the agent cannot learn the caller's
uid. Instead each client sends a secret key of its own in the `edge-agent-client` metadata
entry; the server turns it into an owner with `owner_of` (a truncated sha256), so keys never
reach logs, the engine or state files. No key means the anonymous owner "", one namespace
shared by every client that sends none.

This keeps cooperating apps out of each other's conversations (by mistake or by guessing ids);
it is not identity the kernel vouches for: a process that can read another's key can act as it.
Who may connect at all stays with the socket's file permissions.

The command-line client keeps its key in a per-user file (`default_key_path`), created 0600 on
first use; `--client-key` or `EDGE_AGENT_CLIENT_KEY` override it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from agent.base.errors import ConfigError, InvalidRequest
from agent.base.keyfile import loose_key_file

log = logging.getLogger(__name__)

METADATA_KEY = "edge-agent-client"
KEY_ENV = "EDGE_AGENT_CLIENT_KEY"
OWNER_HEX = 32  # 128 bits of the sha256: collisions between local clients are not a concern
MAX_KEY_CHARS = 1024


def owner_of(key: str) -> str:
    """The session owner for a client key ("" for no key: the anonymous, shared namespace)."""
    if not key:
        return ""
    return hashlib.sha256(key.encode()).hexdigest()[:OWNER_HEX]


def key_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The client key in a call's invocation metadata ("" when there is none)."""
    for name, value in metadata or ():
        if name == METADATA_KEY:
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return ""


def check_key(key: str) -> str:
    """A key that can travel as a gRPC metadata value: printable ASCII, bounded."""
    if not key or len(key) > MAX_KEY_CHARS or not (key.isascii() and key.isprintable()):
        raise InvalidRequest(
            f"a client key must be 1 to {MAX_KEY_CHARS} printable ASCII characters"
        )
    return key


def default_key_path() -> Path:
    """`$XDG_CONFIG_HOME/edge-agent/client-key` (default `~/.config/...`).

    A config directory rather than `$XDG_RUNTIME_DIR`: sessions saved to disk outlive a reboot,
    and a key that changed at the next login would orphan them.
    """
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "edge-agent" / "client-key"


def load_or_create_key(path: Path) -> str:
    """The key stored at `path`; a new random one (mode 0600, directory 0700) if absent.

    Creation is atomic (write a temporary file, hard-link it into place), so two clients
    starting at once end up with the same key.
    """
    with contextlib.suppress(FileNotFoundError):
        key = check_key(path.read_text().strip())
        loose = loose_key_file(path, group_may_read=False)
        if loose:
            log.warning("client key %s: %s", path, loose)
        return key
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another client won the race: use its key
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return check_key(path.read_text().strip())


def resolve_key(explicit: str | None) -> str:
    """The command-line client's key: `--client-key`, else the environment, else the file."""
    if explicit is not None:
        return check_key(explicit)
    env = os.environ.get(KEY_ENV)
    if env:
        return check_key(env)
    path = default_key_path()
    try:
        return load_or_create_key(path)
    except OSError as exc:
        raise ConfigError(
            str(path),
            "<file>",
            exc.strerror or str(exc),
            f"a readable key file in a writable directory, or --client-key / {KEY_ENV}",
        ) from exc
