"""Wire schema of terminal scrollback for agents (docs/protocol.md §7)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import Empty, NonNegative, Params, Result, method

SessionId = Annotated[str, msgspec.Meta(pattern="^t-[0-9a-f]{16,32}$")]


class SelectionParams(Params):
    session: SessionId
    since: NonNegative | None = None  # omitted: the newest max_bytes of the ring
    max_bytes: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 65536


class SelectionResult(Result):
    session: str
    seq: int  # offset of the first byte covered by `data`
    next: int  # offset just past the last byte covered: pass as `since` to continue
    end: int  # offset just past the newest byte the session produced
    truncated: bool  # True when `since` had fallen out of the ring (bytes were lost)
    data: str  # UTF-8 text; invalid bytes as U+FFFD, never a split character


class SessionInfo(Result):
    session: str
    workspace: str
    profile: str
    state: Literal["running", "ended"]
    cols: int
    rows: int
    controller: bool  # a controller is attached
    observers: int
    end: int  # bytes produced so far
    exit_code: int | None = None


class SessionList(Result):
    sessions: list[SessionInfo]


method(
    "pty.selection",
    SelectionParams,
    SelectionResult,
    doc="Read a terminal session's scrollback (bounded; the only way agents see it).",
)
method("pty.list", Empty, SessionList, doc="Terminal sessions of this daemon run.")
