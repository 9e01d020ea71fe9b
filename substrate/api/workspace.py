"""Handlers of `workspace.*` and `approval.grant`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.schema.workspace import (
    AdoptParams,
    ApprovalGrantParams,
    ApprovalGrantResult,
    ReleaseResult,
    WorkspaceInfo,
    WorkspaceList,
    WorkspaceListParams,
    WorkspaceRef,
)

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("workspace.adopt")
async def adopt(daemon: Daemon, caller: Caller, p: AdoptParams) -> WorkspaceInfo:
    ws = await trio.to_thread.run_sync(
        daemon.workspaces.adopt, p.path, p.root_id, p.policy, caller.name
    )
    return await trio.to_thread.run_sync(ws.info)


@handles("workspace.list")
async def list_(daemon: Daemon, caller: Caller, p: WorkspaceListParams) -> WorkspaceList:
    spaces = daemon.workspaces.all()
    return WorkspaceList(
        workspaces=await trio.to_thread.run_sync(lambda: [ws.info() for ws in spaces])
    )


@handles("workspace.info")
async def info(daemon: Daemon, caller: Caller, p: WorkspaceRef) -> WorkspaceInfo:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(ws.info)


@handles("workspace.release")
async def release(daemon: Daemon, caller: Caller, p: WorkspaceRef) -> ReleaseResult:
    ws = daemon.workspaces.get(p.workspace)
    if daemon.execution is not None:
        await daemon.execution.release_workspace(ws)
    await trio.to_thread.run_sync(daemon.workspaces.release, ws.id, caller.name)
    return ReleaseResult(workspace=ws.id, released=True)


@handles("approval.grant")
async def approve(daemon: Daemon, caller: Caller, p: ApprovalGrantParams) -> ApprovalGrantResult:
    ws = daemon.workspaces.get(p.workspace)
    approval_id, expires = await trio.to_thread.run_sync(
        daemon.workspaces.grant_approval, ws, p.plan_digest, p.ttl_s, caller.name
    )
    return ApprovalGrantResult(approval_id=approval_id, expires=expires)
