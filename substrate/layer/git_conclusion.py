"""The git layer's part of a conclusion, in a worker thread, and the look that spares it
(docs/working-layer.md, "The git layer").

`refs` concludes the git layer (`changes.git_refs.conclude`) and keeps its ref entries
with the command's change set, or a set of their own. `quiet` says, first and without a
thread hop, that it would find nothing: the checkout's watch saw no change since the
last git conclusion and nothing it reads in the git layer's upper dir changed
(`changes.git_quiet`) — a command that never touched `.git`, most of them.
"""

from __future__ import annotations

from typing import Literal

from substrate.layer import git_baseline
from substrate.layer.changes import ApplyResult, ChangeSet, Changesets, git_quiet, git_refs
from substrate.layer.mounts import working_layer
from substrate.layer.mounts.git_plan import GitLayerPart
from substrate.schema.proc import ChangesMode, ProcChanges
from substrate.workspace.policy import GlobSet
from substrate.workspace.registry import Workspace

#: `quiet` reads at most this many entries of the git layer's upper dir on the event
#: loop; past them it is asked again in the conclusion's thread.
QUIET_LOOP_ENTRIES = 64
#: ... and there at most this many (past them: the conclusion reads the refs).
QUIET_THREAD_ENTRIES = 100_000


def quiet(
    layer: working_layer.WorkingLayer, part: GitLayerPart, mode: ChangesMode, budget: int
) -> bool:
    """Would the git layer's conclusion find nothing and leave its baseline as it is?
    Known without reading a ref when the checkout did not change since its last
    conclusion (the checkout's watch: the same change count, nothing pending; its
    `.git` is watched as the rest) and nothing it reads in the git layer's upper dir
    changed either (`git_quiet.quiet`, reading at most `budget` entries; past them, not
    known: False). Not in mode "discard" (its conclusion moves the import's mark). The
    caller must not hold `mounting`: taken here without waiting (held: False)."""
    settled, watch = layer.git_settled, layer.watch
    if settled is None or watch is None or mode == "discard":
        return False
    if not layer.mounting.acquire(blocking=False):
        return False
    try:
        if watch.degraded is not None or watch.seen != settled.seen or watch.pending():
            return False
        return git_quiet.quiet(part.upper, settled, budget) is True
    finally:
        layer.mounting.release()


def refs(
    ws: Workspace,
    mode: ChangesMode,
    actor: str,
    layer: working_layer.WorkingLayer,
    part: GitLayerPart,
    allow: GlobSet,
    changes: ProcChanges,
    changesets: Changesets,
) -> tuple[str, tuple[git_refs.RefChange, ...]] | None:
    """Conclude the git layer and keep its entries with the result's set, or with one
    of their own (recorded, and marked applied at once in mode "apply": it has no
    layer to keep), before the layer's baseline moves past them (a crash between
    leaves them to be found again). None: no ref moved. Past the event loop's budget,
    `quiet` is asked again here with a bigger one first; what the conclusion
    leaves is kept for the next one's (`layer.git_settled`)."""
    kept: list[str] = []
    if quiet(layer, part, mode, QUIET_THREAD_ENTRIES):
        return None
    watch = layer.watch
    # Read before the refs are: a checkout change from here on counts for the next.
    seen = -1 if watch is None else watch.seen
    layer.git_settled = None

    def settled(baseline: git_baseline.Baseline) -> None:
        layer.git_settled = git_quiet.settled_state(part.upper, seen, baseline)

    def keep(found: tuple[git_refs.RefChange, ...]) -> None:
        cs_id = changes.changeset
        if cs_id is None:
            review = mode == "review"
            state: Literal["pending", "applying"] = "pending" if review else "applying"
            cs_id = changesets.record(ws, changes.generation, "", "", ChangeSet(), state)
            if not review:
                changesets.finish(cs_id, ws, changes.generation, ApplyResult(), "changes.applied")
        changesets.refs.record(cs_id, ws.id, found)
        changesets.refs.journal(cs_id, ws.id, found, actor)
        kept.append(cs_id)

    gate = changesets.refs.gate(ws)
    found = git_refs.conclude(ws, part.target, part.upper, mode, allow, gate, keep, settled)
    if not found:
        return None
    return kept[0], found
