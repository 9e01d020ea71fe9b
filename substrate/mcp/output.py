"""`proc_output`: a process's output so far, collected from `proc.subscribe` (sans-IO).

Theory of operation: MCP has no notifications a model reads, so `proc_output` turns
the daemon's stream into one bounded answer. The server asks `proc.status` for the
sizes of both streams, subscribes on a connection of its own, feeds every notification
to an `OutputCollector`, and closes the connection once each stream reached the size
it had when asked (or the budget), or `proc.exit` came. Bytes written after the status
are left for the next call, so a call never waits on a quiet command.

Each stream has its own start (`stdout_since`, `stderr_since`; a stream's `next` is the
value to pass back), unlike `proc.subscribe`, whose one `since` applies to both: a
stream that stays empty would otherwise hold the other at its start. The subscription
starts at the smaller start among the streams that have bytes past theirs; bytes below
a stream's own start are dropped here. A stream more than 4 MiB behind is skipped ahead
by the daemon: `skipped_from` then says which bytes were not sent (read them from the
artifact once the command ends).

`OutputParams` is the one tool input that is not a daemon method's params: a Struct
here, its schema generated like the others.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec

from substrate.schema.common import NonNegative, Params
from substrate.schema.proc import ProcId

STREAMS = ("stdout", "stderr")


def complete_prefix(data: bytes) -> int:
    """Length of `data` without a multi-byte UTF-8 sequence cut off at its end (as
    `substrate.process.subscriptions.complete_prefix`; not imported, as that would load
    the whole execution layer into this client)."""
    for back in range(1, min(4, len(data) + 1)):
        b = data[-back]
        if b < 0x80:
            return len(data)
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


class OutputParams(Params):
    """`proc_output`'s params."""

    proc: ProcId
    stdout_since: NonNegative = 0  # byte offset of stdout to start at (a `next`)
    stderr_since: NonNegative = 0  # byte offset of stderr to start at


class StreamSlice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Bytes [offset, next) of one stream, as UTF-8 text (invalid bytes as U+FFFD)."""

    offset: int
    next: int  # pass as this stream's `*_since` to continue
    size: int  # bytes the stream held when asked
    data: str
    skipped_from: int | None = None  # bytes [skipped_from, offset) were not sent


class ProcOutput(msgspec.Struct, kw_only=True):
    """What `proc_output` answers. `more`: a stream held bytes past its `next` when asked
    (left out for the size budget); a running command may write more either way."""

    proc: str
    state: Literal["running", "exited", "lost"]
    stdout: StreamSlice
    stderr: StreamSlice
    more: bool


class OutputCollector:
    """The pieces of one process's streams from `since[stream]` up to `sizes` (at most
    `budget` bytes each). Subscribe from `subscribe_since`, feed it `proc.output` and
    `proc.exit` notifications; `done` says when to stop."""

    def __init__(
        self, proc: str, since: dict[str, int], sizes: dict[str, int], budget: int
    ) -> None:
        self.proc = proc
        self.sizes = sizes
        self.budget = budget
        self.ends = {s: max(since[s], min(sizes[s], since[s] + budget)) for s in STREAMS}
        self.start = {s: since[s] for s in STREAMS}
        self.bufs = {s: bytearray() for s in STREAMS}
        self.skipped: dict[str, int | None] = dict.fromkeys(STREAMS)
        self.exited = False

    @property
    def subscribe_since(self) -> int:
        """Where to subscribe: the smallest start of a stream that wants bytes."""
        wanted = [self.start[s] for s in STREAMS if self.start[s] < self.ends[s]]
        return min(wanted, default=0)

    def pos(self, stream: str) -> int:
        return self.start[stream] + len(self.bufs[stream])

    @property
    def done(self) -> bool:
        return self.exited or all(self.pos(s) >= self.ends[s] for s in STREAMS)

    def feed(self, message: dict[str, Any]) -> bool:
        """Take one notification (others' are ignored); True once `done`."""
        params = message.get("params")
        if not isinstance(params, dict) or params.get("proc") != self.proc:
            return self.done
        if message.get("method") == "proc.exit":
            self.exited = True
        elif message.get("method") == "proc.output" and params.get("stream") in STREAMS:
            self._piece(params)
        return self.done

    def _piece(self, params: dict[str, Any]) -> None:
        stream = params["stream"]
        offset = int(params.get("offset", 0))
        if params.get("data") is not None:
            data = str(params["data"]).encode("utf-8", "surrogatepass")
        else:
            data = base64.b64decode(params.get("data_b64") or "")
        pos = self.pos(stream)
        if offset + len(data) <= pos:
            return  # below this stream's start, or had already
        if offset > pos:  # the daemon skipped ahead
            if self.bufs[stream]:
                self.ends[stream] = pos  # keep what is contiguous
                return
            self.start[stream] = offset
            self.skipped[stream] = int(params.get("skipped_from") or pos)
            self.ends[stream] = max(offset, min(self.sizes[stream], offset + self.budget))
            pos = offset
        data = data[pos - offset :]
        room = self.ends[stream] - pos
        if room > 0:
            self.bufs[stream] += data[:room]

    def _slice(self, stream: str, budget: int) -> StreamSlice:
        raw = bytes(self.bufs[stream][:budget])
        if self.start[stream] + len(raw) < self.sizes[stream]:
            raw = raw[: complete_prefix(raw)]  # the next call starts on a character
        return StreamSlice(
            offset=self.start[stream],
            next=self.start[stream] + len(raw),
            size=self.sizes[stream],
            data=raw.decode("utf-8", "replace"),
            skipped_from=self.skipped[stream],
        )

    def result(self, state: str, limit: int) -> ProcOutput:
        """The answer, its JSON at most `limit` bytes (text with many escapes is cut
        shorter; `next` always matches what was returned)."""
        budget = max(len(b) for b in self.bufs.values())
        while True:
            out = ProcOutput(
                proc=self.proc,
                state="running" if state == "running" else "lost" if state == "lost" else "exited",
                stdout=self._slice("stdout", budget),
                stderr=self._slice("stderr", budget),
                more=False,
            )
            out.more = any(getattr(out, s).next < self.sizes[s] for s in STREAMS)
            if budget == 0 or len(msgspec.json.encode(out)) <= limit:
                return out
            budget //= 2
