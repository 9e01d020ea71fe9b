"""Handlers of `grant.issue`, `grant.revoke` and `grant.list` (operator socket only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.errors import GrantInvalid, RuntimeUnavailable
from substrate.sandbox.profiles import Profile, find_profile, load_profiles
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


async def _profile(daemon: Daemon, name: str) -> Profile:
    if daemon.execution is not None:
        found: Profile = daemon.execution.profile(name)
        return found
    profiles = await trio.to_thread.run_sync(
        load_profiles, Path(daemon.config.profiles_dir), Path(daemon.config.seccomp_dir)
    )
    return find_profile(profiles, name)


def _service(daemon: Daemon) -> object:
    if daemon.terminals is None:
        raise RuntimeUnavailable("the terminal service is not running")
    return daemon.terminals


@handles("grant.issue")
async def issue(daemon: Daemon, caller: Caller, p: GrantIssueParams) -> GrantIssueResult:
    """Refuses `unknown_workspace`, `profile_unknown`, and `grant_invalid` when the profile
    is not `interactive = true`."""
    _service(daemon)
    ws = daemon.workspaces.get(p.workspace)
    profile = await _profile(daemon, p.profile)
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
    _service(daemon)
    revoked = await trio.to_thread.run_sync(daemon.terminals.grants.revoke, p.grant, caller.name)
    await daemon.terminals.sessions.revoke_grant(p.grant)
    return GrantRevokeResult(grant=p.grant, revoked=revoked)


@handles("grant.list")
async def list_(daemon: Daemon, caller: Caller, p: Empty) -> GrantList:
    _service(daemon)
    return GrantList(grants=await trio.to_thread.run_sync(daemon.terminals.grants.list))
