"""The base check: what a write's target is now, read through the held parent fd.

What a write's target is now, the bytes and digest the write is bound to (its
`base_sha256`, docs/protocol.md §4), read through the held parent directory fd without
following a symlink. Every write path reads its target here twice: once to plan, once
more under the workspace's commit lock right before the rename (`writer`, `batch_files`;
an upload hashes it as a stream, `upload`). `open_parent` finds the target's parent, or
which of its directories a write would make.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass

from substrate.errors import NotAFile, NotFound, TooLarge
from substrate.fs import fsops, paths
from substrate.workspace.adopted import Workspace
from substrate.workspace.writes.plan import DEFAULT_FILE_MODE
from substrate.workspace.writes.streamed import hash_fd_bounded


@dataclass
class Current:
    """What the target is now: absent, or a regular file's bytes, digest and metadata."""

    exists: bool
    data: bytes = b""
    sha256: str | None = None
    size: int = 0
    #: `data` holds the whole file; False for a file over `keep`, hashed as a stream.
    whole: bool = True
    mode: int = DEFAULT_FILE_MODE
    uid: int = -1
    gid: int = -1


def read_current(
    parent_fd: int, name: str, where: str, limit: int, keep: int | None = None
) -> Current:
    """What `name` in `parent_fd` is now. Refuses `symlink_refused`, `not_a_file` and
    `too_large` (over `limit`). A file over `keep` (default `limit`) is hashed as a
    stream, its bytes not held (`whole` False). Costs an lstat, and for a file a read
    and a hash."""
    current, fd = read_current_held(parent_fd, name, where, limit, keep)
    if fd is not None:
        os.close(fd)
    return current


def read_current_held(
    parent_fd: int, name: str, where: str, limit: int, keep: int | None = None
) -> tuple[Current, int | None]:
    """`read_current`, and the fd it read a file through, left open (None when absent):
    the caller closes it, or releases it once the name is replaced (`batch_files`)."""
    st = paths.lstat_at(parent_fd, name)
    if st is None:
        return Current(exists=False), None
    if not stat.S_ISREG(st.st_mode):
        kind = paths.kind_of(st.st_mode)
        if kind == "symlink":
            raise paths.refusal_for(OSError(errno.ELOOP, "symlink"), where)
        raise NotAFile(f"{where}: is a {kind}, not a regular file")
    if st.st_size > limit:
        raise TooLarge(f"{where}: {st.st_size} bytes is over the {limit} byte bound", limit=limit)
    try:
        fd, fst = paths.open_regular_stat(parent_fd, name, where)
    except NotFound:
        return Current(exists=False), None  # removed since the lstat: it is absent now
    keep = limit if keep is None else min(keep, limit)
    try:
        if fst.st_size > limit:
            raise TooLarge(f"{where}: over the {limit} byte bound", limit=limit)
        # Past `keep` (or grown past it since the fstat): hashed as a stream.
        read = fsops.read_fd(fd, keep, expected=fst.st_size) if fst.st_size <= keep else None
        if read is not None:
            data, sha256, size, whole = read, hashlib.sha256(read).hexdigest(), len(read), True
        else:
            hashed = hash_fd_bounded(fd, limit)
            if hashed is None:
                raise TooLarge(f"{where}: over the {limit} byte bound", limit=limit)
            data, (sha256, size), whole = b"", hashed, False
    except BaseException:
        os.close(fd)
        raise
    current = Current(
        exists=True,
        data=data,
        sha256=sha256,
        size=size,
        whole=whole,
        mode=stat.S_IMODE(fst.st_mode),
        uid=fst.st_uid,
        gid=fst.st_gid,
    )
    return current, fd


def open_parent(
    ws: Workspace, parts: tuple[str, ...], where: str, create_parents: bool
) -> tuple[int | None, tuple[str, ...]]:
    """Open the deepest existing ancestor. Returns (fd of the parent or None, missing dirs)."""
    dirs = parts[:-1]
    try:
        return paths.open_dir(ws.root_fd, dirs, where), ()
    except NotFound:
        if not create_parents:
            raise
    # Find how much exists, refusing symlinks on the way like any open.
    for cut in range(len(dirs) - 1, -1, -1):
        try:
            fd = paths.open_dir(ws.root_fd, dirs[:cut], where)
        except NotFound:
            continue
        os.close(fd)
        return None, dirs[cut:]
    return None, dirs
