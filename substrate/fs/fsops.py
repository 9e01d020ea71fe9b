"""The one place that creates, fills, renames and removes beneath a held directory fd.

File-system primitives beneath a held directory fd: the one place that creates, renames
and removes beneath a dir fd (opening and resolving beneath one is `paths`'s).

Theory of operation. Every name is used relative to an open directory fd and opened
`O_NOFOLLOW`, so a symlink planted at a name is met, never followed:

- `make_dirs` opens a chain of directories beneath a dir fd one component at a time,
  making the missing ones `0700` first and then giving them their owner and exact mode
  through an fd of their own (the umask plays no part; no window with looser bits).
- A new file is created `O_CREAT | O_EXCL | O_NOFOLLOW` (`create_exclusive`: whatever
  already holds the name, a symlink included, makes it fail), filled, given its owner,
  mode and mtime, and fsynced (`fill`); `rename_into` renames it over its target within
  the same directory and fsyncs the directory. `atomic_write` is the three in a row with
  a random temp name; guarded writes and the gate's restores do the steps themselves
  because their temp files are recorded first (`substrate.workspace.writes.temp_files`).
  `rename_new` renames only onto a free name (`RENAME_NOREPLACE`: a file made since the
  check is never replaced); `make_durable` flushes many new files at once, one
  `syncfs(2)` per file system, where an fsync each would cost one flush per file.
- `read_fd`/`read_regular` read a whole file with a cap on what they hold, also when the
  file grows while it is read.
- `remove_tree` removes a directory with everything beneath it, iteratively, holding one
  directory fd whatever the depth (`climb` checks each way back up).

Everything here is blocking; callers run it in worker threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
from collections.abc import Callable, Sequence

from substrate.errors import TooLarge
from substrate.fs import paths

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: Read size of whole-file reads.
CHUNK = 1 << 20

#: (uid, gid) to give a file or directory; applied only when the daemon runs as root.
Owner = tuple[int, int]
#: (st_dev, st_ino): which directory an fd is, to check a way back up.
Identity = tuple[int, int]


# --- new files ------------------------------------------------------------------------------


def create_exclusive(dir_fd: int, name: str, *, mode: int = 0o600, read: bool = False) -> int:
    """Create the new file `name` in `dir_fd` and open it for writing (and reading with
    `read`). Raises FileExistsError when anything holds the name, a symlink included."""
    access = os.O_RDWR if read else os.O_WRONLY
    return os.open(name, _CREATE | access, mode, dir_fd=dir_fd)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` at the fd's offset (looping over short writes)."""
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])


def fill(
    fd: int,
    data: bytes,
    *,
    mode: int,
    owner: Owner | None = None,
    mtime_ns: int | None = None,
    fsync: bool = True,
) -> None:
    """Write `data` to the new file open as `fd`, then give it `owner` (only root may
    chown: skipped otherwise), exactly `mode` (after the chown, which clears set-id bits)
    and `mtime_ns`, and fsync it. Costs the write plus one fsync."""
    write_all(fd, data)
    if owner is not None and os.geteuid() == 0:
        os.fchown(fd, *owner)
    os.fchmod(fd, mode)
    if mtime_ns is not None:
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    if fsync:
        os.fsync(fd)


def write_new(
    dir_fd: int,
    name: str,
    data: bytes,
    *,
    mode: int,
    owner: Owner | None = None,
    mtime_ns: int | None = None,
    fsync: bool = True,
) -> None:
    """`create_exclusive` + `fill`; on any failure the half-made file is unlinked."""
    fd = create_exclusive(dir_fd, name)
    try:
        fill(fd, data, mode=mode, owner=owner, mtime_ns=mtime_ns, fsync=fsync)
    except BaseException:
        os.close(fd)
        unlink_quietly(dir_fd, name)
        raise
    os.close(fd)


def rename_into(dir_fd: int, temp: str, name: str, *, fsync: bool = True) -> None:
    """Rename `temp` over `name`, both in `dir_fd` (atomic: `name` is the old or the new
    file, never a mix), then fsync the directory so the rename survives a crash."""
    os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    if fsync:
        os.fsync(dir_fd)


_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_NOREPLACE = 1


def rename_new(dir_fd: int, temp: str, name: str) -> None:
    """Rename `temp` to `name` in `dir_fd` only if nothing holds `name`: `renameat2(2)`
    with `RENAME_NOREPLACE`, so a file the host made since the check is never replaced
    (FileExistsError). Where the file system or libc cannot (EINVAL), a plain rename
    after an lstat."""
    renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28 and later
    if renameat2 is None:
        err = errno.EINVAL
    elif renameat2(dir_fd, os.fsencode(temp), dir_fd, os.fsencode(name), _RENAME_NOREPLACE):
        err = ctypes.get_errno()
    else:
        return
    if err != errno.EINVAL:
        raise OSError(err, os.strerror(err), name)
    if paths.lstat_at(dir_fd, name) is not None:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), name)
    os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def make_durable(fds: Sequence[int]) -> None:
    """Flush what was written to files on the file systems of `fds` (open directories):
    one `syncfs(2)` per file system (a checkout may hold mounts). Costs one flush of
    each file system's dirty data."""
    by_dev: dict[int, int] = {}
    for fd in fds:
        by_dev.setdefault(os.fstat(fd).st_dev, fd)
    for fd in by_dev.values():
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


def atomic_write(
    dir_fd: int,
    name: str,
    data: bytes,
    *,
    mode: int,
    owner: Owner | None = None,
    mtime_ns: int | None = None,
    fsync: bool = True,
) -> None:
    """Replace (or create) `name` in `dir_fd` with `data` atomically, through a
    same-directory temp file `.tmp-<16 hex>` (for directories substrate owns: a
    workspace's temp files are recorded first instead, see `writes.temp_files`).
    With `fsync=False` nothing is fsynced (a cache that may be lost)."""
    temp = ".tmp-" + secrets.token_hex(8)
    write_new(dir_fd, temp, data, mode=mode, owner=owner, mtime_ns=mtime_ns, fsync=fsync)
    try:
        rename_into(dir_fd, temp, name, fsync=fsync)
    except BaseException:
        unlink_quietly(dir_fd, temp)
        raise


def unlink_quietly(dir_fd: int, name: str) -> None:
    """Unlink `name` in `dir_fd` if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


# --- directories ----------------------------------------------------------------------------


def make_dir(dir_fd: int, name: str, *, mode: int, owner: Owner | None = None) -> None:
    """Make the directory `name` in `dir_fd` with exactly `mode` and `owner`.

    It is made `0700` and then set through an fd opened `O_NOFOLLOW`, so it is never
    reachable with looser bits and a name swapped meanwhile is never followed. Raises
    FileExistsError when the name is taken.
    """
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        if owner is not None and os.geteuid() == 0:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_dirs(
    dir_fd: int,
    names: Sequence[str],
    where: str,
    attrs: Callable[[int], tuple[int, Owner | None]],
) -> int:
    """Open the directory `names` beneath `dir_fd`, making each missing component `i`
    with `attrs(i)` = (mode, owner). Returns a new fd the caller closes.

    One `O_NOFOLLOW` component at a time: refuses as `paths.open_dir` does
    (`symlink_refused`, `not_a_directory`, ...) when a component is not a directory.
    A component made by someone else meanwhile is opened as found. Costs an lstat and
    an open per component, plus a mkdir, open, chown and chmod per one made.
    """
    fd = os.open(".", DIR_FLAGS, dir_fd=dir_fd)
    try:
        for i, name in enumerate(names):
            if paths.lstat_at(fd, name) is None:
                mode, owner = attrs(i)
                with contextlib.suppress(FileExistsError):
                    make_dir(fd, name, mode=mode, owner=owner)
            nxt = paths.open_dir(fd, (name,), where)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity(fd: int) -> Identity:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def climb(fd: int, expected: Identity) -> int:
    """Open the parent of the directory `fd` (its `..`, never a symlink) and check that
    it is the directory `expected`; returns its fd (`fd` stays open).

    How an iterative walk goes back up while holding one fd: a directory moved
    meanwhile has another parent, and raises OSError(ESTALE) instead of being left
    through a path that now leads elsewhere.
    """
    up = os.open("..", DIR_FLAGS, dir_fd=fd)
    try:
        if identity(up) != expected:
            raise OSError(errno.ESTALE, "a directory was moved while it was walked")
    except BaseException:
        os.close(up)
        raise
    return up


def remove_tree(parent_fd: int, name: str) -> None:
    """Remove the directory `name` in `parent_fd` and everything beneath it.

    Never follows a symlink: one inside is unlinked, its target untouched. Iterative,
    with one directory fd open at a time whatever the depth: it descends by name
    (`O_NOFOLLOW`) and comes back up through `climb`, so neither the recursion limit
    nor the fd limit bounds the trees it can remove. Each directory is listed once: one
    that gains an entry meanwhile fails its rmdir (OSError ENOTEMPTY), as does a tree
    moved while it is removed (ESTALE). Costs one listing and one unlink per entry,
    plus two opens, two fstats and a rmdir per directory.
    """
    cur = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    # One frame per directory below `name` being emptied: its name in its parent, the
    # parent's identity (to check the way back up), and the parent's subdirectories
    # still to empty after it.
    frames: list[tuple[str, Identity, list[str]]] = []
    try:
        pending = _unlink_all_but_dirs(cur)
        while True:
            if pending:
                sub = pending.pop()
                try:
                    child = os.open(sub, DIR_FLAGS, dir_fd=cur)
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        continue
                    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                        unlink_quietly(cur, sub)  # swapped for a non-directory since listed
                        continue
                    raise
                frames.append((sub, identity(cur), pending))
                os.close(cur)
                cur = child
                pending = _unlink_all_but_dirs(cur)
                continue
            if not frames:
                break
            sub, parent, pending = frames.pop()
            up = climb(cur, parent)
            os.close(cur)
            cur = up
            os.rmdir(sub, dir_fd=cur)
    finally:
        os.close(cur)
    os.rmdir(name, dir_fd=parent_fd)


def _unlink_all_but_dirs(dir_fd: int) -> list[str]:
    """Unlink every entry of `dir_fd` that is not a directory; return the directories."""
    dirs: list[str] = []
    with os.scandir(dir_fd) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            dirs.append(entry.name)
        else:
            unlink_quietly(dir_fd, entry.name)
    return dirs


# --- whole-file reads -----------------------------------------------------------------------


def read_fd(fd: int, cap: int, *, expected: int = CHUNK - 1) -> bytes | None:
    """Every byte of the open file `fd` from offset 0 (by `pread`: its offset is left
    alone), or None when it holds more than `cap` bytes.

    `expected`: the size the caller believes it has (its fstat): the first read asks
    for one byte more, so a file of that size costs one read and no larger buffer.
    Memory stays at most `cap` + 1 bytes, also for a file growing while it is read.
    """
    chunks: list[bytes] = []
    size = 0
    want = expected + 1
    while True:
        block = os.pread(fd, max(1, min(want, cap + 1 - size)), size)
        if not block:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        size += len(block)
        if size > cap:
            return None
        chunks.append(block)
        want = CHUNK


def read_regular(dir_fd: int, name: str, cap: int, where: str) -> tuple[os.stat_result, bytes]:
    """(fstat, bytes) of the regular file `name` in `dir_fd`, read whole.

    Never follows a symlink, never blocks opening a FIFO. Refuses `symlink_refused`,
    `not_found`, `not_a_file` (as `paths.open_regular`), and `too_large` when the file
    holds more than `cap` bytes (also when it grew past it while read). Costs one open,
    one fstat and a pass over the file.
    """
    fd = paths.open_regular(dir_fd, name, where)
    try:
        st = os.fstat(fd)
        data = None if st.st_size > cap else read_fd(fd, cap, expected=st.st_size)
    finally:
        os.close(fd)
    if data is None:
        raise TooLarge(f"{where}: over the {cap} byte bound", limit=cap)
    return st, data
