"""A checkout's identity: what says "the same directory" across release and restarts.

What says "the same directory" across release and restarts (docs/protocol.md §2,
docs/environments.md "Which checkout a home belongs to").

Theory of operation. The remembered policy, the persistent homes, the persisted
workspace (and so its journal history and replay) and kept change sets belong to a
checkout. `(st_dev, st_ino)` alone cannot say which: once a directory is removed, the
filesystem hands its inode to the next one made (ext4 does at once), and that new,
unrelated directory would inherit all of it. So the identity adds something a new
directory cannot inherit and nobody can set:

1. its **birth time** (`statx` with `STATX_BTIME`, nanoseconds): fixed when the inode is
   allocated, never changed by any syscall, different for a reused inode (ext4 with
   256-byte inodes, xfs, btrfs, tmpfs on recent kernels);
2. where the filesystem keeps none, its **file handle** (`name_to_handle_at`): the
   kernel's own name for the inode across reboots, which for ext4 and most exportable
   filesystems holds the inode's generation number, renewed when the inode is reused
   (NFS's "stale file handle"). Unprivileged, reads nothing of the directory.

Neither: the directory has no identity a new one could not inherit, and adopting it is
refused (`path_denied`): a marker substrate wrote would mean writing to a person's
checkout (an xattr), and one kept beside an `st_ctime` would be lost at the first file
created in the root (the root's ctime changes with it).

`key` is the text stored everywhere (`"<st_dev>:<st_ino>:b<sec>.<nsec>"` or
`"<st_dev>:<st_ino>:h<digest>"`); `legacy` is the `"<st_dev>:<st_ino>"` that releases
before this one stored, which `substrate.workspace.registry` migrates once, only where
the path recorded with it matches too.

Costs one `statx` (and, without a birth time, one `name_to_handle_at`) on a held fd.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from dataclasses import dataclass

from substrate.errors import PathDenied

_AT_EMPTY_PATH = 0x1000
_STATX_INO = 0x100
_STATX_BTIME = 0x800
#: `struct statx` is 256 bytes; stx_mask at 0, stx_ino at 32, stx_btime at 80.
_STATX_SIZE = 256
_MAX_HANDLE_SZ = 128

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class CheckoutId:
    """One checkout's identity: its root's (st_dev, st_ino) and what proves the inode is
    still the one first seen (`birth`: `b<sec>.<nsec>` or `h<handle digest>`)."""

    dev: int
    ino: int
    birth: str

    @property
    def key(self) -> str:
        """The identity as stored (text: st_ino may not fit SQLite's signed 64 bits)."""
        return f"{self.dev}:{self.ino}:{self.birth}"

    @property
    def legacy(self) -> str:
        """What an older release stored for this directory: (st_dev, st_ino) only."""
        return f"{self.dev}:{self.ino}"

    @property
    def dev_ino(self) -> tuple[int, int]:
        return (self.dev, self.ino)


def checkout_identity(fd: int) -> CheckoutId:
    """The identity of the directory open at `fd`. Refuses `path_denied` when the
    filesystem gives it neither a birth time nor a file handle."""
    st = os.fstat(fd)
    birth = birth_time(fd, st.st_ino)
    if birth is None:
        birth = file_handle(fd)
    if birth is None:
        raise PathDenied(
            "this filesystem gives the directory no identity a new directory could not"
            " inherit (no birth time, no file handle): it cannot be adopted"
        )
    return CheckoutId(st.st_dev, st.st_ino, birth)


def birth_time(fd: int, ino: int) -> str | None:
    """`b<sec>.<nsec>` from `statx(fd, "", AT_EMPTY_PATH, STATX_BTIME)`, or None when the
    C library or the filesystem has no birth time (or statx answers for another inode)."""
    statx = getattr(_libc, "statx", None)
    if statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    rc = statx(
        ctypes.c_int(fd),
        ctypes.c_char_p(b""),
        ctypes.c_int(_AT_EMPTY_PATH),
        ctypes.c_uint(_STATX_INO | _STATX_BTIME),
        buf,
    )
    if rc != 0:
        return None
    (mask,) = struct.unpack_from("=I", buf, 0)
    (stx_ino,) = struct.unpack_from("=Q", buf, 32)
    sec, nsec = struct.unpack_from("=qI", buf, 80)
    if not mask & _STATX_BTIME or not mask & _STATX_INO or stx_ino != ino:
        return None
    return f"b{sec}.{nsec:09d}"


class _FileHandle(ctypes.Structure):
    _fields_ = [
        ("handle_bytes", ctypes.c_uint),
        ("handle_type", ctypes.c_int),
        ("f_handle", ctypes.c_ubyte * _MAX_HANDLE_SZ),
    ]


def file_handle(fd: int) -> str | None:
    """`h<digest>` of the kernel's file handle of `fd` (`name_to_handle_at` with
    AT_EMPTY_PATH), or None where the filesystem gives none."""
    call = getattr(_libc, "name_to_handle_at", None)
    if call is None:
        return None
    handle = _FileHandle(handle_bytes=_MAX_HANDLE_SZ)
    mount_id = ctypes.c_int(0)
    rc = call(
        ctypes.c_int(fd),
        ctypes.c_char_p(b""),
        ctypes.byref(handle),
        ctypes.byref(mount_id),
        ctypes.c_int(_AT_EMPTY_PATH),
    )
    if rc != 0 or not 0 < handle.handle_bytes <= _MAX_HANDLE_SZ:
        return None
    raw = struct.pack("=i", handle.handle_type) + bytes(handle.f_handle)[: handle.handle_bytes]
    return "h" + hashlib.sha256(raw).hexdigest()[:32]
