"""Handlers of `workspace.*` and `approval.grant`.

Checkpoint and restore run in threads that are never abandoned, like guarded writes.
`workspace.info` measures the persistent home and `workspace.release {keep_home: false}`
removes it (`substrate.workspace.homes`, docs/environments.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import trio

from substrate.api.base import Caller, handles
from substrate.errors import Internal
from substrate.schema.workspace import (
    AdoptParams,
    ApprovalGrantParams,
    ApprovalGrantResult,
    CheckpointParams,
    CheckpointResult,
    ReleaseParams,
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

log = logging.getLogger("substrate.api.workspace")


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
    found = await trio.to_thread.run_sync(ws.info)
    homes = daemon.execution.homes
    # A bounded walk (homes.MAX_USAGE_ENTRIES): at most a few hundred milliseconds.
    home = await trio.to_thread.run_sync(homes.usage, ws.checkout, limiter=daemon.fs_limiter)
    return msgspec.structs.replace(found, home=home)


@handles("workspace.release")
async def release(daemon: Daemon, caller: Caller, p: ReleaseParams) -> ReleaseResult:
    ws = daemon.workspaces.get(p.workspace)
    await daemon.execution.release_workspace(ws)
    await trio.to_thread.run_sync(daemon.workspaces.release, ws.id, caller.name)
    if p.keep_home:
        return ReleaseResult(workspace=ws.id, released=True, home="kept")
    # Its sandboxes are gone and the checkout is no longer adopted: nothing uses the home.
    removed = await trio.to_thread.run_sync(
        _remove_home, daemon, ws.checkout, ws.root_id, ws.id, caller.name
    )
    return ReleaseResult(workspace=ws.id, released=True, home="removed" if removed else "none")


def _remove_home(daemon: Daemon, checkout: str, root_id: str, workspace: str, actor: str) -> bool:
    """Remove the checkout's homes, every uid's and secret set's (`Homes.remove`) and journal it; False: it had none.
    Refuses `internal` when it cannot be removed whole (the workspace stays released)."""
    try:
        if not daemon.execution.homes.remove(checkout):
            return False
    except OSError as exc:
        # The reason names a host path: the log has it, the client does not.
        log.error("workspace %s: its home could not be removed whole: %s", workspace, exc)
        raise Internal(
            "the workspace was released, but its home could not be removed whole (see the log)"
        ) from None
    daemon.journal.append(
        "workspace.home_removed", {"root_id": root_id}, workspace=workspace, actor=actor
    )
    return True


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
