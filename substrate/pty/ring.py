"""The bounded scrollback ring and per-reader UTF-8 framing, sans-IO.

Theory of operation: a session's PTY output is one byte stream; every byte has an
offset, its `seq`. The `Ring` keeps the newest `capacity` bytes (default 1 MiB), so it
holds the offsets `[start, end)`. Each attached client reads the ring through its own
`Cursor`: the cursor knows the next offset it wants and holds an incremental UTF-8
decoder, so a multi-byte character split across PTY reads (or across ring chunks) is
emitted whole in the next frame, never split, and invalid bytes become U+FFFD. A frame's
`seq` is the offset just past the last byte fully represented in its text, so a client
that reconnects with `since = seq` loses and repeats nothing.

Nobody waits for a reader: the PTY pump appends and moves on. A reader that falls so far
behind that its next offset left the ring gets a `Resync` and continues half a ring
before the end; its backlog is therefore bounded by the ring, whatever the client does.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

DEFAULT_CAPACITY = 1 << 20


class Ring:
    """The newest `capacity` bytes of a stream, addressed by absolute offset."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 4:
            raise ValueError("ring capacity must be at least 4 bytes")
        self.capacity = capacity
        self._buf = bytearray()
        self._start = 0

    @property
    def start(self) -> int:
        """Offset of the oldest byte still held."""
        return self._start

    @property
    def end(self) -> int:
        """Offset just past the newest byte (total bytes ever appended)."""
        return self._start + len(self._buf)

    def append(self, data: bytes) -> None:
        """Add bytes, dropping the oldest past capacity. Costs O(len(data)) amortized."""
        if len(data) >= self.capacity:
            # Only the tail can survive; skip copying what would be dropped at once.
            self._start += len(self._buf) + len(data) - self.capacity
            self._buf = bytearray(data[-self.capacity :])
            return
        self._buf += data
        excess = len(self._buf) - self.capacity
        if excess > 0:
            # CPython deletes from the front of a bytearray without moving the rest.
            del self._buf[:excess]
            self._start += excess

    def resync_point(self) -> int:
        """Where a reader that lost its place continues: half a ring before the end.

        Not `start`: the oldest byte is the next to go, so a reader restarted there would
        be overrun again at once; half a ring is enough history to redraw a screen.
        """
        return max(self._start, self.end - self.capacity // 2)

    def holds(self, seq: int) -> bool:
        """True when reading can continue from `seq` (it is in `[start, end]`)."""
        return self._start <= seq <= self.end

    def read(self, seq: int, max_bytes: int) -> bytes:
        """Up to `max_bytes` from `seq`. `seq` must be held (see `holds`)."""
        if not self.holds(seq):
            raise ValueError(f"offset {seq} not in ring [{self._start}, {self.end}]")
        i = seq - self._start
        return bytes(self._buf[i : i + max_bytes])

    def tail(self, since: int | None, max_bytes: int) -> tuple[int, bytes]:
        """The bytes from `since` (clamped into the ring) on, at most the newest `max_bytes`.

        Returns `(first_seq, data)`. Used by `pty.selection`.
        """
        first = self._start if since is None else min(max(since, self._start), self.end)
        first = max(first, self.end - max_bytes)
        return first, self.read(first, max_bytes)


@dataclass(frozen=True)
class Chunk:
    """What one `Cursor.pull` produced: a resync marker and/or text up to `seq`."""

    seq: int
    text: str
    resync: bool = False


def _skip_continuations(data: bytes, limit: int = 3) -> int:
    """How many leading bytes are UTF-8 continuation bytes (a character cut at the front)."""
    n = 0
    while n < min(limit, len(data)) and 0x80 <= data[n] <= 0xBF:
        n += 1
    return n


class Cursor:
    """One reader's position in a `Ring`, turning bytes into whole-character text."""

    def __init__(self, ring: Ring, seq: int) -> None:
        self._ring = ring
        self._next = seq  # next offset to fetch from the ring
        self._emitted = seq  # offset just past the last byte represented in emitted text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # After a resync the ring may start inside a character: skip up to 3 of its
        # continuation bytes rather than render each as U+FFFD.
        self._cut_budget = 3 if 0 < ring.start == seq else 0

    @property
    def seq(self) -> int:
        """Offset just past the last byte represented in emitted text."""
        return self._emitted

    @property
    def caught_up(self) -> bool:
        """True when there is nothing new in the ring for this reader."""
        return self._next >= self._ring.end and self._ring.holds(self._next)

    def pull(self, max_bytes: int = 32 * 1024) -> Chunk | None:
        """The next frame's worth, or None when caught up.

        If this reader's next offset fell out of the ring, the chunk is a resync to
        `ring.resync_point()` (text empty); the next pull continues from there.
        """
        if not self._ring.holds(self._next):
            self._next = self._emitted = self._ring.resync_point()
            self._decoder.reset()
            self._cut_budget = 3
            return Chunk(seq=self._next, text="", resync=True)
        data = self._ring.read(self._next, max_bytes)
        if not data:
            return None
        self._next += len(data)
        if self._cut_budget:
            skip = _skip_continuations(data, self._cut_budget)
            self._cut_budget = self._cut_budget - skip if skip == len(data) else 0
            data = data[skip:]
        text = self._decoder.decode(data)
        pending = len(self._decoder.getstate()[0])
        self._emitted = self._next - pending
        return Chunk(seq=self._emitted, text=text)

    def flush(self) -> Chunk | None:
        """At the end of the stream: emit a held incomplete character as U+FFFD."""
        text = self._decoder.decode(b"", final=True)
        self._emitted = self._next
        return Chunk(seq=self._emitted, text=text) if text else None
