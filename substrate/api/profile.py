"""Handlers of `profile.*` and `facts.probe` (docs/protocol.md §5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from substrate.api.base import Caller, handles
from substrate.api.proc import execution_of
from substrate.sandbox.profiles import Profile
from substrate.schema.common import Empty
from substrate.schema.profile import (
    ProbeParams,
    ProbeResult,
    ProfileGetParams,
    ProfileListResult,
    ProfileSummary,
)

if TYPE_CHECKING:
    from substrate.daemon import Daemon


@handles("profile.list")
async def list_(daemon: Daemon, caller: Caller, p: Empty) -> ProfileListResult:
    profiles = execution_of(daemon).profiles
    return ProfileListResult(
        profiles=[
            ProfileSummary(name=name, description=prof.description, interactive=prof.interactive)
            for name, prof in sorted(profiles.items())
        ]
    )


@handles("profile.get")
async def get(daemon: Daemon, caller: Caller, p: ProfileGetParams) -> Profile:
    return execution_of(daemon).profile(p.name)


@handles("facts.probe")
async def probe(daemon: Daemon, caller: Caller, p: ProbeParams) -> ProbeResult:
    execution = execution_of(daemon)
    ws = daemon.workspaces.get(p.workspace)
    sandbox = await execution.containers.ensure(ws, execution.profile(p.profile))
    return ProbeResult(
        workspace=ws.id, profile=p.profile, container=sandbox.id[:12], facts=sandbox.facts
    )
