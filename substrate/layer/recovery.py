"""Crash recovery of working layers at start: no layer is ever left half-applied
(docs/working-layer.md, "Crash and cancel").

Theory of operation. A command's layer is either concluded or not. A concluded one has a
`changesets` row: `pending`/`applied`/`discarded` are settled; `applying` means the
daemon died between the set's first applied change and its last, so `finish_applying`
applies it whole again at start, before any socket accepts (the guarded apply is
idempotent: what landed is `unchanged`, bases are re-checked, a host edit since is a
conflict), journaled `changes.recovered {outcome: "applied"}`. Before that, the changes
of a batch that landed but whose journal transaction the crash lost get their
`changes.apply`/`changes.apply_dir` entries, `recovered: true`, as every guarded write
does (`Writer.recover`, `workspace.writes.intents`), so what landed is journaled exactly
once. A generation with no row
never concluded (the daemon was killed during its command, or it was `layer_busy` and its
sandbox went): its command did not finish, so nothing of it lands; after the previous
run's mounts are swept its upper and work dirs are removed, journaled
`changes.recovered {outcome: "dropped"}` when it held anything.

Blocking I/O and SQLite: call from a worker thread or before the event loop serves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from substrate.errors import Refusal
from substrate.layer.changes import Changesets, reclaim, remove_layer
from substrate.layer.mounts.plan import layers_dir
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer

log = logging.getLogger("substrate.layer.recovery")


def finish_applying(
    changesets: Changesets, writer: Writer, workspace: Callable[[str], Workspace]
) -> int:
    """Journal the changes a crash left landed but unjournaled, then apply whole every
    set a crash left `applying`; return how many sets. A set (or an intent) whose
    workspace is no longer adopted stays (finished at a start that knows it). Costs a
    read per intent left, and what applying the sets costs."""
    writer.recover(workspace)
    done = 0
    for kept in changesets.applying():
        try:
            ws = workspace(kept.workspace)
        except Refusal:
            log.warning("change set %s: workspace %s not adopted", kept.id, kept.workspace)
            continue
        changesets.finish_applying(writer, ws, kept)
        done += 1
    return done


def sandbox_dirs(state_dir: str) -> list[str]:
    """The sandbox directories under the layer directory now (taken before a run makes
    any: they are the previous runs')."""
    root = layers_dir(state_dir)
    try:
        with os.scandir(root) as it:
            return sorted(e.path for e in it if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def drop_unconcluded(
    changesets: Changesets, journal: Journal, dirs: list[str]
) -> list[tuple[str, int]]:
    """Remove every generation under the sandbox directories `dirs` (unmounted: call
    after the sweep) that no change set records; journal each non-empty one. Returns the
    (sandbox dir, generation) pairs dropped. Costs an unlink per file dropped."""
    known = changesets.uppers()
    dropped: list[tuple[str, int]] = []
    for sandbox_dir in dirs:
        upper_root = os.path.join(sandbox_dir, "upper")
        try:
            with os.scandir(upper_root) as it:
                gens = sorted(
                    int(e.name) for e in it if e.name.isdigit() and e.is_dir(follow_symlinks=False)
                )
        except FileNotFoundError:
            continue
        # What a crash left renamed aside (a settled layer not yet removed) goes too.
        reclaim.sweep(upper_root)
        reclaim.sweep(os.path.join(sandbox_dir, "work"))
        for gen in gens:
            upper = os.path.join(upper_root, str(gen))
            if upper in known:
                continue
            held = bool(os.listdir(upper))
            remove_layer(upper, os.path.join(sandbox_dir, "work", str(gen)))
            if held:
                journal.append(
                    "changes.recovered",
                    {
                        "layer": os.path.basename(sandbox_dir),
                        "generation": gen,
                        "outcome": "dropped",
                    },
                )
                dropped.append((sandbox_dir, gen))
    return dropped
