"""Wire schema of process execution (SPEC §5 `proc.run`).

`argv` is deliberately loose here (any list of strings): an empty argv, a NUL or an
argv[0] outside the profile's `argv_allow` is the named refusal `argv_denied`, decided in
`substrate.procs`, not `invalid_params`. Likewise a `timeout_s` above the profile's is
`limit_exceeded`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.facts import Fact
from substrate.schema.artifact import OutputRef
from substrate.schema.common import Params, RelPath, Result, WorkspaceId, method

ProfileName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class PolicyBlocked(msgspec.Struct, frozen=True, kw_only=True):
    """A change a command made that the workspace policy denies; it was reverted."""

    path: str  # workspace-relative
    change: Literal["create", "modify", "delete", "chmod"]
    reverted: bool


class RunParams(Params):
    workspace: WorkspaceId
    profile: ProfileName
    argv: list[str]
    cwd: RelPath = "."
    stdin: str | None = None  # UTF-8 text fed to the command, then EOF
    stdin_b64: str | None = None  # or bytes, base64 (not both)
    timeout_s: Seconds | None = None  # may only lower the profile's


class ProcResult(Result):
    """A finished command. `exit_code` is the engine's: 128 + n for a death by signal n
    (then `signal` names it, e.g. "KILL"); None only if the engine lost it."""

    proc: str
    exit_code: int | None
    signal: str | None
    timed_out: bool
    oom_killed: bool
    duration_ms: float
    stdout: OutputRef
    stderr: OutputRef
    facts: list[Fact]
    policy_blocked: list[PolicyBlocked]


method(
    "proc.run",
    RunParams,
    ProcResult,
    doc="Run argv (no shell) in the workspace's verified sandbox; wait for it to end.",
)
