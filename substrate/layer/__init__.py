"""The working layer (docs/working-layer.md): a sandbox's writes as change sets of the checkout.

A `workspace = "layer"` sandbox writes into an overlay whose lower layer is the
checkout; once the commands and terminals sharing a generation have ended, what they
changed becomes a change set, applied through the guarded write path, kept for review or
discarded.

Where things are, bottom up:
- `generation` (pure): who uses the generation mounted now, when it concludes, in
  which mode.
- `mounts/`: the host side — the overlay's plan and its check (`plan`, `mountinfo`),
  its mounts, swaps, teardown and start-up sweep (`overlay`), passthrough dirs
  (`passthrough`, `passthrough_scan`), one sandbox's `WorkingLayer`, and `LayerMounts`,
  the door `substrate.sandbox.containers` uses to make a container with its layer.
- `changes/`: change sets — scan an upper dir, move the host's edits aside, apply
  through the guarded path, keep by id (`Changesets`), keep conflicts' versions.
- `git_baseline`: a git layer's refs as its sandbox's view showed them last
  (docs/working-layer.md, "The git layer").
- `keep` (conflicts' versions as artifacts, the kept-set cap, wire entries) and
  `recovery` (at start: half-applied sets applied whole, unconcluded generations
  dropped).
- `conclusion`: a generation's end — sweep, swap, re-verify, scan, apply — and the
  Protocols it needs of the sandbox layer above (`LayerSandbox`, `Sandboxes`).
- `users`: `LayerUsers`, join / end / abandon and the shutdown steps: the interface the
  runner and the terminals use.

Above the sandbox (process, pty, api, daemon) the layer is reached only through the names
below (import-linter contract in pyproject.toml); the sandbox reaches `mounts` only.
"""

from substrate.layer.changes import Changesets, Kept
from substrate.layer.changes.git_refs import RefChange, apply_kept, ref_change, ref_lists
from substrate.layer.conclusion import MAX_CHANGE_ENTRIES, entries
from substrate.layer.keep import ArtifactKeeper, check_room, room_now
from substrate.layer.mounts.working_layer import fresh_view
from substrate.layer.recovery import drop_unconcluded, finish_applying, sandbox_dirs
from substrate.layer.users import LayerClosed, LayerUsers, Use, journal_summary

__all__ = [
    "MAX_CHANGE_ENTRIES",
    "ArtifactKeeper",
    "Changesets",
    "Kept",
    "LayerClosed",
    "LayerUsers",
    "RefChange",
    "Use",
    "apply_kept",
    "check_room",
    "drop_unconcluded",
    "entries",
    "finish_applying",
    "fresh_view",
    "journal_summary",
    "ref_change",
    "ref_lists",
    "room_now",
    "sandbox_dirs",
]
