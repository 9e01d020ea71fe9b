"""Handlers of `pty.selection` and `pty.list`: agents read terminal scrollback only here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from substrate.api.base import Caller, handles
from substrate.schema.common import Empty
from substrate.schema.pty import SelectionParams, SelectionResult, SessionList

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("pty.selection")
async def selection(daemon: Daemon, caller: Caller, p: SelectionParams) -> SelectionResult:
    """At most `max_bytes` (≤ 64 KiB) of scrollback; refuses `process_unknown`."""
    return daemon.terminals.sessions.selection(p.session, p.since, p.max_bytes)


@handles("pty.list")
async def list_(daemon: Daemon, caller: Caller, p: Empty) -> SessionList:
    return daemon.terminals.sessions.list()
