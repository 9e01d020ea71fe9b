"""Handlers of `workspace.*` and `approval.grant`.

Checkpoint and restore run in threads that are never abandoned, like guarded writes.
`workspace.info` measures the persistent home and `workspace.release {keep_home: false}`
removes it (`substrate.workspace.homes`, docs/environments.md).
"""

from __future__ import annotations

import logging
from typing import Literal

import msgspec
import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import WorkspaceServices
from substrate.errors import Internal
from substrate.schema.workspace import (
    AdoptParams,
    ApprovalGrantParams,
    ApprovalGrantResult,
    CheckpointParams,
    CheckpointResult,
    GitLayerUsage,
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

log = logging.getLogger("substrate.api.workspace")

handles = Handles(WorkspaceServices)


def _mounts(s: WorkspaceServices) -> dict[str, list[str]]:
    return {ws.id: ws.policy.readonly_dirs() for ws in s.workspaces.all()}


async def _restart_sandboxes(s: WorkspaceServices, before: dict[str, list[str]]) -> None:
    """A sandbox binds the policy's read-only dirs when it is made: one whose set changed
    (a policy changed, here or in a checkout nested in or enclosing it) is removed, and
    made again with the new mounts on next use. Its running commands end."""
    for ws in s.workspaces.all():
        if ws.id in before and before[ws.id] != ws.policy.readonly_dirs():
            await s.execution.release_workspace(ws)


@handles("workspace.adopt")
async def adopt(s: WorkspaceServices, caller: Caller, p: AdoptParams) -> WorkspaceInfo:
    before = _mounts(s)
    ws = await trio.to_thread.run_sync(s.workspaces.adopt, p.path, p.root_id, p.policy, caller.name)
    # Change sets kept from an earlier adoption of this checkout are this one's now.
    await trio.to_thread.run_sync(s.execution.changesets.reattach, ws)
    await _restart_sandboxes(s, before)
    return await trio.to_thread.run_sync(ws.info)


@handles("workspace.set_policy")
async def set_policy(s: WorkspaceServices, caller: Caller, p: SetPolicyParams) -> WorkspaceInfo:
    before = _mounts(s)
    ws = await trio.to_thread.run_sync(s.workspaces.set_policy, p.workspace, p.policy, caller.name)
    await _restart_sandboxes(s, before)
    return await trio.to_thread.run_sync(ws.info)


@handles("workspace.list")
async def list_(s: WorkspaceServices, caller: Caller, p: WorkspaceListParams) -> WorkspaceList:
    return WorkspaceList(workspaces=await trio.to_thread.run_sync(s.workspaces.infos))


@handles("workspace.info")
async def info(s: WorkspaceServices, caller: Caller, p: WorkspaceRef) -> WorkspaceInfo:
    ws = s.workspaces.get(p.workspace)
    found = await trio.to_thread.run_sync(ws.info)
    homes = s.execution.homes
    # A bounded walk (homes.MAX_USAGE_ENTRIES): at most a few hundred milliseconds.
    home = await trio.to_thread.run_sync(homes.usage, ws.checkout, limiter=s.fs_limiter)
    git = None
    if (layers := s.execution.git_layers) is not None:
        size = await trio.to_thread.run_sync(layers.usage, ws.checkout, limiter=s.fs_limiter)
        git = None if size is None else GitLayerUsage(bytes=size)
    return msgspec.structs.replace(found, home=home, git_layer=git)


@handles("workspace.release")
async def release(s: WorkspaceServices, caller: Caller, p: ReleaseParams) -> ReleaseResult:
    ws = s.workspaces.get(p.workspace)
    await s.execution.release_workspace(ws)
    await trio.to_thread.run_sync(s.workspaces.release, ws.id, caller.name)
    git: Literal["kept", "removed", "none"] = "kept"
    if not p.keep_git:
        git = await trio.to_thread.run_sync(_remove_git, s, ws.checkout, ws.id, caller.name)
    if p.keep_home:
        return ReleaseResult(workspace=ws.id, released=True, home="kept", git=git)
    # Its sandboxes are gone and the checkout is no longer adopted: nothing uses the home.
    removed = await trio.to_thread.run_sync(
        _remove_home, s, ws.checkout, ws.root_id, ws.id, caller.name
    )
    home: Literal["removed", "none"] = "removed" if removed else "none"
    return ReleaseResult(workspace=ws.id, released=True, home=home, git=git)


def _remove_git(
    s: WorkspaceServices, checkout: str, workspace: str, actor: str
) -> Literal["removed", "none"]:
    """Remove the checkout's git layer (`GitLayers.remove`) and journal it. Refuses
    `internal` when it cannot be removed whole (the workspace stays released)."""
    layers = s.execution.git_layers
    try:
        if layers is None or not layers.remove(checkout):
            return "none"
    except OSError as exc:
        log.error("workspace %s: its git layer could not be removed whole: %s", workspace, exc)
        raise Internal(
            "the workspace was released, but its git layer could not be removed (see the log)"
        ) from None
    s.journal.append("workspace.git_removed", {}, workspace=workspace, actor=actor)
    return "removed"


def _remove_home(
    s: WorkspaceServices, checkout: str, root_id: str, workspace: str, actor: str
) -> bool:
    """Remove the checkout's homes, every uid's and secret set's (`Homes.remove`) and journal it; False: it had none.
    Refuses `internal` when it cannot be removed whole (the workspace stays released)."""
    try:
        if not s.execution.homes.remove(checkout):
            return False
    except OSError as exc:
        # The reason names a host path: the log has it, the client does not.
        log.error("workspace %s: its home could not be removed whole: %s", workspace, exc)
        raise Internal(
            "the workspace was released, but its home could not be removed whole (see the log)"
        ) from None
    s.journal.append(
        "workspace.home_removed", {"root_id": root_id}, workspace=workspace, actor=actor
    )
    return True


@handles("approval.grant")
async def approve(
    s: WorkspaceServices, caller: Caller, p: ApprovalGrantParams
) -> ApprovalGrantResult:
    ws = s.workspaces.get(p.workspace)
    approval_id, expires = await trio.to_thread.run_sync(
        s.workspaces.grant_approval, ws, p.plan_digest, p.ttl_s, caller.name
    )
    return ApprovalGrantResult(approval_id=approval_id, expires=expires)


@handles("workspace.checkpoint")
async def checkpoint(s: WorkspaceServices, caller: Caller, p: CheckpointParams) -> CheckpointResult:
    ws = s.workspaces.get(p.workspace)
    checkpoint_id, seq = await trio.to_thread.run_sync(s.checkpoints.create, ws, caller.name)
    return CheckpointResult(checkpoint=checkpoint_id, seq=seq)


@handles("workspace.restore")
async def restore(s: WorkspaceServices, caller: Caller, p: RestoreParams) -> RestoreResult:
    ws = s.workspaces.get(p.workspace)
    return await trio.to_thread.run_sync(
        restore_checkpoint,
        s.writer,
        s.checkpoints,
        s.journal,
        ws,
        p.checkpoint,
        p.dry_run,
        caller.name,
    )
