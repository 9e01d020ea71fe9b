"""Handlers of `artifact.*` (docs/protocol.md §6): bounded reads of stored output, in worker threads.

The store is the execution layer's (`Execution.artifacts`). Every call reads
files only; none changes state except `artifact.lines`, which may write a line index
(atomically, by rename), so a cancelled call is never abandoned mid-way.
"""

from __future__ import annotations

import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import ArtifactServices
from substrate.artifacts.store import compile_grep
from substrate.matching import agent_regex
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

handles = Handles(ArtifactServices)


@handles("artifact.stat")
async def stat(s: ArtifactServices, caller: Caller, p: StatParams) -> StatResult:
    return await trio.to_thread.run_sync(s.artifacts.stat, p.artifact, limiter=s.fs_limiter)


@handles("artifact.read")
async def read(s: ArtifactServices, caller: Caller, p: ReadParams) -> ReadResult:
    return await trio.to_thread.run_sync(
        s.artifacts.read, p.artifact, p.offset, p.length, limiter=s.fs_limiter
    )


@handles("artifact.lines")
async def lines(s: ArtifactServices, caller: Caller, p: LinesParams) -> LinesResult:
    return await trio.to_thread.run_sync(
        s.artifacts.lines, p.artifact, p.start, p.count, limiter=s.fs_limiter
    )


@handles("artifact.grep")
async def grep(s: ArtifactServices, caller: Caller, p: GrepParams) -> GrepResult:
    # Compiled off the loop, then given its thread by its kind, as `fs.search`.
    matcher = await trio.to_thread.run_sync(_grep_matcher, p)
    limiter = s.fs_limiter if matcher.exact is not None else s.backtrack_limiter
    return await trio.to_thread.run_sync(
        s.artifacts.grep_with, p.artifact, matcher, p.max_matches, limiter=limiter
    )


def _grep_matcher(p: GrepParams) -> agent_regex.Matcher:
    """`artifact.grep`'s bounded matcher. Refuses `invalid_params` for a bad pattern."""
    return agent_regex.matcher_for(
        compile_grep(p.pattern, fixed=p.fixed, ignore_case=p.ignore_case)
    )
