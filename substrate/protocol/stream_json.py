"""Reading an agent CLI's stream-json output as `proc.output` pieces arrive (docs/agent-provider.md).

Agent CLIs run headless print one JSON object a line on stdout (`claude -p
--output-format stream-json --verbose`: `system`/`init`, `assistant`, `user` tool
results, a last `result` with the session id). substrate delivers a command's stdout in
pieces (`proc.output {proc, stream, offset, data | data_b64, skipped_from?}`, at most
64 KiB each, cut on character boundaries, never on lines), so a client must join pieces
into lines before it can decode them. `StreamJsonReader` does that, sans-IO: give it the
params of each `proc.output` notification of one stream (or raw bytes) and it returns
the lines completed so far, each decoded or marked with why it was not.

Theory of operation. The reader keeps the bytes of the line not finished yet and the
offset it expects next. A piece that starts before that offset (a resubscription with
an older `since`) has its known prefix dropped. A piece that starts after it, or carries
`skipped_from` (the daemon skipped a subscriber that fell more than 4 MiB behind), is a
hole: the unfinished line is reported as a `gap` and everything up to the next newline
is dropped with it (a line whose start is lost cannot be decoded). `finish()` at the
end of the stream reports a last line without its newline.

Bounds: a line longer than `max_line_bytes` is never held whole: its first bytes are
dropped as soon as it passes the bound and the line is reported once as `too_long`;
memory stays within `max_line_bytes` plus one piece. Nesting deeper than the decoder
allows is `not_json`. Cost: one scan of each piece for newlines, one decode per line.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

#: A line longer than this (bytes, without its newline) is reported `too_long`, not held.
#: Tool results carry whole files: 16 MiB is well above what a CLI prints on one line.
DEFAULT_MAX_LINE_BYTES = 16 << 20

#: Why a line has no `event`: not JSON (or nested too deep), JSON but not an object,
#: longer than the bound, cut by a hole in the stream, or a piece that could not be read.
LineError = Literal["not_json", "not_object", "too_long", "gap", "bad_piece"]


class StreamLine(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the stream: bytes `[offset, offset + size)`, without the newline.

    `event` is the decoded JSON object, or None with `error` saying why (a `gap` line's
    `size` counts only the bytes received before the hole).
    """

    offset: int
    size: int
    event: dict[str, Any] | None = None
    error: LineError | None = None


class StreamJsonReader:
    """Join one stream's pieces into JSON lines (see the module docstring).

    `max_line_bytes` bounds the line held in memory (at least 1); `since` is the offset
    the subscription starts at (`proc.subscribe {since}`).
    """

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, *, since: int = 0) -> None:
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be at least 1")
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()
        self._line_start = since  # stream offset of the unfinished line's first byte
        self._next = since  # stream offset the next piece should start at
        self._dropping: LineError | None = None  # the unfinished line is being dropped: why

    @property
    def offset(self) -> int:
        """The stream offset after the last byte fed (resubscribe with this as `since`)."""
        return self._next

    def feed_output(self, params: Mapping[str, Any]) -> list[StreamLine]:
        """The lines a `proc.output` notification's `params` complete.

        Reads `offset` and `data` (text) or `data_b64`; a hole (`skipped_from`, or any
        offset past the bytes fed) shows as the offset itself. A piece whose fields are
        missing or not decodable is one `bad_piece` line, and the next piece starts after
        a hole. The caller picks the stream (`params["stream"]`).
        """
        offset = params.get("offset")
        data = params.get("data")
        b64 = params.get("data_b64")
        raw: bytes | None = None
        if isinstance(data, str):
            raw = data.encode("utf-8", "surrogatepass")
        elif isinstance(b64, str):
            try:
                raw = base64.b64decode(b64, validate=True)
            except binascii.Error:
                raw = None
        elif data is None and b64 is None:
            raw = b""  # an empty piece (it may carry only `skipped_from`)
        if not isinstance(offset, int) or offset < 0 or raw is None:
            at = offset if isinstance(offset, int) and offset >= 0 else self._next
            lines = self._hole()
            lines.append(StreamLine(offset=at, size=0, error="bad_piece"))
            return lines
        return self.feed(raw, offset)

    def feed(self, data: bytes, offset: int | None = None) -> list[StreamLine]:
        """The lines `data` completes; `offset` is where `data` starts in the stream
        (None: right after the last byte fed). A start past the last byte fed is a hole."""
        lines: list[StreamLine] = []
        start = self._next if offset is None else offset
        if start > self._next:
            lines.extend(self._hole())
            self._next = start
        elif start < self._next:
            data = data[self._next - start :]  # a prefix already seen (an older `since`)
        base = self._next
        pos = 0
        while pos < len(data):
            newline = data.find(b"\n", pos)
            if newline < 0:
                self._take(data[pos:])
                break
            self._take(data[pos:newline])
            lines.extend(self._end_line(base + newline))
            pos = newline + 1
        self._next = base + len(data)
        return lines

    def finish(self) -> list[StreamLine]:
        """The end of the stream: a last line without its newline, if any."""
        if self._line_start >= self._next and self._dropping is None:
            return []
        return self._end_line(self._next)

    # -- internals ---------------------------------------------------------------------------

    def _take(self, chunk: bytes) -> None:
        """Add bytes of the unfinished line, or drop them (after a hole, past the bound)."""
        if self._dropping is not None:
            return
        if len(self._buf) + len(chunk) > self.max_line_bytes:
            self._buf.clear()
            self._dropping = "too_long"
            return
        self._buf += chunk

    def _end_line(self, end: int) -> list[StreamLine]:
        """The unfinished line ends at stream offset `end` (its newline, or the end)."""
        line_start, dropping = self._line_start, self._dropping
        raw = bytes(self._buf)
        self._buf.clear()
        self._dropping = None
        self._line_start = end + 1
        if dropping == "gap":
            return []  # reported when the hole was found
        if dropping is not None:
            return [StreamLine(offset=line_start, size=end - line_start, error=dropping)]
        text = raw.rstrip(b"\r")
        if not text.strip():
            return []  # blank lines carry nothing
        return [decode_line(text, line_start, end - line_start)]

    def _hole(self) -> list[StreamLine]:
        """Bytes are missing before the next piece: report and drop the unfinished line,
        and whatever follows the hole up to the next newline (its start is lost)."""
        if self._dropping == "gap":
            return []  # this line's hole is reported already
        received = 0 if self._dropping is not None else len(self._buf)
        self._buf.clear()
        self._dropping = "gap"
        return [StreamLine(offset=self._line_start, size=received, error="gap")]


def decode_line(text: bytes, offset: int = 0, size: int | None = None) -> StreamLine:
    """One line's bytes (no newline) as a `StreamLine`: the object, or why not."""
    size = len(text) if size is None else size
    try:
        value = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return StreamLine(offset=offset, size=size, error="not_json")
    if not isinstance(value, dict):
        return StreamLine(offset=offset, size=size, error="not_object")
    return StreamLine(offset=offset, size=size, event=value)


def session_id(lines: Iterable[StreamLine]) -> str | None:
    """The last `session_id` any event carried (the `result` event's, normally)."""
    found: str | None = None
    for line in lines:
        value = None if line.event is None else line.event.get("session_id")
        if isinstance(value, str):
            found = value
    return found


def result_event(lines: Iterable[StreamLine]) -> dict[str, Any] | None:
    """The last event of `type: "result"` (the turn's outcome), or None if none came."""
    found: dict[str, Any] | None = None
    for line in lines:
        if line.event is not None and line.event.get("type") == "result":
            found = line.event
    return found
