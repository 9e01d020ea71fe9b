"""Handlers of `changes.*` (docs/protocol.md §11): the kept change sets of commands run
on `workspace = "layer"` profiles (`substrate.workspace.layer.Changesets`).

Apply and discard run in threads that are never abandoned, like guarded writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from substrate.api.base import Caller, handles
from substrate.process.layering import MAX_CHANGE_ENTRIES, entries
from substrate.schema.changes import (
    ChangesApplyParams,
    ChangesApplyResult,
    ChangesDiscardResult,
    ChangesetInfo,
    ChangesetParams,
)
from substrate.schema.proc import ChangeCounts
from substrate.workspace.layer import Kept

if TYPE_CHECKING:
    from substrate.daemon import Daemon


def info(kept: Kept) -> ChangesetInfo:
    """The wire view of a kept set (bounded lists)."""
    cs = kept.changeset
    return ChangesetInfo(
        changeset=kept.id,
        workspace=kept.workspace,
        generation=kept.generation,
        state=kept.state,
        created=kept.created,
        updated=kept.updated,
        changes=list(cs.changes[:MAX_CHANGE_ENTRIES]),
        blocked=list(cs.blocked[:MAX_CHANGE_ENTRIES]),
        total_changes=len(cs.changes),
        total_blocked=len(cs.blocked),
    )


@handles("changes.get")
async def get(daemon: Daemon, caller: Caller, p: ChangesetParams) -> ChangesetInfo:
    kept = await trio.to_thread.run_sync(daemon.execution.changesets.get, p.changeset)
    return info(kept)


@handles("changes.apply")
async def apply(daemon: Daemon, caller: Caller, p: ChangesApplyParams) -> ChangesApplyResult:
    changesets = daemon.execution.changesets
    kept = await trio.to_thread.run_sync(changesets.get, p.changeset)
    ws = daemon.workspaces.get(kept.workspace)
    kept, result, unmatched = await trio.to_thread.run_sync(
        changesets.apply, daemon.writer, ws, p.changeset, p.paths, p.dry_run, caller.name
    )
    return ChangesApplyResult(
        changeset=kept.id,
        state=kept.state,
        dry_run=p.dry_run,
        applied=entries(result.applied),
        blocked=entries(result.blocked),
        pending=entries(result.pending),
        conflicts=entries(result.conflicts),
        counts=ChangeCounts(
            applied=len(result.applied),
            unchanged=len(result.unchanged),
            blocked=len(result.blocked),
            pending=len(result.pending),
            conflicts=len(result.conflicts),
        ),
        unmatched=unmatched[:MAX_CHANGE_ENTRIES],
    )


@handles("changes.discard")
async def discard(daemon: Daemon, caller: Caller, p: ChangesetParams) -> ChangesDiscardResult:
    changesets = daemon.execution.changesets
    kept = await trio.to_thread.run_sync(changesets.get, p.changeset)
    ws = daemon.workspaces.get(kept.workspace)
    kept = await trio.to_thread.run_sync(changesets.discard, ws, p.changeset, caller.name)
    return ChangesDiscardResult(changeset=kept.id, state=kept.state)
