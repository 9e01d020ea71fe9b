"""Handlers of `grant.issue`, `grant.revoke` and `grant.list` (operator socket only)."""

from __future__ import annotations

import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import GrantServices
from substrate.errors import GrantInvalid
from substrate.schema.common import Empty
from substrate.schema.grant import (
    GrantIssueParams,
    GrantIssueResult,
    GrantList,
    GrantRef,
    GrantRevokeResult,
)

handles = Handles(GrantServices)


@handles("grant.issue")
async def issue(s: GrantServices, caller: Caller, p: GrantIssueParams) -> GrantIssueResult:
    """Refuses `unknown_workspace`, `profile_unknown`, and `grant_invalid` when the profile
    is not `interactive = true`."""
    ws = s.workspaces.get(p.workspace)
    profile = s.profiles.find(p.profile)
    if not profile.interactive:
        raise GrantInvalid(
            f"profile {p.profile!r} is not interactive (interactive = false)", profile=p.profile
        )
    grant, token = await trio.to_thread.run_sync(
        lambda: s.grants.issue(
            workspace=ws.id, profile=p.profile, ttl_s=p.ttl_s, uses=p.uses, actor=caller.name
        )
    )
    return GrantIssueResult(grant=grant.id, token=token, expires=grant.expires)


@handles("grant.revoke")
async def revoke(s: GrantServices, caller: Caller, p: GrantRef) -> GrantRevokeResult:
    """Refuses `grant_invalid` for an unknown grant. Ends the sessions it started."""
    revoked = await trio.to_thread.run_sync(s.grants.revoke, p.grant, caller.name)
    await s.sessions.revoke_grant(p.grant)
    return GrantRevokeResult(grant=p.grant, revoked=revoked)


@handles("grant.list")
async def list_(s: GrantServices, caller: Caller, p: Empty) -> GrantList:
    return GrantList(grants=await trio.to_thread.run_sync(s.grants.list))
