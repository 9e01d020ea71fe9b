"""Handlers of `profile.*` and `facts.probe` (docs/protocol.md §5). A reload is the
profile registry's (`substrate.process.profile_registry`), shared with the daemon's SIGHUP."""

from __future__ import annotations

from substrate.api.base import Caller, Handles
from substrate.api.services import ProfileServices
from substrate.sandbox.profiles import Profile
from substrate.schema.common import Empty
from substrate.schema.profile import (
    ProbeParams,
    ProbeResult,
    ProfileGetParams,
    ProfileListResult,
    ProfileReloadResult,
    ProfileSummary,
)

handles = Handles(ProfileServices)


@handles("profile.list")
async def list_(s: ProfileServices, caller: Caller, p: Empty) -> ProfileListResult:
    return ProfileListResult(
        profiles=[
            ProfileSummary(name=name, description=prof.description, interactive=prof.interactive)
            for name, prof in sorted(s.profiles.by_name.items())
        ]
    )


@handles("profile.get")
async def get(s: ProfileServices, caller: Caller, p: ProfileGetParams) -> Profile:
    return s.profiles.find(p.name)


@handles("facts.probe")
async def probe(s: ProfileServices, caller: Caller, p: ProbeParams) -> ProbeResult:
    ws = s.workspaces.get(p.workspace)
    sandbox = await s.containers.ensure(ws, s.profiles.find(p.profile))
    return ProbeResult(
        workspace=ws.id, profile=p.profile, container=sandbox.id[:12], facts=sandbox.facts
    )


@handles("profile.reload")
async def reload(s: ProfileServices, caller: Caller, p: Empty) -> ProfileReloadResult:
    """Refuses `profile_invalid` and keeps the set in force whole (`ProfileRegistry.reload`)."""
    return await s.profiles.reload(actor=caller.name)
