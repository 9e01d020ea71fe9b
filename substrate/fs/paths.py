"""Contained path handling: validation (pure) and symlink-refusing opens through dir fds.

Theory of operation: a workspace is held as an open directory fd, never as a path string
to re-resolve. A request path is first split and validated (`split_relpath`); then its
parent directory is opened *beneath* the root fd — with `openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` where the kernel has it, else one
`openat(O_NOFOLLOW | O_DIRECTORY)` per component — and the final name is only ever used
relative to that parent fd, again with `O_NOFOLLOW`. A symlink anywhere is refused, never
followed, so swapping a directory for a symlink mid-operation cannot redirect us.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from substrate.errors import (
    Internal,
    NotADirectory,
    NotAFile,
    NotFound,
    PathDenied,
    PathEscape,
    PathInvalid,
    Refusal,
    SymlinkRefused,
)

MAX_PATH_BYTES = 4096
#: The kernel's bound on a path given to one call, its NUL included (`open_dir` walks
#: longer ones).
_PATH_MAX = 4096
MAX_NAME_BYTES = 255

Kind = Literal["file", "dir", "symlink", "other"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_relpath(path: str, *, allow_root: bool = False) -> tuple[str, ...]:
    """Validate a workspace-relative POSIX path and return its components.

    `"."` is the workspace root itself (returned as `()`) only when `allow_root`.
    Refuses (`path_invalid`): empty, absolute, NUL, backslash, `..`, `.` or empty
    components, a non-UTF-8 string, more than 4096 bytes or a name over 255 bytes.
    """
    if path == "." and allow_root:
        return ()
    if not path:
        raise PathInvalid("path is empty")
    if "\x00" in path:
        raise PathInvalid("path contains NUL")
    if "\\" in path:
        raise PathInvalid("path contains a backslash")
    if path.startswith("/"):
        raise PathInvalid("path must be relative to the workspace")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise PathInvalid("path is not valid UTF-8") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise PathInvalid(f"path is longer than {MAX_PATH_BYTES} bytes")
    parts = tuple(path.split("/"))
    for part in parts:
        if part == "..":
            raise PathInvalid("path has a '..' component")
        if part in ("", "."):
            raise PathInvalid("path has an empty or '.' component")
        if len(part.encode()) > MAX_NAME_BYTES:
            raise PathInvalid(f"a path component is longer than {MAX_NAME_BYTES} bytes")
    return parts


def wire_name(name: str) -> tuple[str, str | None]:
    """A name or relative path met on disk, for a result: `(text, raw_b64)`.

    File names are bytes; `os` gives them as str with each byte that is not UTF-8 as a lone
    surrogate (surrogateescape), which JSON cannot carry. A UTF-8 name comes back as is,
    with None. Any other comes back with each such byte written `\\xNN` (Python's
    backslashreplace) and, since that text is ambiguous and no path argument can name it,
    its exact bytes in base64.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(name)
        return raw.decode("utf-8", "backslashreplace"), base64.b64encode(raw).decode("ascii")
    return name, None


def kind_of(mode: int) -> Kind:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def refusal_for(exc: OSError, where: str) -> Refusal:
    """Translate an OSError met while resolving `where` into the named refusal."""
    match exc.errno:
        case errno.ELOOP:
            return SymlinkRefused(f"{where}: a symlink is on the path; it is not followed")
        case errno.ENOENT:
            return NotFound(f"{where}: not found")
        case errno.ENOTDIR:
            return NotADirectory(f"{where}: a component is not a directory")
        case errno.EISDIR:
            return NotAFile(f"{where}: is a directory")
        case errno.ENXIO | errno.ENODEV:
            return NotAFile(f"{where}: not a regular file")
        case errno.EXDEV:
            return PathEscape(f"{where}: resolves outside the workspace")
        case errno.EACCES | errno.EPERM:
            return PathDenied(f"{where}: permission denied by the filesystem")
        case errno.ENAMETOOLONG:
            return PathInvalid(f"{where}: name too long")
        case _:
            return Internal(f"{where}: {errno.errorcode.get(exc.errno or 0, exc.errno)}")


# --- openat2 ----------------------------------------------------------------------------

_SYS_OPENAT2 = 437  # the same number on every architecture that has it
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_openat2_works: bool | None = None


def _openat2(dir_fd: int, rel: str, flags: int) -> int:
    how = _OpenHow(
        flags=flags,
        mode=0,
        resolve=_RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS,
    )
    while True:
        fd = _libc.syscall(
            _SYS_OPENAT2,
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(os.fsencode(rel)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err == errno.EINTR or err == errno.EAGAIN:
            continue
        raise OSError(err, os.strerror(err))


def _has_openat2() -> bool:
    global _openat2_works
    if _openat2_works is None:
        try:
            probe = os.open("/", _DIR_FLAGS)
            try:
                os.close(_openat2(probe, ".", _DIR_FLAGS))
            finally:
                os.close(probe)
            _openat2_works = True
        except OSError:
            _openat2_works = False
    return _openat2_works


def use_openat2(enabled: bool) -> None:
    """Force the fallback walk (tests run both paths)."""
    global _openat2_works
    _openat2_works = None  # probe again: a disabled resolver must be re-enabled
    _openat2_works = enabled and _has_openat2()


def open_dir(root_fd: int, parts: Sequence[str], where: str = "path") -> int:
    """Open the directory `parts` beneath `root_fd` without following any symlink.

    Returns a new `O_RDONLY | O_DIRECTORY` fd the caller must close. `()` reopens the root.
    Refuses: `symlink_refused`, `not_found`, `not_a_directory`, `path_escape`.
    Costs one syscall with openat2, one per component without.
    """
    if not parts:
        return os.open(".", _DIR_FLAGS, dir_fd=root_fd)
    joined = "/".join(parts)
    # openat2 takes a path of less than PATH_MAX bytes (the NUL counted): a longer one
    # (up to `MAX_PATH_BYTES` is valid) is walked a component at a time.
    if _has_openat2() and len(os.fsencode(joined)) < _PATH_MAX:
        try:
            # No O_NOFOLLOW here: with it, a symlink as the *last* component fails the
            # O_DIRECTORY check first (ENOTDIR); without it RESOLVE_NO_SYMLINKS says ELOOP.
            return _openat2(root_fd, joined, _DIR_FLAGS & ~os.O_NOFOLLOW)
        except OSError as exc:
            raise refusal_for(exc, where) from None
    fd = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
    try:
        for part in parts:
            nxt = _open_component(fd, part, where)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_component(dir_fd: int, name: str, where: str) -> int:
    """One step of the fallback walk: the directory `name` in `dir_fd`, never a symlink.

    `O_PATH | O_NOFOLLOW` pins whatever is there (a symlink included), so the refusal
    names what was met even if the name is swapped a moment later; `O_DIRECTORY |
    O_NOFOLLOW` alone would say ENOTDIR for a symlink.
    """
    try:
        pinned = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise refusal_for(exc, where) from None
    try:
        mode = os.fstat(pinned).st_mode
        if not stat.S_ISDIR(mode):
            err = errno.ELOOP if stat.S_ISLNK(mode) else errno.ENOTDIR
            raise refusal_for(OSError(err, os.strerror(err)), where)
        return os.open(".", _DIR_FLAGS, dir_fd=pinned)
    finally:
        os.close(pinned)


@contextmanager
def opened_dir(root_fd: int, parts: Sequence[str], where: str = "path") -> Iterator[int]:
    fd = open_dir(root_fd, parts, where)
    try:
        yield fd
    finally:
        os.close(fd)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """lstat `name` in `dir_fd`, or None when absent. Never follows a symlink."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_regular(dir_fd: int, name: str, where: str, flags: int = os.O_RDONLY) -> int:
    """Open an existing regular file `name` in `dir_fd` (no symlink, never blocks on a FIFO).

    Refuses: `symlink_refused`, `not_found`, `not_a_file`.
    """
    return open_regular_stat(dir_fd, name, where, flags)[0]


def open_regular_stat(
    dir_fd: int, name: str, where: str, flags: int = os.O_RDONLY
) -> tuple[int, os.stat_result]:
    """`open_regular`, and the fd's `fstat` it checked (no second fstat for the caller)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise refusal_for(exc, where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(f"{where}: not a regular file ({kind_of(st.st_mode)})")
        # Back to blocking reads: O_NONBLOCK was only there so a FIFO cannot hang the open.
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st
