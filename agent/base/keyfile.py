"""Key files: a bearer key read from a file's first line, and what is wrong with a key file's
permissions. The daemon's HTTP API (`http.key_file`), the clients' own keys
(`agent.api.identity`) and the operator's web console (`--console-key-file`) share them.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from agent.base.errors import HostError

log = logging.getLogger(__name__)


def loose_key_file(path: Path, *, group_may_read: bool = True) -> str | None:
    """What is wrong with a key file's permissions, or None. Others (neither the owner nor
    the file's group) must have no access, and the group may read (the daemon's bearer key:
    a group is how it is shared with the apps that use it) or nothing (`group_may_read`
    False: a client's own key). "Others" is every user on the board.

    A warning, not a refusal (docs/API.md "Keys"): the key guards a loopback listener that
    the Host/Origin checks already keep browsers off, and a daemon that refuses to start over
    a provisioning slip serves nobody, gRPC included, on every board that has it."""
    mode = os.stat(path).st_mode
    if mode & stat.S_IRWXO:
        return (
            f"mode {stat.S_IMODE(mode):04o}: every user on this machine can "
            f"{'read' if mode & stat.S_IROTH else 'change'} the key (chmod o-rwx {path})"
        )
    group = stat.S_IWGRP | stat.S_IXGRP | (0 if group_may_read else stat.S_IRGRP)
    if mode & group:
        fix = "g-wx" if group_may_read else "g-rwx"
        return f"mode {stat.S_IMODE(mode):04o}: its group has access (chmod {fix} {path})"
    return None


def read_key(path: Path, setting: str = "http.key_file") -> str:
    """The bearer key: the file's first line, which must not be empty. A file that others
    (not the owner or its group) may read or write is served with a warning
    (`loose_key_file`)."""
    try:
        loose = loose_key_file(path)
        key = path.read_text().strip()
    except OSError as exc:
        raise HostError(f"{setting} {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise HostError(f"{setting} {path}: not text ({exc.reason})") from exc
    if not key or "\n" in key:
        raise HostError(f"{setting} {path}: must hold the key on one line, and not be empty")
    if loose:
        log.warning("%s %s: %s", setting, path, loose)
    return key
