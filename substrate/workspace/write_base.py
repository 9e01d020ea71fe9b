"""What every guarded write shares, one file or a batch (`writes`, `batch_writes`): the
plan digest, reading the target as it is now, the reserved temp-file names, the default
modes and the set-id rule.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Literal

from substrate.errors import NotAFile, NotFound, PathDenied, TooLarge
from substrate.store.journal import canonical
from substrate.workspace import fsops, patching, paths
from substrate.workspace.temp_files import TEMP_PREFIX

#: Files bigger than this are not loaded for patching, nor made by a patch, nor read
#: as a base.
MAX_PATCH_FILE = patching.MAX_RESULT_BYTES
#: Mode of a created file when the caller gives none.
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755

Op = Literal["create", "replace", "delete"]
DirOp = Literal["mkdir", "rmdir", "chmod"]


def plan_digest(
    root_id: str, path: str, op: Op, base: str | None, new: str | None, mode: int | None
) -> str:
    """SHA-256 of the canonical JSON array `[root_id, path, op, base, new, mode]`."""
    return hashlib.sha256(canonical([root_id, path, op, base, new, mode])).hexdigest()


def dir_digest(root_id: str, path: str, op: DirOp, mode: int | None) -> str:
    """The plan digest of a directory step: `[root_id, path, op, null, null, mode]`."""
    return hashlib.sha256(canonical([root_id, path, op, None, None, mode])).hexdigest()


def no_setid(mode: int) -> int:
    """`mode` without set-id bits: substrate writes as root and the bytes are the agent's
    (a write by the file's owner would clear these bits too)."""
    return mode & ~(stat.S_ISUID | stat.S_ISGID)


@dataclass
class Current:
    """What the target is now: absent, or a regular file's bytes, digest and metadata."""

    exists: bool
    data: bytes = b""
    sha256: str | None = None
    mode: int = DEFAULT_FILE_MODE
    uid: int = -1
    gid: int = -1


def read_current(parent_fd: int, name: str, where: str, limit: int) -> Current:
    """What `name` in `parent_fd` is now. Refuses `symlink_refused`, `not_a_file` and
    `too_large` (over `limit`). Costs an lstat, and for a file a read and a hash."""
    current, fd = read_current_held(parent_fd, name, where, limit)
    if fd is not None:
        os.close(fd)
    return current


def read_current_held(
    parent_fd: int, name: str, where: str, limit: int
) -> tuple[Current, int | None]:
    """`read_current`, and the fd it read a file through, left open (None when absent):
    the caller closes it, or releases it once the name is replaced (`batch_base`)."""
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
        fd = paths.open_regular(parent_fd, name, where)
    except NotFound:
        return Current(exists=False), None  # removed since the lstat: it is absent now
    try:
        fst = os.fstat(fd)
        data = None if fst.st_size > limit else fsops.read_fd(fd, limit, expected=fst.st_size)
        if data is None:
            raise TooLarge(f"{where}: over the {limit} byte bound", limit=limit)
    except BaseException:
        os.close(fd)
        raise
    current = Current(
        exists=True,
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        mode=stat.S_IMODE(fst.st_mode),
        uid=fst.st_uid,
        gid=fst.st_gid,
    )
    return current, fd


def check_not_reserved(parts: tuple[str, ...], where: str) -> None:
    """Refuse a name substrate uses for its temp files: it must never write or delete one."""
    if any(part.startswith(TEMP_PREFIX) for part in parts):
        raise PathDenied(
            f"{where}: names starting with {TEMP_PREFIX!r} are reserved for substrate's temp files",
            reserved_prefix=TEMP_PREFIX,
        )
