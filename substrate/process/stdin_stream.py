"""Streaming stdin: `proc.start {stdin: "stream"}` then `proc.write` (docs/protocol.md §14).

Theory of operation. A `StdinStream` is made by the `proc.start` handler with its
caller as owner, travels in the `RunRequest`, and is kept on the command's `Entry`
while it runs. Writers (`write`, one `proc.write` each) append bytes to a bounded
buffer, in the order they arrived (a FIFO lock); one task of the run (`drain`, started
by the driver once the exec's stream is open) hands the buffer to the command's stdin
as fast as the command takes it, then closes the stdin when a writer asked for EOF.

Back-pressure. The buffer holds at most `STDIN_BUFFER_BYTES` (1 MiB) that the command
has not taken yet; past that the kernel's pipe and socket buffers hold the rest, and
`drain` waits for them to have room. A write that would pass the cap waits (behind it,
later writes wait too) up to `STDIN_WAIT_S` for the command to read, then is
`limit_exceeded` (`data.scope: "stdin_buffer"`), taking nothing. Memory per stream is
bounded by the cap; streams are bounded by `max_processes`.

Ends. A write after an EOF, or once the command closed its stdin (the pipe broke: what
was buffered is dropped), or after the run ended is `stdin_closed` with the reason;
writers waiting for room are woken and refused the same way. Only the owner (the same
socket and uid, `Caller.name`) or the operator may write (`unauthorized`).

Threading: everything runs on the event loop. `drain` never blocks it: it waits for the
command's stdin to be writable (`trio.lowlevel.wait_writable`) and writes without waiting
(`StdinPipe.send_now`), so a cancelled run stops it at once. The command's channel says
what its stdin is (`ExecChannel.stdin_pipe`): an engine exec's stream socket
(`SocketStdin`: `MSG_DONTWAIT` sends, EOF by shutting the write half; the output pump's
thread reads the same socket), or the pipe a supervisor-started command reads
(`PipeStdin`: non-blocking writes, EOF by closing it).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import trio

from substrate.errors import LimitExceeded, StdinClosed, Unauthorized
from substrate.schema.proc import STDIN_BUFFER_BYTES

__all__ = ["STDIN_WAIT_S", "PipeStdin", "SocketStdin", "StdinPipe", "StdinStream", "WriteState"]

#: How long a write waits for the command to make room in the buffer, seconds.
STDIN_WAIT_S = 30.0
#: Most bytes handed to the stream socket in one send.
SEND_BYTES = 64 << 10

Reason = Literal["eof", "closed", "ended"]


class StdinPipe(Protocol):
    """The command's stdin as `StdinStream.drain` writes it."""

    def fileno(self) -> int:
        """What `trio.lowlevel.wait_writable` waits on."""
        ...

    def send_now(self, data: memoryview) -> int:
        """Write what fits now, without blocking: the count, `BlockingIOError` when
        nothing fits, another `OSError` when the command's stdin is gone."""
        ...

    def close_write(self) -> None:
        """Close the command's stdin (it reads EOF); never raises."""
        ...


class SocketStdin:
    """An engine exec's stdin: the write half of its stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def send_now(self, data: memoryview) -> int:
        return self._sock.send(data, socket.MSG_DONTWAIT)

    def close_write(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)


class PipeStdin:
    """The write end of a pipe (a command the sandbox's supervisor started), made
    non-blocking; EOF is `close`, its owner's (which then forgets the descriptor)."""

    def __init__(self, fd: int, close: Callable[[], None]) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._close = close

    def fileno(self) -> int:
        return self._fd

    def send_now(self, data: memoryview) -> int:
        return os.write(self._fd, data)

    def close_write(self) -> None:
        self._close()


@dataclass(frozen=True)
class WriteState:
    """What one write did, and where the stream stands (`WriteResult`)."""

    accepted: int
    buffered: int
    written: int
    eof: bool


class StdinStream:
    """The open stdin of one started command (see the module doc)."""

    def __init__(
        self, owner: str, *, cap: int = STDIN_BUFFER_BYTES, wait_s: float = STDIN_WAIT_S
    ) -> None:
        self.owner = owner
        self.cap = cap
        self.wait_s = wait_s
        self.buffered = 0  # taken, not yet handed to the command
        self.written = 0  # handed to the command's stdin, in all
        self.eof = False  # a writer asked for EOF (sent once the buffer is empty)
        self.closed: Reason | None = None  # why no more bytes are taken
        self._chunks: collections.deque[memoryview] = collections.deque()  # no copies
        self._order = trio.Lock()  # writers take turns in arrival order
        self._room = trio.lowlevel.ParkingLot()  # writers waiting for room
        self._data = trio.lowlevel.ParkingLot()  # the drain waiting for bytes or EOF

    def check_writer(self, caller: str, *, operator: bool) -> None:
        """Refuse `unauthorized` unless `caller` started the command or is the operator."""
        if caller != self.owner and not operator:
            raise Unauthorized(
                "only the caller that started the command, or the operator, may write"
            )

    async def write(self, data: bytes, *, eof: bool = False) -> WriteState:
        """Take `data` (and an EOF after it), waiting up to `wait_s` for room.

        Refuses `stdin_closed` (see the module doc) and `limit_exceeded` (no room in
        time); a refusal takes nothing. Returns once the bytes are buffered, not once
        the command read them (`WriteState.written` counts those).
        """
        deadline = trio.current_time() + self.wait_s
        turn = False
        with trio.move_on_at(deadline):
            await self._order.acquire()  # behind earlier writes, within the same wait
            turn = True
        if not turn:
            self._refuse_closed()
            raise self._full()
        try:
            self._refuse_closed()
            with trio.move_on_at(deadline):
                while self.closed is None and self.buffered + len(data) > self.cap:
                    await self._room.park()
            self._refuse_closed()
            if self.buffered + len(data) > self.cap:
                raise self._full()
            if data:
                self._chunks.append(memoryview(data))
                self.buffered += len(data)
            self.eof = self.eof or eof
            self._data.unpark_all()
            return WriteState(len(data), self.buffered, self.written, self.eof)
        finally:
            self._order.release()

    def _full(self) -> LimitExceeded:
        return LimitExceeded(
            f"stdin holds {self.buffered} bytes the command has not read",
            scope="stdin_buffer",
            limit=self.cap,
            buffered=self.buffered,
        )

    def _refuse_closed(self) -> None:
        reason = "eof" if self.eof else self.closed
        if reason is not None:
            raise StdinClosed(f"the command's stdin is closed ({reason})", reason=reason)

    def end(self, reason: Reason) -> None:
        """No more bytes are taken (the first reason stays); the buffer is dropped and
        every waiting writer is woken to be refused. Idempotent."""
        if self.closed is None:
            self.closed = reason
        self._chunks.clear()
        self.buffered = 0
        self._room.unpark_all()
        self._data.unpark_all()

    async def drain(self, pipe: StdinPipe) -> None:
        """Hand the buffered bytes to the command's stdin as it takes them; after an EOF,
        close it (the command reads EOF). Runs until then, a broken pipe, or
        cancellation (the run ended); the stream is ended on the way out."""
        try:
            while True:
                while not self._chunks and not self.eof and self.closed is None:
                    await self._data.park()
                if self.closed is not None:
                    return
                if not self._chunks:  # EOF, everything handed over
                    pipe.close_write()
                    self.end("eof")
                    return
                await trio.lowlevel.wait_writable(pipe.fileno())
                if not self._chunks:  # ended meanwhile
                    continue
                chunk = self._chunks[0]
                try:
                    sent = pipe.send_now(chunk[:SEND_BYTES])
                except BlockingIOError:
                    continue
                except OSError:  # EPIPE, ECONNRESET: the command's stdin is gone
                    self.end("closed")
                    return
                if sent == len(chunk):
                    self._chunks.popleft()
                else:
                    self._chunks[0] = chunk[sent:]
                self.buffered -= sent
                self.written += sent
                self._room.unpark_all()
        finally:
            self.end("ended")


def write_until_woken(fd: int, data: bytes, wake_r: int, chunk: int) -> None:
    """Write `data` to the pipe `fd` (made non-blocking), `chunk` bytes at a time, until
    all is written or `wake_r` is readable (the command ended: stop). Blocking. A write
    error means the reader closed its end early (the command exited or closed its
    stdin): not an error, the rest is dropped."""
    try:
        os.set_blocking(fd, False)
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        poller.register(wake_r, select.POLLIN)
        view = memoryview(data)
        while view:
            events = poller.poll()
            if any(ready == wake_r for ready, _ in events):
                return
            try:
                view = view[os.write(fd, view[:chunk]) :]
            except BlockingIOError:
                continue
    except OSError:
        pass
