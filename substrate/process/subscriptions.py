"""Streaming a process's output to one subscriber (`proc.subscribe`, docs/protocol.md §5).

Theory of operation. A subscription is one Trio task (a *pump*) per subscriber. It
never holds output in memory beyond one piece: it reads each stream *by offset* from
where the bytes already are — the running command's spool (`OutputSink.read_at`), or,
once the command ended, its inline bytes or artifact — and sends a `proc.output`
notification of at most `PIECE_BYTES`. Whatever the command wrote since the last look is
coalesced into the next piece, so a chatty command costs one notification per
`POLL_S` per stream, not one per write. When both streams are sent to their end and
the command has ended, one `proc.exit` notification carries the result; the pump ends.

Slow subscribers. A send blocks while the subscriber's socket is full; that blocks only
its own pump (never the command, whose output goes to disk, nor other subscribers). A
subscriber more than `LAG_BYTES` behind a stream skips ahead to the last `PIECE_BYTES`
and the next notification says so with `skipped_from` (bytes [skipped_from, offset)
were not sent; they stay readable by resubscribing with `since` or from the artifact).
So a flood can never grow daemon memory, and a slow client learns exactly what it
missed.

`since` applies to both streams (stdout and stderr are separate byte sequences, each
with its own offsets); a subscriber that saw stdout up to a and stderr up to b
resumes with `since = min(a, b)` and drops what it already has (offsets make that
exact).

The pure parts (`encode_piece`, `complete_prefix`, `plan_read`) are tested without a
daemon in tests/process/test_subscriptions.py.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from substrate.errors import ArtifactUnknown
from substrate.schema.proc import OutputNotice

log = logging.getLogger("substrate.process.subscriptions")

#: Largest piece of output per notification.
PIECE_BYTES = 64 << 10
#: A subscriber further behind a stream than this skips ahead (see module doc).
LAG_BYTES = 4 << 20
#: How often a pump looks for new output of a running command (seconds).
POLL_S = 0.05
#: Subscriptions open at once, daemon-wide (each is one task and at most one piece).
MAX_SUBSCRIPTIONS = 1024

STREAMS = ("stdout", "stderr")


class Source(Protocol):
    """One output stream, readable by offset."""

    def size(self) -> int:
        """Bytes available now (grows while the command runs)."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """Up to `length` bytes at `offset` (blocking; a worker thread calls it)."""
        ...


class FixedSource:
    """A finished stream: its bytes in memory (inline) or in a stored artifact."""

    def __init__(
        self,
        size: int,
        *,
        data: bytes | None = None,
        reader: Callable[[int, int], bytes] | None = None,
    ) -> None:
        self._size = size
        self._data = data
        self._reader = reader

    def size(self) -> int:
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        if self._data is not None:
            return self._data[offset : offset + length]
        if self._reader is None:
            return b""
        return self._reader(offset, length)


# --- pure parts ---------------------------------------------------------------------------


def complete_prefix(data: bytes) -> int:
    """Length of `data` without a multi-byte UTF-8 sequence cut off at its end.

    Looks back at most 3 bytes; invalid bytes count as complete (they go out as base64).
    """
    for back in range(1, min(4, len(data) + 1)):
        b = data[-back]
        if b < 0x80:
            return len(data)
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


def encode_piece(
    proc: str, stream: str, offset: int, data: bytes, skipped_from: int | None
) -> OutputNotice:
    """The `proc.output` notification of one piece: text if valid UTF-8, else base64."""
    try:
        text: str | None = data.decode("utf-8")
        b64: str | None = None
    except UnicodeDecodeError:
        text, b64 = None, base64.b64encode(data).decode("ascii")
    return OutputNotice(
        proc=proc,
        stream="stdout" if stream == "stdout" else "stderr",
        offset=offset,
        data=text,
        data_b64=b64,
        skipped_from=skipped_from,
    )


@dataclass(frozen=True)
class ReadPlan:
    offset: int  # where to read
    length: int  # how much at most
    skipped_from: int | None  # set when the subscriber skips ahead


def plan_read(pos: int, size: int) -> ReadPlan | None:
    """What to read next of a stream at `pos` with `size` bytes available; None: nothing."""
    if size <= pos:
        return None
    if size - pos > LAG_BYTES:
        start = size - PIECE_BYTES
        return ReadPlan(start, PIECE_BYTES, pos)
    return ReadPlan(pos, min(PIECE_BYTES, size - pos), None)


# --- the pump -----------------------------------------------------------------------------


@dataclass
class Feed:
    """What a pump needs of one process."""

    proc: str
    sources: Mapping[str, Source]
    ended: Callable[[], bool]  # True once no byte will be added to any source
    changed: Callable[[float], Awaitable[None]]  # wait up to s seconds for news
    result: Callable[[], Any]  # the proc.exit payload, once ended


async def pump(
    feed: Feed,
    since: int,
    notify: Callable[[str, Any], Awaitable[None]],
    *,
    limiter: trio.CapacityLimiter | None = None,
) -> None:
    """Send `feed`'s output from byte `since` of each stream, then `proc.exit`; return."""
    pos = dict.fromkeys(feed.sources, since)
    while True:
        # Read before the sizes: once ended, the sizes read after it are final.
        ended = feed.ended()
        sent = False
        for name, source in feed.sources.items():
            size = source.size()
            plan = plan_read(pos[name], size)
            if plan is None:
                continue
            try:
                data = await trio.to_thread.run_sync(
                    source.read, plan.offset, plan.length, limiter=limiter
                )
            except ArtifactUnknown:
                # Collected under us: say so with a skip to the end.
                await notify("proc.output", encode_piece(feed.proc, name, size, b"", pos[name]))
                pos[name] = size
                sent = True
                continue
            more = not ended or plan.offset + len(data) < size
            if more:
                cut = complete_prefix(data)
                if cut > 0:
                    data = data[:cut]
            if not data:
                continue
            await notify(
                "proc.output",
                encode_piece(feed.proc, name, plan.offset, data, plan.skipped_from),
            )
            pos[name] = plan.offset + len(data)
            sent = True
        if ended and all(pos[n] >= s.size() for n, s in feed.sources.items()):
            await notify("proc.exit", feed.result())
            return
        if not sent:
            await feed.changed(POLL_S)


class Subscriptions:
    """The open subscriptions of a daemon; each is a pump task in `nursery`."""

    def __init__(self) -> None:
        self.open = 0

    def start(
        self,
        nursery: trio.Nursery,
        feed: Feed,
        since: int,
        notify: Callable[[str, Any], Awaitable[None]],
        on_close: list[Callable[[], None]],
    ) -> None:
        """Start a pump; it is cancelled when the connection closes (`on_close`).

        The caller checks `MAX_SUBSCRIPTIONS` first. Started with `start_soon` from the
        handler: the pump runs only after the handler's reply took the send lock, so
        `{subscribed: true}` always comes before the first notification.
        """
        scope = trio.CancelScope()
        on_close.append(scope.cancel)
        self.open += 1

        async def run() -> None:
            try:
                with scope:
                    await pump(feed, since, notify)
            except Exception:
                log.exception("%s: subscription failed", feed.proc)
            finally:
                self.open -= 1
                if scope.cancel in on_close:
                    on_close.remove(scope.cancel)

        nursery.start_soon(run)
