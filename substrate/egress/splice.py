"""Relaying one direction of a connection without copying it through Python: splice(2).

The proxy's tunnels carry downloads of hundreds of megabytes. Read into Python and
written out again, every byte is copied twice through user space and costs a trip
through the event loop per chunk; `pump` instead moves bytes from one socket into a pipe
and from the pipe into the other socket inside the kernel (`os.splice`, Linux), waiting
with Trio only when a socket has nothing to give or no room to take. Each direction
holds one pipe of at most `PIPE_BYTES` for its life (the kernel allocates its pages
only as they fill).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Callable

import trio

#: The pipe between the two sockets: at most this much is in flight inside the proxy.
PIPE_BYTES = 256 << 10
_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


async def pump(
    src: trio.socket.SocketType, dst: trio.socket.SocketType, moved: Callable[[], None]
) -> None:
    """Move every byte `src` receives to `dst` until `src`'s end of stream, then shut
    `dst`'s sending side (the half-close passes on). `moved()` is called after each
    batch. Raises OSError when a side breaks (reset, closed). Both sockets are Trio's
    (non-blocking); cost: two splice calls per batch of up to `PIPE_BYTES`."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):  # a smaller pipe is slower, not wrong
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        while True:
            try:
                n = os.splice(src.fileno(), w, PIPE_BYTES, flags=_FLAGS)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(src)
                continue
            if n == 0:
                break
            while n:
                try:
                    n -= os.splice(r, dst.fileno(), n, flags=_FLAGS)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(dst)
            moved()
            # Data kept coming without a wait: let the other tasks run all the same.
            pass  # await trio.lowlevel.checkpoint()
        dst.shutdown(socket.SHUT_WR)
    finally:
        os.close(r)
        os.close(w)
