"""Wire schema of grants (docs/protocol.md §7): short-lived, counted permissions to open a terminal."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import Empty, Params, Result, WorkspaceId, method

GrantId = Annotated[str, msgspec.Meta(pattern="^g-[0-9a-f]{16}$")]
ProfileName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class GrantIssueParams(Params):
    kind: Literal["interactive_terminal"]
    workspace: WorkspaceId
    profile: ProfileName
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 600.0  # seconds the grant lives
    uses: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1  # sessions it may start or join


class GrantIssueResult(Result):
    grant: str
    token: str  # shown once; only its SHA-256 is stored
    expires: float  # unix time


class GrantRef(Params):
    grant: GrantId


class GrantRevokeResult(Result):
    grant: str
    revoked: bool  # False when it was already revoked


class GrantInfo(Result):
    """A grant as listed: never its token."""

    grant: str
    kind: str
    workspace: str
    profile: str
    created: float
    expires: float
    uses: int
    used: int
    revoked: float | None = None
    state: Literal["active", "expired", "revoked", "consumed"] = "active"


class GrantList(Result):
    grants: list[GrantInfo]


method(
    "grant.issue",
    GrantIssueParams,
    GrantIssueResult,
    operator_only=True,
    doc="Issue a terminal grant; the token is returned once and never stored.",
)
method(
    "grant.revoke",
    GrantRef,
    GrantRevokeResult,
    operator_only=True,
    doc="Revoke a grant; its sessions end and its connections close.",
)
method("grant.list", Empty, GrantList, operator_only=True, doc="Grants, without tokens.")
