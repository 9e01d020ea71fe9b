"""Handlers of `fs.*`: reads and guarded writes, each in a worker thread.

Writes run in threads that are never abandoned (trio's default), so a cancelled request
or a daemon shutting down still lets a started write finish and journal itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from substrate import reads
from substrate.api.base import Caller, handles
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
)

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("fs.stat")
async def stat(daemon: Daemon, caller: Caller, p: StatParams) -> StatResult:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(reads.stat_path, ws, p, limiter=daemon.fs_limiter)


@handles("fs.read")
async def read(daemon: Daemon, caller: Caller, p: ReadParams) -> ReadResult:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(reads.read_file, ws, p, limiter=daemon.fs_limiter)


@handles("fs.list")
async def list_(daemon: Daemon, caller: Caller, p: ListParams) -> ListResult:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(reads.list_dir, ws, p, limiter=daemon.fs_limiter)


@handles("fs.walk")
async def walk(daemon: Daemon, caller: Caller, p: WalkParams) -> WalkResult:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(reads.walk, ws, p, limiter=daemon.fs_limiter)


@handles("fs.search")
async def search(daemon: Daemon, caller: Caller, p: SearchParams) -> SearchResult:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(reads.search, ws, p, limiter=daemon.fs_limiter)


@handles("fs.write")
async def write(daemon: Daemon, caller: Caller, p: WriteParams) -> Plan:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(daemon.writer.write, ws, p, caller.name)


@handles("fs.patch")
async def patch(daemon: Daemon, caller: Caller, p: PatchParams) -> Plan:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(daemon.writer.patch, ws, p, caller.name)


@handles("fs.delete")
async def delete(daemon: Daemon, caller: Caller, p: DeleteParams) -> Plan:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(daemon.writer.delete, ws, p, caller.name)
