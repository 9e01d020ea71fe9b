"""What a run is asked (`RunRequest`) and the write gate it checks with (`WriteGate`).

The types `substrate.process.processes.Processes` takes, kept apart so callers (the API,
terminals) name them without the runner's machinery; the working layer's users read a
`RunRequest` as `substrate.layer.users.Asked`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import msgspec

from substrate.process.stdin_stream import StdinStream
from substrate.schema.proc import ChangesMode, PolicyBlocked
from substrate.workspace.registry import Workspace

__all__ = ["RunRequest", "WriteGate"]


class RunRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One `proc.run` / `proc.start`, as asked (checked by `Processes.run`)."""

    ws: Workspace
    profile: str  # a profile name; `profile_unknown` when there is none
    argv: tuple[str, ...]  # exactly what is executed: no shell
    cwd: str = "."  # workspace-relative
    #: None: the command's stdin is closed at once; bytes: written, then EOF; a
    #: `StdinStream`: open for `proc.write` (`stdin: "stream"`).
    stdin: bytes | StdinStream | None = None
    timeout_s: float | None = None  # None: the profile's; never above it
    actor: str = "daemon"  # who asked, for the journal
    changes: ChangesMode = "apply"  # a layer sandbox's change set (layer.conclusion)


class WriteGate(Protocol):
    """Checks what a command wrote against the workspace's file-level deny globs.

    `before` snapshots the workspace as the command starts (`readonly`: the paths the
    sandbox has mounted read-only, with their identities: not walked; `sandbox_pid`: the
    sandbox's init, whose pid namespace tells its writes from anyone else's); `after`
    compares, reverts each offending change the sandbox made and returns them.
    Implemented by `substrate.workspace.gate.SnapshotGate`.
    """

    async def before(
        self,
        ws: Workspace,
        readonly: Mapping[str, tuple[int, int]] | None = None,
        sandbox_pid: int | None = None,
    ) -> object: ...

    async def after(self, ws: Workspace, snapshot: object) -> list[PolicyBlocked]: ...
