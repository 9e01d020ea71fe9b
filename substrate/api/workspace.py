"""Handlers of `workspace.*` and `approval.grant`.

Checkpoint and restore run in threads that are never abandoned, like guarded writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.schema.workspace import (
    AdoptParams,
    ApprovalGrantParams,
    ApprovalGrantResult,
    CheckpointParams,
    CheckpointResult,
    ReleaseResult,
    RestoreParams,
    RestoreResult,
    SetPolicyParams,
    WorkspaceInfo,
    WorkspaceList,
    WorkspaceListParams,
    WorkspaceRef,
)
from substrate.workspace.restore import restore as restore_checkpoint

if TYPE_CHECKING:
    from substrate.daemon import Daemon


def _mounts(daemon: Daemon) -> dict[str, list[str]]:
    return {ws.id: ws.policy.readonly_dirs() for ws in daemon.workspaces.all()}


async def _restart_sandboxes(daemon: Daemon, before: dict[str, list[str]]) -> None:
    """A sandbox binds the policy's read-only dirs when it is made: one whose set changed
    (a policy changed, here or in a checkout nested in or enclosing it) is removed, and
    made again with the new mounts on next use. Its running commands end."""
    for ws in daemon.workspaces.all():
        if ws.id in before and before[ws.id] != ws.policy.readonly_dirs():
            await daemon.execution.release_workspace(ws)


@handles("workspace.adopt")
async def adopt(daemon: Daemon, caller: Caller, p: AdoptParams) -> WorkspaceInfo:
    before = _mounts(daemon)
    ws = await trio.to_thread.run_sync(
        daemon.workspaces.adopt, p.path, p.root_id, p.policy, caller.name
    )
    # Change sets kept from an earlier adoption of this checkout are this one's now.
    await trio.to_thread.run_sync(daemon.execution.changesets.reattach, ws)
    await _restart_sandboxes(daemon, before)
    return await trio.to_thread.run_sync(ws.info)


@handles("workspace.set_policy")
async def set_policy(daemon: Daemon, caller: Caller, p: SetPolicyParams) -> WorkspaceInfo:
    before = _mounts(daemon)
    ws = await trio.to_thread.run_sync(
        daemon.workspaces.set_policy, p.workspace, p.policy, caller.name
    )
    await _restart_sandboxes(daemon, before)
    return await trio.to_thread.run_sync(ws.info)


@handles("workspace.list")
async def list_(daemon: Daemon, caller: Caller, p: WorkspaceListParams) -> WorkspaceList:
    return WorkspaceList(workspaces=await trio.to_thread.run_sync(daemon.workspaces.infos))


@handles("workspace.info")
async def info(daemon: Daemon, caller: Caller, p: WorkspaceRef) -> WorkspaceInfo:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(ws.info)


@handles("workspace.release")
async def release(daemon: Daemon, caller: Caller, p: WorkspaceRef) -> ReleaseResult:
    ws = daemon.workspaces.get(p.workspace)
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


@handles("workspace.checkpoint")
async def checkpoint(daemon: Daemon, caller: Caller, p: CheckpointParams) -> CheckpointResult:
    ws = daemon.workspaces.get(p.workspace)
    checkpoint_id, seq = await trio.to_thread.run_sync(daemon.checkpoints.create, ws, caller.name)
    return CheckpointResult(checkpoint=checkpoint_id, seq=seq)


@handles("workspace.restore")
async def restore(daemon: Daemon, caller: Caller, p: RestoreParams) -> RestoreResult:
    ws = daemon.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(
        restore_checkpoint,
        daemon.writer,
        daemon.checkpoints,
        daemon.journal,
        ws,
        p.checkpoint,
        p.dry_run,
        caller.name,
    )
