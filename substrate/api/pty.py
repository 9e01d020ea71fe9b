"""Handlers of `pty.selection` and `pty.list`: agents read terminal scrollback only here."""

from __future__ import annotations

from substrate.api.base import Caller, Handles
from substrate.api.services import PtyServices
from substrate.schema.common import Empty
from substrate.schema.pty import SelectionParams, SelectionResult, SessionList

handles = Handles(PtyServices)


@handles("pty.selection")
async def selection(s: PtyServices, caller: Caller, p: SelectionParams) -> SelectionResult:
    """At most `max_bytes` (≤ 64 KiB) of scrollback; refuses `process_unknown`."""
    return s.sessions.selection(p.session, p.since, p.max_bytes)


@handles("pty.list")
async def list_(s: PtyServices, caller: Caller, p: Empty) -> SessionList:
    return s.sessions.list()
