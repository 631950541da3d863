"""Model-aware update deltas (``ea-delta-1``): make them, read their header, apply them. A
`.tflite` is diffed per tensor buffer, so a fine-tune's delta holds only what changed; applying
checks every sha256 and moves outputs into place only when all checked out. The container:
`agent.ota.delta.format`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from agent.base.fsutil import TEMP_SUFFIX, atomic_write
from agent.model.directory import sha256_file
from agent.ota.delta.apply import apply_ops
from agent.ota.delta.diff import DEFAULT_LEVEL, Counts, OpWriter, diff_regions, diff_whole
from agent.ota.delta.format import (
    END_MAGIC,
    FORMAT,
    DeltaEntry,
    DeltaError,
    HashingReader,
    check_trailer,
    decode_header,
    encode_header,
)
from agent.ota.delta.regions import Region, tflite_regions

__all__ = [
    "DEFAULT_LEVEL",
    "FORMAT",
    "DeltaEntry",
    "DeltaError",
    "DeltaStats",
    "diff_dirs",
    "diff_file",
    "patch_dirs",
    "patch_file",
    "read_header",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeltaStats:
    """What a delta holds: target bytes by the kind of op that produces them."""

    files: int
    target_bytes: int
    delta_bytes: int
    copied_bytes: int  # COPY: taken from the base file as is
    data_bytes: int  # DATA: carried compressed
    patched_bytes: int  # PATCH and ADD: encoded against a base region
    ops: int = 0


# ----------------------------------------------------------------------------- making


@dataclass(frozen=True, slots=True)
class _Pair:
    name: str
    new: Path
    base: Path | None


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield m
        finally:
            m.close()


def _write_atomic(out: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `out` through a temp file beside it, renamed into place when `write` returns."""
    atomic_write(out, write, mode=0o644)


def _plan(pair: _Pair) -> tuple[DeltaEntry, list[Region] | None, list[Region] | None]:
    sha, size = sha256_file(pair.new), pair.new.stat().st_size
    if pair.base is None:
        return DeltaEntry(pair.name, sha, size, "", method="generic"), None, None
    base_sha = sha256_file(pair.base)
    entry = DeltaEntry(
        pair.name, sha, size, base_sha, pair.base.name, pair.base.stat().st_size, "generic"
    )
    if base_sha == sha:
        return replace(entry, method="same"), None, None
    if pair.new.suffix == ".tflite":
        with _mapped(pair.new) as new, _mapped(pair.base) as base:
            new_regions = tflite_regions(new, str(pair.new))
            base_regions = tflite_regions(base, str(pair.base))
        if new_regions is not None and base_regions is not None:
            return replace(entry, method="tflite"), new_regions, base_regions
    return entry, None, None


def _diff(pairs: list[_Pair], out: Path, level: int) -> DeltaStats:
    plans = [_plan(p) for p in pairs]
    head = encode_header([e for e, _, _ in plans])
    total = Counts()

    def write(f: IO[bytes]) -> None:
        sha = hashlib.sha256(head)
        f.write(head)
        for pair, (entry, new_regions, base_regions) in zip(pairs, plans, strict=True):
            with _mapped(pair.new) as new:
                w = OpWriter(f, sha, new, level)
                if entry.method == "same":
                    w.copy(0, entry.size)
                    w.end()
                elif pair.base is None:
                    diff_whole(w, new, None)
                else:
                    with _mapped(pair.base) as base:
                        if new_regions is not None and base_regions is not None:
                            diff_regions(w, new, base, new_regions, base_regions)
                        else:
                            diff_whole(w, new, base)
            c = w.counts
            log.info(
                "delta %s (%s from %s): copy %d, data %d, patch %d bytes in %d ops",
                entry.name, entry.method, entry.base_name or "nothing",
                c.copied, c.data, c.patched, c.ops,
            )  # fmt: skip
            total.copied += c.copied
            total.data += c.data
            total.patched += c.patched
            total.ops += c.ops
        f.write(END_MAGIC)
        sha.update(END_MAGIC)
        f.write(sha.digest())

    _write_atomic(out, write)
    return DeltaStats(
        files=len(pairs),
        target_bytes=sum(e.size for e, _, _ in plans),
        delta_bytes=out.stat().st_size,
        copied_bytes=total.copied,
        data_bytes=total.data,
        patched_bytes=total.patched,
        ops=total.ops,
    )


def _files(directory: Path) -> dict[str, Path]:
    if not directory.is_dir():
        raise DeltaError(f"{directory}: not a directory")
    return {
        p.name: p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".")
    }


def _pick_base(name: str, new: Path, bases: dict[str, Path]) -> Path | None:
    """The base file of the same name; else one with the same content; else, for a renamed
    file, the base file of the same suffix closest in size (None if there is none)."""
    if name in bases:
        return bases[name]
    sha = sha256_file(new)
    same = [p for p in bases.values() if p.stat().st_size == new.stat().st_size]
    for p in same:
        if sha256_file(p) == sha:
            return p
    size = new.stat().st_size
    kin = [p for p in bases.values() if p.suffix == new.suffix]
    return min(kin, key=lambda p: abs(p.stat().st_size - size), default=None)


def diff_dirs(base: Path, new: Path, out: Path, *, level: int = DEFAULT_LEVEL) -> DeltaStats:
    """Write to `out` a delta that rebuilds every file of model directory `new` from `base`.

    Files only in `base` are not carried. `level` is the zstd level (1-22).

    A delta rebuilds every file of a new model directory from the files of a base one. A `.tflite`
    is diffed per tensor buffer: unchanged buffers (matched by content, wherever they moved) are
    COPYs of the base file, changed ones are zstd DATA, or encoded against the base buffer of the
    same tensor (PATCH: zstd with the base buffer as dictionary; ADD: the byte-wise difference, tiny
    when a fine-tune nudges int8 weights), whichever is smallest. Other files (tokenizer, metadata)
    and `.tflite` files that do not parse are diffed whole the same way. Applying streams (see
    `agent.ota.delta.apply`), checks the base's sha256 before use and each rebuilt file's size and
    sha256, and renames the outputs into place only when everything checked out. The container
    layout is in `agent.ota.delta.format`.
    """
    bases = _files(base)
    pairs = [_Pair(n, p, _pick_base(n, p, bases)) for n, p in _files(new).items()]
    if not pairs:
        raise DeltaError(f"{new}: no files to carry")
    return _diff(pairs, out, level)


def diff_file(base: Path, new: Path, out: Path, *, level: int = DEFAULT_LEVEL) -> DeltaStats:
    """Write to `out` a one-entry delta that rebuilds file `new` from file `base`."""
    for p in (base, new):
        if not p.is_file():
            raise DeltaError(f"{p}: not a file")
    return _diff([_Pair(new.name, new, base)], out, level)


# ----------------------------------------------------------------------------- applying


def read_header(delta: Path) -> list[DeltaEntry]:
    """The files a delta rebuilds (name, sha256, size, base sha256...), without applying it."""
    try:
        with open(delta, "rb") as f:
            return decode_header(f)
    except OSError as exc:
        raise DeltaError(f"{delta}: cannot read: {exc}") from exc
    except DeltaError as exc:
        raise DeltaError(f"{delta}: {exc}") from exc


def _check_base(entry: DeltaEntry, base: Path | None) -> None:
    if not entry.base_sha256:
        return
    if base is None or not base.is_file():
        raise DeltaError(f"{entry.name}: base file {entry.base_name} is missing ({base})")
    size = base.stat().st_size
    actual = sha256_file(base)
    if actual != entry.base_sha256 or size != entry.base_size:
        raise DeltaError(
            f"{entry.name}: base {base} has sha256 {actual[:16]}… ({size} bytes), the delta "
            f"expects {entry.base_sha256[:16]}… ({entry.base_size} bytes)"
        )


def _remove(temps: list[tuple[str, Path]]) -> None:
    for tmp, _ in temps:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _apply(
    delta: Path,
    base_of: Callable[[DeltaEntry], Path | None],
    target_of: Callable[[DeltaEntry], Path],
) -> list[tuple[str, str, int]]:
    """Apply every entry of `delta` in one sequential read; the outputs are renamed into place
    only when every file and the whole-delta checksum are verified (else none is left)."""
    temps: list[tuple[str, Path]] = []
    done: list[tuple[str, str, int]] = []
    try:
        with open(delta, "rb") as raw:
            r = HashingReader(raw)
            for entry in decode_header(r):
                base = base_of(entry) if entry.base_sha256 else None
                _check_base(entry, base)
                target = target_of(entry)
                fd, tmp = tempfile.mkstemp(
                    prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent
                )
                temps.append((tmp, target))
                with os.fdopen(fd, "wb") as f, contextlib.ExitStack() as stack:
                    bf = stack.enter_context(open(base, "rb")) if base is not None else None
                    apply_ops(r, entry, bf, f)
                    f.flush()
                    os.fsync(f.fileno())
                done.append((entry.name, entry.sha256, entry.size))
            check_trailer(r, raw)
        for tmp, target in temps:
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
    except (OSError, DeltaError) as exc:
        _remove(temps)
        raise DeltaError(f"{delta}: {exc}") from exc
    except BaseException:
        _remove(temps)
        raise
    _fsync_dir(temps[0][1].parent if temps else delta.parent)
    for name, _, size in done:
        log.info("patched %s (%d bytes) from %s", name, size, delta.name)
    return done


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def patch_file(base: Path, delta: Path, out: Path) -> None:
    """Rebuild the one file of a one-entry delta from `base` into `out` (verified, atomic)."""
    entries = read_header(delta)
    if len(entries) != 1:
        raise DeltaError(f"{delta}: holds {len(entries)} files; use patch_dirs for a directory")
    _apply(delta, lambda e: base, lambda e: out)


def patch_dirs(base: Path, delta: Path, out_dir: Path) -> list[tuple[str, str, int]]:
    """Rebuild every file of `delta` from the files of directory `base` into `out_dir` (which
    must not exist or be empty). Returns (name, sha256, size) per file, all verified; on any
    error nothing is left in `out_dir` (and a directory created here is removed)."""
    created = not out_dir.exists()
    if not created and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DeltaError(f"{out_dir}: the output directory must not exist or be empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _apply(delta, lambda e: base / e.base_name, lambda e: out_dir / e.name)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise
