"""Handlers of `fs.*`: reads and guarded writes, each in a worker thread.

Writes run in threads that are never abandoned, so a cancelled request or a daemon
shutting down still lets a started write finish and journal itself
(`substrate.store.hop.run_to_end`: one hop each way through trio's thread cache, counted
against trio's default thread limiter as `trio.to_thread.run_sync` would be, without its
extra scheduling round, its context copy and its per-call thread renaming - about a
third of a write's two hops).

Reads share `fs_limiter` and stay bounded there: a file digest is computed inline only up
to `inline_hash_bytes`. `fs.stat` is the exception that runs on the event loop first: a
thread hop costs more than the stat itself (two wake-ups, about half of a round trip),
and the stat's work there is bounded - one `openat2` beneath the root fd, an lstat, and
for a regular file an open, an fstat and at most `LOOP_HASH_BYTES` hashed. Only when the
digest needs more than that (a file over `LOOP_HASH_BYTES`, not cached, and within
`inline_hash_bytes`) does the stat go to a worker thread, as any read. A bigger one is computed only on request (`hash: true`), on
`hash_limiter`'s own few threads, so long hashes never hold the threads small reads need;
such a hash only reads, so a cancelled request abandons it (it finishes and is cached).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import FsServices
from substrate.schema.fs import (
    DeleteParams,
    ListParams,
    ListResult,
    PatchParams,
    Plan,
    ReadParams,
    ReadResult,
    SearchParams,
    SearchResult,
    StatParams,
    StatResult,
    WalkParams,
    WalkResult,
    WriteParams,
    patch_request,
    write_request,
)
from substrate.store.hop import run_to_end
from substrate.workspace import reads, search

if TYPE_CHECKING:
    from substrate.workspace.digests import Digests
    from substrate.workspace.registry import Workspace

handles = Handles(FsServices)

_R = TypeVar("_R", StatResult, ReadResult)
#: The most bytes `fs.stat` hashes on the event loop (tens of microseconds of SHA-256).
LOOP_HASH_BYTES = 64 << 10


async def _answered(
    s: FsServices,
    reader: Callable[[Workspace, Any, Digests, int | None], _R],
    p: StatParams | ReadParams,
) -> _R:
    """`reader` with the inline digest bound (fs_limiter); a digest it deferred is computed
    on the hash limiter only when the call asked for it (`hash: true`)."""
    ws = s.workspaces.get(p.workspace)
    inline = s.config.inline_hash_bytes
    result = await trio.to_thread.run_sync(reader, ws, p, s.digests, inline, limiter=s.fs_limiter)
    if result.sha256_deferred and p.hash:
        result = await trio.to_thread.run_sync(
            reader, ws, p, s.digests, None, limiter=s.hash_limiter, abandon_on_cancel=True
        )
    return result


@handles("fs.stat")
async def stat(s: FsServices, caller: Caller, p: StatParams) -> StatResult:
    inline = s.config.inline_hash_bytes
    ws = s.workspaces.get(p.workspace)
    # On the loop, hashing at most LOOP_HASH_BYTES; what it could not finish goes on.
    quick = reads.stat_path(ws, p, s.digests, min(inline, LOOP_HASH_BYTES))
    if quick.sha256_deferred and (quick.size <= inline or p.hash):
        return await _answered(s, reads.stat_path, p)
    await trio.lowlevel.checkpoint()
    return quick


@handles("fs.read")
async def read(s: FsServices, caller: Caller, p: ReadParams) -> ReadResult:
    return await _answered(s, reads.read_file, p)


@handles("fs.list")
async def list_(s: FsServices, caller: Caller, p: ListParams) -> ListResult:
    ws = s.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(reads.list_dir, ws, p, limiter=s.fs_limiter)


@handles("fs.walk")
async def walk(s: FsServices, caller: Caller, p: WalkParams) -> WalkResult:
    ws = s.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(reads.walk, ws, p, limiter=s.fs_limiter)


@handles("fs.search")
async def search_(s: FsServices, caller: Caller, p: SearchParams) -> SearchResult:
    ws = s.workspaces.get(p.workspace)
    # Compiled off the loop (a crafted 4 KiB pattern takes tens of ms), on trio's own
    # threads; then a backtracking one gets threads of its own (`backtrack_limiter`).
    matcher = await trio.to_thread.run_sync(search.matcher, p)
    if matcher.exact is None:
        return await trio.to_thread.run_sync(
            search.search, ws, p, matcher, limiter=s.backtrack_limiter
        )
    # RE2: half of the files searched by a second process when it is free (`search_pool`).
    run = search.search if s.search_pool is None else s.search_pool.search
    return await trio.to_thread.run_sync(run, ws, p, matcher, limiter=s.fs_limiter)


@handles("fs.write")
async def write(s: FsServices, caller: Caller, p: WriteParams) -> Plan:
    ws = s.workspaces.get(p.workspace)

    def run() -> Plan:
        # Decoded here, at the edge (and off the event loop: a base64 decode).
        return s.writer.write(ws, write_request(p), caller.name)

    return await run_to_end(run)


@handles("fs.patch")
async def patch(s: FsServices, caller: Caller, p: PatchParams) -> Plan:
    ws = s.workspaces.get(p.workspace)

    def run() -> Plan:
        return s.writer.patch(ws, patch_request(p), caller.name)

    return await run_to_end(run)


@handles("fs.delete")
async def delete(s: FsServices, caller: Caller, p: DeleteParams) -> Plan:
    ws = s.workspaces.get(p.workspace)
    return await run_to_end(lambda: s.writer.delete(ws, p, caller.name))
