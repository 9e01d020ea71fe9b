"""An exec's output stream: the engine's multiplexed framing (sans-IO) and the blocking
pumps that move bytes between the stream socket and the command's sinks.

Threading: `pump_stream` and `feed_stdin` block; they run in worker threads, one per
direction, for the life of a command. `shutdown` may be called from any thread: it wakes a
thread blocked in `recv`.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Mapping

from substrate.artifacts.sink import OutputSink

#: Bytes read from the engine at a time.
RECV_BYTES = 1 << 18


class Demuxer:
    """Splits the engine's multiplexed exec stream into (stream, bytes) pieces. Sans-IO.

    Frame: 1 byte stream (0 stdin, 1 stdout, 2 stderr), 3 zero bytes, 4 bytes big-endian
    payload length, payload. Pieces of one frame may come in several `feed` calls.
    """

    HEADER = struct.Struct(">BxxxI")

    def __init__(self) -> None:
        self._header = bytearray()
        self._stream = 0
        self._left = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        pos, end = 0, len(data)
        while pos < end:
            if self._left == 0:
                take = min(self.HEADER.size - len(self._header), end - pos)
                self._header += data[pos : pos + take]
                pos += take
                if len(self._header) < self.HEADER.size:
                    break
                self._stream, self._left = self.HEADER.unpack(self._header)
                self._header.clear()
                continue
            take = min(self._left, end - pos)
            out.append((self._stream, data[pos : pos + take]))
            self._left -= take
            pos += take
        return out

    @property
    def mid_frame(self) -> bool:
        """True when the stream stopped inside a frame (a cut connection)."""
        return bool(self._header) or self._left > 0


def pump_stream(sock: socket.socket, initial: bytes, sinks: Mapping[int, OutputSink]) -> None:
    """Read the exec stream to EOF, demux it, write each piece to its sink (blocking)."""
    demux = Demuxer()
    data = initial
    while True:
        if not data:
            try:
                data = sock.recv(RECV_BYTES)
            except OSError:
                return
            if not data:
                return
        for stream, piece in demux.feed(data):
            sink = sinks.get(stream)
            if sink is not None:
                sink.write(piece)
        data = b""


def feed_stdin(sock: socket.socket, data: bytes, close: bool) -> None:
    """Write the command's stdin, then shut the write half: the command sees EOF."""
    try:
        if data:
            sock.sendall(data)
    except OSError:
        pass  # the command exited or closed its stdin early: not an error
    finally:
        if close:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)


def shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
