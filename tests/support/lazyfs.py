"""A power-cut filesystem for the tests: a FUSE passthrough to a backing directory that keeps
what was not fsync'd apart, so that `LazyFS.cut` can drop it as a power cut does.

Modelled on LazyFS (a FUSE filesystem that keeps un-synced writes in its own page cache and
drops them on request), with directory entries too:

- a file's data is durable as of its last ``fsync``/``fdatasync``: before the first write (or
  truncation) after a sync, its synced content is saved in memory; `cut` writes it back;
- a directory's entries (create, mkdir, rename, unlink, rmdir, symlink) are durable as of the
  directory's last ``fsync``: `cut` rebuilds the tree from those durable entries only, so a new
  name whose directory was never synced disappears, a rename without its directory's sync is
  undone, an unlinked name comes back. A created file whose entry is durable but whose data
  never was comes back empty (the classic zero-length file after a crash).
- metadata (modes, times, owners) is passed through and not modelled.

Unlinked files and replaced rename targets are moved to a graveyard beside the backing
directory instead of being deleted, so that their inode numbers (the identity this model keys
on) are not reused before a cut can bring them back.

`fail_after(n)` makes the machine "lose power" at a boundary: the first `n` boundary operations
(fsync, fsyncdir, create, mkdir, rename, unlink, rmdir, symlink) run, and from the next one on
every operation fails with EIO, so that nothing the process does after that point reaches the
disk; `cut` then drops what was not durable and the mount works again (a reboot). Record a
sequence's boundaries with `boundaries`, then replay it once per cut point.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import mfusepy

F = TypeVar("F", bound=Callable[..., Any])

_STAT_KEYS = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_blocks", "st_blksize")


def _op(boundary: bool = False) -> Callable[[F], F]:
    """One FUSE operation: serialized, refused with EIO once the power is off, counted when it
    is a boundary."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: LazyFS, *args: Any) -> Any:
            with self._lock:
                if boundary:
                    self._boundary(f"{method.__name__} {args[0]}")
                if self.dead:
                    raise mfusepy.FuseOSError(errno.EIO)
                return method(self, *args)

        return run  # type: ignore[return-value]

    return wrap


class LazyFS(mfusepy.Operations):  # type: ignore[misc]
    """The operations; `mounted` mounts one. See the module docstring for the model."""

    use_ns = True

    def __init__(self, backing: Path) -> None:
        self.backing = backing
        self.grave = backing.with_name(f".{backing.name}.graveyard")
        self._lock = threading.RLock()
        self._handles: dict[int, int] = {}  # fh -> backing fd
        self._next_fh = itertools.count(1)
        self._saved: dict[int, bytes] = {}  # ino -> synced content of a file written since
        self._dirs: dict[int, dict[str, int]] = {}  # dir ino -> its durable entries (name -> ino)
        self._grave_names = itertools.count()
        self.boundaries = 0  # boundary operations run since the last `fail_after` or `cut`
        self.trace: list[str] = []  # those operations and their paths
        self.syncs = 0  # fsync and fsyncdir calls among them
        self._limit: int | None = None
        self.dead = False
        self.off_at: str | None = None  # the boundary the power went off before
        # called (on the FUSE thread, before the refused operation answers) when the power goes
        # off: a test kills its processes there, as a power cut stops them, before they see EIO
        self.on_power_off: Callable[[str], None] | None = None
        # `cut` keeps every directory entry, synced or not, and drops only unsynced data: a
        # filesystem that commits names before data (ext4 data=writeback, a journal commit
        # between a rename and the data's sync), where a name may outlive its content
        self.names_first = False
        backing.mkdir(parents=True, exist_ok=True)
        self._snapshot()

    # ------------------------------------------------------------------ the test's controls

    def fail_after(self, n: int | None) -> None:
        """Lose power before the (n+1)-th boundary operation from now (None: never)."""
        with self._lock:
            self.boundaries = self.syncs = 0
            self.trace = []
            self._limit = n
            self.off_at = None

    def sync(self) -> None:
        """Make everything durable (``sync(2)``)."""
        with self._lock:
            self._snapshot()

    def cut(self) -> None:
        """The power cut and the reboot: drop every write and directory entry not synced,
        close every open file (the processes died), power on again."""
        with self._lock:
            for fd in self._handles.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._handles.clear()
            if self.names_first:
                for top, dirs, files in os.walk(self.backing):
                    names = {n: os.lstat(os.path.join(top, n)).st_ino for n in dirs + files}
                    self._dirs[os.lstat(top).st_ino] = names
            where = self._where()
            for ino, data in self._saved.items():
                if ino in where:
                    with open(where[ino], "r+b") as f:
                        f.truncate(0)
                        f.write(data)
            fresh = self.backing.with_name(f".{self.backing.name}.cut")
            shutil.rmtree(fresh, ignore_errors=True)
            self._build(os.lstat(self.backing).st_ino, fresh, where, set())
            os.rename(self.backing, self.grave / "old-root")
            os.rename(fresh, self.backing)
            self._snapshot()
            self._limit = None
            self.dead = False
            self.off_at = None
            self.boundaries = self.syncs = 0
            self.trace = []

    # ------------------------------------------------------------------ the model

    def _boundary(self, what: str) -> None:
        if self._limit is not None and self.boundaries >= self._limit and not self.dead:
            self.dead = True
            self.off_at = what
            if self.on_power_off is not None:
                self.on_power_off(what)
        if not self.dead:
            self.boundaries += 1
            self.trace.append(what)

    def _real(self, path: str) -> str:
        return str(self.backing) + path

    def _snapshot(self) -> None:
        """Everything on the backing directory is durable now."""
        self._saved.clear()
        self._dirs.clear()
        for top, _dirs, files in os.walk(self.backing):
            entries = {name: os.lstat(os.path.join(top, name)).st_ino for name in _dirs + files}
            self._dirs[os.lstat(top).st_ino] = entries
        shutil.rmtree(self.grave, ignore_errors=True)
        self.grave.mkdir()

    def _where(self) -> dict[int, str]:
        """Where each inode is now, in the tree or in the graveyard."""
        where: dict[int, str] = {}
        for root in (self.backing, self.grave):
            for top, dirs, files in os.walk(root):
                for name in [*dirs, *files]:
                    path = os.path.join(top, name)
                    where.setdefault(os.lstat(path).st_ino, path)
        return where

    def _build(self, ino: int, dest: Path, where: dict[int, str], moved: set[int]) -> None:
        """Make directory `dest` hold the durable entries of directory `ino`."""
        dest.mkdir()
        if ino in where:
            os.chmod(dest, stat.S_IMODE(os.lstat(where[ino]).st_mode))
        for name, child in self._dirs.get(ino, {}).items():
            if child in self._dirs:
                self._build(child, dest / name, where, moved)
            elif child not in where:
                continue  # cannot happen: unlinked files wait in the graveyard
            elif child in moved:  # durable under two names (a rename synced on both sides)
                if os.path.islink(where[child]):
                    os.symlink(os.readlink(where[child]), dest / name)
                else:
                    shutil.copy2(where[child], dest / name)
            else:
                os.rename(where[child], dest / name)
                where[child] = str(dest / name)
                moved.add(child)

    def _save(self, fd: int) -> None:
        """Keep the synced content of the file open as `fd` before it changes."""
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_ino not in self._saved:
            chunks, offset = [], 0
            while chunk := os.pread(fd, 1 << 20, offset):
                chunks.append(chunk)
                offset += len(chunk)
            self._saved[st.st_ino] = b"".join(chunks)

    def _bury(self, real: str) -> None:
        os.rename(real, self.grave / str(next(self._grave_names)))

    def _fd(self, fh: int) -> int:
        try:
            return self._handles[fh]
        except KeyError:  # opened before a cut
            raise mfusepy.FuseOSError(errno.EIO) from None

    def _handle(self, fd: int) -> int:
        fh = next(self._next_fh)
        self._handles[fh] = fd
        return fh

    # ------------------------------------------------------------------ operations

    @_op()
    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        st = os.fstat(self._fd(fh)) if fh is not None else os.lstat(self._real(path or "/"))
        attrs: dict[str, Any] = {key: getattr(st, key) for key in _STAT_KEYS}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    @_op()
    def access(self, path: str, amode: int) -> int:
        if not os.path.lexists(self._real(path)):
            raise mfusepy.FuseOSError(errno.ENOENT)
        return 0

    @_op()
    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self.backing)
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        return {key: getattr(sv, key) for key in (*keys, "f_favail", "f_namemax")}

    @_op()
    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    @_op()
    def opendir(self, path: str) -> int:
        return self._handle(os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY))

    @_op()
    def readdir(self, path: str | None, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._fd(fh))]

    @_op()
    def releasedir(self, path: str | None, fh: int) -> int:
        fd = self._handles.pop(fh, None)
        if fd is not None:
            os.close(fd)
        return 0

    @_op(boundary=True)
    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        fd = self._fd(fh)
        os.fsync(fd)
        entries = {name: os.lstat(name, dir_fd=fd).st_ino for name in os.listdir(fd)}
        self._dirs[os.fstat(fd).st_ino] = entries
        self.syncs += 1
        return 0

    @_op()
    def open(self, path: str, flags: int) -> int:
        # read-write whatever the caller asked: the synced content is read before a write
        trunc = flags & os.O_TRUNC
        flags = (flags & ~(os.O_ACCMODE | os.O_TRUNC | os.O_CREAT | os.O_EXCL)) | os.O_RDWR
        fd = os.open(self._real(path), flags)
        if trunc:  # with atomic O_TRUNC the kernel leaves the truncation to the open
            self._save(fd)
            os.ftruncate(fd, 0)
        return self._handle(fd)

    @_op(boundary=True)
    def create(self, path: str, mode: int, flags: int = 0) -> int:
        real = self._real(path)
        existed = os.path.lexists(real)
        flags = (flags & ~(os.O_ACCMODE | os.O_TRUNC)) | os.O_RDWR | os.O_CREAT
        fd = os.open(real, flags, mode)
        if not existed:
            self._saved[os.fstat(fd).st_ino] = b""  # durable: an empty file, once named
        return self._handle(fd)

    @_op()
    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return os.pread(self._fd(fh), size, offset)

    @_op()
    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        fd = self._fd(fh)
        self._save(fd)
        return os.pwrite(fd, data, offset)

    @_op()
    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        if fh is not None:
            fd = self._fd(fh)
            self._save(fd)
            os.ftruncate(fd, length)
            return 0
        fd = os.open(self._real(path or "/"), os.O_RDWR)
        try:
            self._save(fd)
            os.ftruncate(fd, length)
        finally:
            os.close(fd)
        return 0

    @_op()
    def flush(self, path: str | None, fh: int) -> int:
        return 0

    @_op()
    def release(self, path: str | None, fh: int) -> int:
        fd = self._handles.pop(fh, None)
        if fd is not None:
            os.close(fd)
        return 0

    @_op(boundary=True)
    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        fd = self._fd(fh)
        os.fsync(fd)
        self._saved.pop(os.fstat(fd).st_ino, None)
        self.syncs += 1
        return 0

    @_op(boundary=True)
    def mkdir(self, path: str, mode: int) -> int:
        real = self._real(path)
        os.mkdir(real, mode)
        self._dirs[os.lstat(real).st_ino] = {}  # durable: empty, once named
        return 0

    @_op(boundary=True)
    def symlink(self, target: str, source: str) -> int:
        os.symlink(source, self._real(target))
        return 0

    @_op(boundary=True)
    def unlink(self, path: str) -> int:
        real = self._real(path)
        if stat.S_ISDIR(os.lstat(real).st_mode):
            raise mfusepy.FuseOSError(errno.EISDIR)
        self._bury(real)
        return 0

    @_op(boundary=True)
    def rmdir(self, path: str) -> int:
        real = self._real(path)
        if os.listdir(real):
            raise mfusepy.FuseOSError(errno.ENOTEMPTY)
        self._bury(real)
        return 0

    @_op(boundary=True)
    def rename(self, old: str, new: str) -> int:
        src, dst = self._real(old), self._real(new)
        src_st = os.lstat(src)
        with contextlib.suppress(FileNotFoundError):
            dst_st = os.lstat(dst)
            if dst_st.st_ino == src_st.st_ino:
                return 0
            if stat.S_ISDIR(dst_st.st_mode) != stat.S_ISDIR(src_st.st_mode):
                raise mfusepy.FuseOSError(
                    errno.EISDIR if stat.S_ISDIR(dst_st.st_mode) else errno.ENOTDIR
                )
            if stat.S_ISDIR(dst_st.st_mode) and os.listdir(dst):
                raise mfusepy.FuseOSError(errno.ENOTEMPTY)
            self._bury(dst)  # the replaced file: it comes back if the rename is not synced
        os.rename(src, dst)
        return 0

    @_op()
    def chmod(self, path: str | None, mode: int) -> int:
        os.chmod(self._real(path or "/"), mode)
        return 0

    @_op()
    def chown(self, path: str | None, uid: int, gid: int) -> int:
        os.chown(self._real(path or "/"), uid, gid)
        return 0

    @_op()
    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        real = self._real(path or "/")
        if times is None:
            os.utime(real)
        else:
            os.utime(real, ns=times)
        return 0

    @_op()
    def link(self, target: str, source: str) -> int:
        raise mfusepy.FuseOSError(errno.EPERM)  # hard links are not modelled


@contextlib.contextmanager
def mounted(workdir: Path) -> Iterator[tuple[LazyFS, Path]]:
    """Mount a `LazyFS` of ``workdir/disk`` on ``workdir/mnt``; yield it and the mount point.
    Needs root (or fuse3's fusermount3) and /dev/fuse."""
    mnt = workdir / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    fs = LazyFS(workdir / "disk")
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            mfusepy.FUSE(
                fs,
                str(mnt),
                foreground=True,
                nothreads=True,
                fsname="lazyfs",
                hard_remove=True,  # an unlinked open file keeps working through its handle
                entry_timeout="0",  # nothing cached in the kernel: a cut shows at once
                attr_timeout="0",
                negative_timeout="0",
            )
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=serve, name="lazyfs", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt):
        if failed or not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"lazyfs did not mount on {mnt}: {failed or 'timed out'}")
        time.sleep(0.01)
    try:
        yield fs, mnt
    finally:
        fs.fail_after(None)
        fs.dead = False
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        thread.join(30)


def every_cut(
    fs: LazyFS,
    mnt: Path,
    setup: Callable[[Path], None],
    operation: Callable[[Path, list[Any]], None],
    check: Callable[[Path, list[Any], str], None],
) -> int:
    """Replay `operation` with a power cut at each of its boundaries; the number of cut points.

    `setup(mnt)` builds the state before the operation (made durable); `operation(mnt, done)`
    appends to `done` what it has seen acknowledged (a call that returned while the power was
    on); after the cut `check(mnt, done, where)` re-opens the state as a boot does and checks
    it, `where` naming the cut point for messages. An exception from `operation` is expected
    only once the power is off.
    """

    def fresh() -> None:
        fs.fail_after(None)
        for child in list(mnt.iterdir()):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        setup(mnt)
        fs.sync()

    fresh()
    fs.fail_after(None)
    operation(mnt, [])
    points = list(fs.trace)
    for k in range(len(points) + 1):
        fresh()
        fs.fail_after(k)
        done: list[Any] = []
        try:
            operation(mnt, done)
        except Exception:
            if not fs.dead:
                raise
        fs.cut()
        where = f"cut before {points[k]!r} (boundary {k})" if k < len(points) else "cut at the end"
        check(mnt, done, where)
    return len(points) + 1
