"""Handlers of `pty.selection` and `pty.list`: agents read terminal scrollback only here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from substrate.api.base import Caller, handles
from substrate.errors import ProcessUnknown
from substrate.schema.common import Empty
from substrate.schema.pty import SelectionParams, SelectionResult, SessionList

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("pty.selection")
async def selection(daemon: Daemon, caller: Caller, p: SelectionParams) -> SelectionResult:
    """At most `max_bytes` (≤ 64 KiB) of scrollback; refuses `process_unknown`."""
    if daemon.terminals is None:
        raise ProcessUnknown("no such terminal session", session=p.session)
    result: SelectionResult = daemon.terminals.sessions.selection(p.session, p.since, p.max_bytes)
    return result


@handles("pty.list")
async def list_(daemon: Daemon, caller: Caller, p: Empty) -> SessionList:
    if daemon.terminals is None:
        return SessionList(sessions=[])
    result: SessionList = daemon.terminals.sessions.list()
    return result
