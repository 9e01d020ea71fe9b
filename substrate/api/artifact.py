"""Handlers of `artifact.*` (docs/protocol.md §6): bounded reads of stored output, in worker threads.

The store is the execution layer's (`daemon.execution.artifacts`). Every call reads
files only; none changes state except `artifact.lines`, which may write a line index
(atomically, by rename), so a cancelled call is never abandoned mid-way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.artifacts.store import compile_grep
from substrate.schema.artifact import (
    GrepParams,
    GrepResult,
    LinesParams,
    LinesResult,
    ReadParams,
    ReadResult,
    StatParams,
    StatResult,
)
from substrate.workspace import agent_regex

if TYPE_CHECKING:
    from substrate.artifacts.store import ArtifactStore
    from substrate.daemon import Daemon


def _store(daemon: Daemon) -> ArtifactStore:
    return daemon.execution.artifacts


@handles("artifact.stat")
async def stat(daemon: Daemon, caller: Caller, p: StatParams) -> StatResult:
    store = _store(daemon)
    return await trio.to_thread.run_sync(store.stat, p.artifact, limiter=daemon.fs_limiter)


@handles("artifact.read")
async def read(daemon: Daemon, caller: Caller, p: ReadParams) -> ReadResult:
    store = _store(daemon)
    return await trio.to_thread.run_sync(
        store.read, p.artifact, p.offset, p.length, limiter=daemon.fs_limiter
    )


@handles("artifact.lines")
async def lines(daemon: Daemon, caller: Caller, p: LinesParams) -> LinesResult:
    store = _store(daemon)
    return await trio.to_thread.run_sync(
        store.lines, p.artifact, p.start, p.count, limiter=daemon.fs_limiter
    )


@handles("artifact.grep")
async def grep(daemon: Daemon, caller: Caller, p: GrepParams) -> GrepResult:
    store = _store(daemon)
    # Compiled off the loop, then given its thread by its kind, as `fs.search`.
    matcher = await trio.to_thread.run_sync(_grep_matcher, p)
    limiter = daemon.fs_limiter if matcher.exact is not None else daemon.backtrack_limiter
    return await trio.to_thread.run_sync(
        store.grep_with, p.artifact, matcher, p.max_matches, limiter=limiter
    )


def _grep_matcher(p: GrepParams) -> agent_regex.Matcher:
    """`artifact.grep`'s bounded matcher. Refuses `invalid_params` for a bad pattern."""
    return agent_regex.matcher_for(
        compile_grep(p.pattern, fixed=p.fixed, ignore_case=p.ignore_case)
    )
