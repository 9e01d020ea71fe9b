"""Wire schema of profiles and confinement facts (SPEC §5)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from substrate.sandbox.facts import Fact
from substrate.sandbox.profiles import Profile
from substrate.schema.common import Empty, Params, Result, WorkspaceId, method

ProfileName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class ProfileSummary(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str
    interactive: bool


class ProfileListResult(Result, omit_defaults=False):
    profiles: list[ProfileSummary]


class ProfileGetParams(Params):
    name: ProfileName


class ProbeParams(Params):
    workspace: WorkspaceId
    profile: ProfileName


class ProbeResult(Result, omit_defaults=False):
    workspace: str
    profile: str
    container: str  # short engine id of the verified sandbox
    facts: list[Fact]


method("profile.list", Empty, ProfileListResult, doc="Names and descriptions of the profiles.")
method("profile.get", ProfileGetParams, Profile, doc="One whole profile, every field.")
method(
    "facts.probe",
    ProbeParams,
    ProbeResult,
    doc="Create or reuse the sandbox of (workspace, profile) and return its observed facts.",
)
