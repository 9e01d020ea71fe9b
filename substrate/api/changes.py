"""Handlers of `changes.*` (docs/protocol.md §11): the kept change sets of commands run
on `workspace = "layer"` profiles (`substrate.layer.changes.Changesets`). A set of a
released workspace answers `changes.get`; `changes.apply`/`discard` refuse
`unknown_workspace` until its checkout is adopted again (`workspace.adopt` reattaches).

Apply and discard run in threads that are never abandoned, like guarded writes.
"""

from __future__ import annotations

import msgspec
import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import ChangesServices
from substrate.layer import MAX_CHANGE_ENTRIES, Kept, entries
from substrate.schema.changes import (
    Change,
    ChangesApplyParams,
    ChangesApplyResult,
    ChangesDiscardResult,
    ChangesetInfo,
    ChangesetParams,
)
from substrate.schema.proc import ChangeCounts

#: At most this many bytes of `diff` text in one `changes.get` answer (each diff is
#: bounded by the preview already; 1,000 of them would not be).
MAX_DIFF_BYTES = 1 << 20

handles = Handles(ChangesServices)


def info(kept: Kept) -> ChangesetInfo:
    """The wire view of a kept set (bounded lists, at most `MAX_DIFF_BYTES` of diffs)."""
    cs = kept.changeset
    return ChangesetInfo(
        changeset=kept.id,
        workspace=kept.workspace,
        generation=kept.generation,
        state=kept.state,
        created=kept.created,
        updated=kept.updated,
        changes=bounded_diffs(cs.changes[:MAX_CHANGE_ENTRIES], MAX_DIFF_BYTES),
        blocked=list(cs.blocked[:MAX_CHANGE_ENTRIES]),
        total_changes=len(cs.changes),
        total_blocked=len(cs.blocked),
        layer=kept.layer,
        versions=list(kept.versions.items[:MAX_CHANGE_ENTRIES]),
    )


def bounded_diffs(changes: tuple[Change, ...], budget: int) -> list[Change]:
    """`changes` with their diffs while their UTF-8 bytes fit `budget` in all; past it a
    change carries no diff (`diff_truncated`)."""
    shown: list[Change] = []
    for c in changes:
        cost = len(c.diff.encode("utf-8"))
        if cost > budget:
            budget = 0
            if c.diff:
                c = msgspec.structs.replace(c, diff="", diff_truncated=True)
        else:
            budget -= cost
        shown.append(c)
    return shown


@handles("changes.get")
async def get(s: ChangesServices, caller: Caller, p: ChangesetParams) -> ChangesetInfo:
    kept = await trio.to_thread.run_sync(s.changesets.get, p.changeset)
    return info(kept)


@handles("changes.apply")
async def apply(s: ChangesServices, caller: Caller, p: ChangesApplyParams) -> ChangesApplyResult:
    changesets = s.changesets
    kept = await trio.to_thread.run_sync(changesets.get, p.changeset)
    ws = s.workspaces.get(kept.workspace)
    kept, result, unmatched = await trio.to_thread.run_sync(
        changesets.apply, s.writer, ws, p.changeset, p.paths, p.dry_run, caller.name
    )
    by_path = {c.path: c for c in kept.changeset.changes}
    return ChangesApplyResult(
        changeset=kept.id,
        state=kept.state,
        dry_run=p.dry_run,
        applied=entries(result.applied, by_path),
        blocked=entries(result.blocked, by_path),
        pending=entries(result.pending, by_path),
        conflicts=entries(result.conflicts, by_path, kept.versions),
        counts=ChangeCounts(
            applied=len(result.applied),
            unchanged=len(result.unchanged),
            blocked=len(result.blocked),
            pending=len(result.pending),
            conflicts=len(result.conflicts),
        ),
        unmatched=unmatched[:MAX_CHANGE_ENTRIES],
        layer=kept.layer,
    )


@handles("changes.discard")
async def discard(s: ChangesServices, caller: Caller, p: ChangesetParams) -> ChangesDiscardResult:
    changesets = s.changesets
    kept = await trio.to_thread.run_sync(changesets.get, p.changeset)
    ws = s.workspaces.get(kept.workspace)
    kept = await trio.to_thread.run_sync(changesets.discard, ws, p.changeset, caller.name)
    return ChangesDiscardResult(changeset=kept.id, state=kept.state)
