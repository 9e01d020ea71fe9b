"""Handlers of `grant.issue`, `grant.revoke` and `grant.list` (operator socket only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.errors import GrantInvalid
from substrate.schema.common import Empty
from substrate.schema.grant import (
    GrantIssueParams,
    GrantIssueResult,
    GrantList,
    GrantRef,
    GrantRevokeResult,
)

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("grant.issue")
async def issue(daemon: Daemon, caller: Caller, p: GrantIssueParams) -> GrantIssueResult:
    """Refuses `unknown_workspace`, `profile_unknown`, and `grant_invalid` when the profile
    is not `interactive = true`."""
    ws = daemon.workspaces.get(p.workspace)
    profile = daemon.execution.profile(p.profile)
    if not profile.interactive:
        raise GrantInvalid(
            f"profile {p.profile!r} is not interactive (interactive = false)", profile=p.profile
        )
    grant, token = await trio.to_thread.run_sync(
        lambda: daemon.terminals.grants.issue(
            workspace=ws.id, profile=p.profile, ttl_s=p.ttl_s, uses=p.uses, actor=caller.name
        )
    )
    return GrantIssueResult(grant=grant.id, token=token, expires=grant.expires)


@handles("grant.revoke")
async def revoke(daemon: Daemon, caller: Caller, p: GrantRef) -> GrantRevokeResult:
    """Refuses `grant_invalid` for an unknown grant. Ends the sessions it started."""
    revoked = await trio.to_thread.run_sync(daemon.terminals.grants.revoke, p.grant, caller.name)
    await daemon.terminals.sessions.revoke_grant(p.grant)
    return GrantRevokeResult(grant=p.grant, revoked=revoked)


@handles("grant.list")
async def list_(daemon: Daemon, caller: Caller, p: Empty) -> GrantList:
    return GrantList(grants=await trio.to_thread.run_sync(daemon.terminals.grants.list))
