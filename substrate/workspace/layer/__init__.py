"""The working layer's change sets (docs/working-layer.md): what a sandbox's overlay upper
layer changes in the checkout (`scan`), classified purely (`changeset`), and applied
through the guarded write path (`apply`).
"""

from substrate.workspace.layer.apply import ApplyResult, Outcomes, apply
from substrate.workspace.layer.changeset import Blocked, Change, ChangeSet, Seen, classify
from substrate.workspace.layer.scan import holds_changes, scan, upper_holds_changes
from substrate.workspace.layer.store import Changesets, Kept, remove_layer

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
