"""The working layer's change sets: scanned, kept by id, applied through the guarded path.

The working layer's change sets (docs/working-layer.md): what a generation's upper dir
changes in the checkout, kept by id and applied through the guarded write path.

Where things are: `scan` reads an upper dir against the checkout (held fds, no symlink
followed) into a `ChangeSet`, classified purely by `changeset`; `links` says what a
symlink's target means and which links the profile's `symlinks` lets through;
`host_edits` moves to `blocked` what the host changed meanwhile (a person's edit is
never undone); `apply` lands a set through the guarded batch path, bound to what the scan saw; `store` keeps
sets by id (`Changesets`: the `changesets` table, their layers' dirs, the cap on settled
ones); `versions` keeps each conflict's version (the command's bytes) through a
`FileKeeper`.
"""

from substrate.layer.changes.apply import ApplyResult, Outcomes, apply
from substrate.layer.changes.changeset import Blocked, Change, ChangeSet, Seen, classify
from substrate.layer.changes.scan import holds_changes, scan, upper_holds_changes
from substrate.layer.changes.store import Changesets, Kept, remove_layer

__all__ = [
    "ApplyResult",
    "Blocked",
    "Change",
    "ChangeSet",
    "Changesets",
    "Kept",
    "Outcomes",
    "Seen",
    "apply",
    "classify",
    "holds_changes",
    "remove_layer",
    "scan",
    "upper_holds_changes",
]
