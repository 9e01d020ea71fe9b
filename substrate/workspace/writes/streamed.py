"""Big files copied and hashed as streams: a change set's file never held in memory.

A change set's file over `STREAM_BYTES` is not read into memory: its source (the upper
layer) is handed over as an open fd (`Streamed`), and `copy_hashed` copies it into the
reserved temp file beside the target in `CHUNK`-sized steps - `copy_file_range(2)`
where the kernel can (in-kernel, no copy through the daemon; a reflink on file systems
that share extents), else `sendfile(2)`, else a read and a write through one fixed
buffer - and hashes each step by reading back what the temp file holds, through the
same buffer. The digest is of the bytes the temp file holds, so what is renamed into
the checkout is exactly what was checked against the scanned `new_sha256`; a source
that grew, shrank or changed while it was copied yields another digest (the batch's
`source_changed`, the layer's `layer_changed`) and the temp file goes, never renamed.

`hash_fd_bounded` hashes an open file from offset 0 through the same kind of buffer.
Memory: one `CHUNK` buffer per call, whatever the file's size. Blocking I/O.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass

#: Files over this size are streamed; smaller ones are read whole (one read, one write).
STREAM_BYTES = 1 << 20
#: Bytes per copy and hash step: what a streamed copy holds in memory.
CHUNK = 1 << 20

#: `copy_file_range` / `sendfile` errors meaning "not between these two files": the
#: next way down is tried (cross-device on older kernels, file systems without it).
_UNSUPPORTED = frozenset(
    {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}
)


@dataclass
class Streamed:
    """A source file too big to read whole: an open fd (the batch closes it, `close`) and
    the size it had when opened."""

    fd: int
    size: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _kernel_copy(src: int, dst: int, offset: int, count: int, how: list[str]) -> int:
    """Up to `count` bytes of `src` at `offset` appended to `dst` at the same offset by the
    kernel; 0 at the source's end. `how` holds the way that works (it narrows on the
    first call); a way the kernel refuses for these files is dropped for the rest."""
    while how:
        try:
            if how[0] == "copy_file_range":
                return os.copy_file_range(src, dst, count, offset, offset)
            if how[0] == "sendfile":
                os.lseek(dst, offset, os.SEEK_SET)
                return os.sendfile(dst, src, offset, count)
            return -1  # "rw": the caller reads and writes
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            how.pop(0)
    return -1


def copy_hashed(src: int, dst: int, size: int) -> str | None:
    """Copy the first `size` bytes of `src` into the empty file `dst` (both open fds) and
    return the SHA-256 of what `dst` then holds; None when `src` is not `size` bytes
    long (it ended early, or holds more: grown since it was scanned). Memory: one
    `CHUNK`; cost: the copy plus one read of what was written (from the page cache)."""
    digest = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    how = ["copy_file_range", "sendfile", "rw"]
    offset = 0
    try:
        while offset < size:
            want = min(CHUNK, size - offset)
            done = _kernel_copy(src, dst, offset, want, how)
            if done < 0:  # no kernel copy: through the buffer
                done = os.preadv(src, [view[:want]], offset)
                _pwrite_all(dst, view[:done], offset)
            if done == 0:
                return None  # the source is shorter than scanned
            _hash_range(dst, offset, done, view, digest)
            offset += done
        if os.pread(src, 1, size):
            return None  # the source holds more than scanned
    finally:
        view.release()
    return digest.hexdigest()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _hash_range(fd: int, offset: int, count: int, view: memoryview, digest: hashlib._Hash) -> None:
    """Hash `count` bytes of `fd` at `offset` through `view`."""
    end = offset + count
    while offset < end:
        got = os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
        if got == 0:
            raise OSError(errno.EIO, "the temp file is shorter than what was copied into it")
        digest.update(view[:got])
        offset += got


def hash_fd_bounded(fd: int, limit: int) -> tuple[str, int] | None:
    """SHA-256 and length of the open file `fd` from offset 0, through one `CHUNK`
    buffer; None when it holds more than `limit` bytes (stopped there)."""
    digest = hashlib.sha256()
    buf = bytearray(CHUNK)
    with memoryview(buf) as view:
        offset = 0
        while True:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                return digest.hexdigest(), offset
            offset += got
            if offset > limit:
                return None
            digest.update(view[:got])
