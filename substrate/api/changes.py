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
from substrate.layer import (
    MAX_CHANGE_ENTRIES,
    Kept,
    RefChange,
    apply_kept,
    entries,
    ref_change,
    ref_lists,
)
from substrate.schema.changes import (
    Change,
    ChangesApplyParams,
    ChangesApplyResult,
    ChangesDiscardResult,
    ChangesetInfo,
    ChangesetParams,
)
from substrate.schema.proc import ChangeCounts
from substrate.workspace.registry import Workspace

#: At most this many bytes of `diff` text in one `changes.get` answer (each diff is
#: bounded by the preview already; 1,000 of them would not be).
MAX_DIFF_BYTES = 1 << 20

handles = Handles(ChangesServices)


def info(kept: Kept, refs: tuple[RefChange, ...] = ()) -> ChangesetInfo:
    """The wire view of a kept set (bounded lists, at most `MAX_DIFF_BYTES` of diffs),
    its git ref entries (`op: "ref"`, with their new commits' subjects) after its files."""
    cs = kept.changeset
    shown = [*cs.changes, *(ref_change(r) for r in refs)]
    return ChangesetInfo(
        changeset=kept.id,
        workspace=kept.workspace,
        generation=kept.generation,
        state=kept.state,
        created=kept.created,
        updated=kept.updated,
        changes=bounded_diffs(tuple(shown[:MAX_CHANGE_ENTRIES]), MAX_DIFF_BYTES),
        blocked=list(cs.blocked[:MAX_CHANGE_ENTRIES]),
        total_changes=len(shown),
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
    refs = await trio.to_thread.run_sync(s.changesets.refs.get, p.changeset)
    return info(kept, refs)


@handles("changes.apply")
async def apply(s: ChangesServices, caller: Caller, p: ChangesApplyParams) -> ChangesApplyResult:
    changesets = s.changesets
    kept = await trio.to_thread.run_sync(changesets.get, p.changeset)
    ws = s.workspaces.get(kept.workspace)
    kept, result, unmatched = await trio.to_thread.run_sync(
        changesets.apply, s.writer, ws, p.changeset, p.paths, p.dry_run, caller.name
    )
    refs = await trio.to_thread.run_sync(
        _apply_refs, s, ws, p, caller.actor == "operator", caller.name
    )
    if p.paths is not None:
        names = {r.name for r in refs}
        unmatched = [u for u in unmatched if u not in names]
    lists = ref_lists(refs)
    by_path = {c.path: c for c in kept.changeset.changes}
    return ChangesApplyResult(
        changeset=kept.id,
        state=kept.state,
        dry_run=p.dry_run,
        applied=(entries(result.applied, by_path) + lists["applied"])[:MAX_CHANGE_ENTRIES],
        blocked=(entries(result.blocked, by_path) + lists["blocked"])[:MAX_CHANGE_ENTRIES],
        pending=(entries(result.pending, by_path) + lists["pending"])[:MAX_CHANGE_ENTRIES],
        conflicts=(entries(result.conflicts, by_path, kept.versions) + lists["conflicts"])[
            :MAX_CHANGE_ENTRIES
        ],
        counts=ChangeCounts(
            applied=len(result.applied) + len(lists["applied"]),
            unchanged=len(result.unchanged) + len(lists["unchanged"]),
            blocked=len(result.blocked) + len(lists["blocked"]),
            pending=len(result.pending) + len(lists["pending"]),
            conflicts=len(result.conflicts) + len(lists["conflicts"]),
        ),
        unmatched=unmatched[:MAX_CHANGE_ENTRIES],
        layer=kept.layer,
    )


def _apply_refs(
    s: ChangesServices, ws: Workspace, p: ChangesApplyParams, operator: bool, actor: str
) -> tuple[RefChange, ...]:
    """The set's ref entries not applied yet, applied by CAS (`git_refs.apply_kept`):
    one outside `git_refs_allow` only for the operator. Those named by `paths` only,
    when given; with `dry_run`, nothing is applied and the entries are as they were.
    Their new states are kept and journaled."""
    refs_store = s.changesets.refs
    with refs_store.lock:
        refs = refs_store.get(p.changeset)
        if not refs or p.dry_run:
            return refs if p.paths is None else tuple(r for r in refs if r.name in set(p.paths))
        only = None if p.paths is None else set(p.paths)
        done = apply_kept(ws, refs, operator=operator, only=only, gate=refs_store.gate(ws))
        refs_store.record(p.changeset, ws.id, done)
        changed = [d for d, r in zip(done, refs, strict=True) if d != r]
        refs_store.journal(p.changeset, ws.id, changed, actor)
    return done if only is None else tuple(r for r in done if r.name in only)


@handles("changes.discard")
async def discard(s: ChangesServices, caller: Caller, p: ChangesetParams) -> ChangesDiscardResult:
    changesets = s.changesets
    kept = await trio.to_thread.run_sync(changesets.get, p.changeset)
    ws = s.workspaces.get(kept.workspace)
    kept = await trio.to_thread.run_sync(changesets.discard, ws, p.changeset, caller.name)
    return ChangesDiscardResult(changeset=kept.id, state=kept.state)
