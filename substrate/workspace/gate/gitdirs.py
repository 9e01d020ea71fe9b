"""Git directories by content in the gate's walk (docs/write-gate.md, "Git directories").

Theory of operation. Host git takes any directory holding the pieces
`discoverable.completes` names (`HEAD` + `objects` + `refs`, or `HEAD` + `commondir`)
for a repository and runs its `config`; no guarded write lands beneath one or completes
one (`substrate.workspace.discoverable`). Sandboxed code on an rw workspace writes
through a bind mount, so the gate applies the same rule after the fact, per directory,
from the names its walk lists anyway:

- a directory that **was** a git directory by content at the baseline (a person's
  repository the sandbox did not get read-only: made on the host after the sandbox was
  created) is guarded like `.git`: every entry beneath it is a denied path, recorded,
  compared and reverted when the sandbox changed it; the repository itself stays.
- a directory that **became** one during the command is undone like a denied creation:
  the pieces it holds now that it did not hold at the baseline (by name) are the denied
  paths, each a `create` reverted when the sandbox alone made it. With them gone the
  directory holds only pieces it held before, which did not complete it (`completes`
  only grows with more names), so git no longer takes it for a repository; its other
  entries (`config`, `hooks/`, the command's files) are ordinary files again and stay.

Nothing here touches the file system: `GitContent` is fed each directory's names by the
walk (`gate.snapshot`) and answers which of them are denied. Cost: a set lookup per
entry, and memory for the directories that hold a piece.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from substrate.workspace import discoverable


@dataclass
class GitContent:
    """What the discoverable rule denies in one walk. `baseline`: the pieces each
    directory held at the baseline (None: this walk is the baseline). Directories are
    workspace-relative without a trailing `/`; the root is ``""``."""

    baseline: Mapping[str, frozenset[str]] | None = None
    #: Directory → the pieces it holds (only directories holding one).
    pieces: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Directory → what its git content denies: None for every entry (a git directory
    #: by content at the baseline), else the pieces that made it one since.
    denied: dict[str, frozenset[str] | None] = field(default_factory=dict)

    def entries(self, dir_rel: str, names: Collection[str]) -> frozenset[str] | None:
        """Which of the entries `names` of directory `dir_rel` are denied for its git
        content: None for all of them, else a set of names (often empty)."""
        found = frozenset(n for n in names if n in discoverable.PIECES)
        if found:
            self.pieces[dir_rel] = found
        # At the baseline: what it holds now; after the command: what it held then.
        before = found if self.baseline is None else self.baseline.get(dir_rel, frozenset())
        if discoverable.completes(before):
            self.denied[dir_rel] = None
            return None
        if self.baseline is not None and discoverable.completes(found):
            self.denied[dir_rel] = new = found - before
            return new
        return frozenset()

    def git_dir_of(self, rel: str) -> str | None:
        """The git directory by content (`""` for the root) for whose sake the path
        `rel` is denied in this walk, or None. Costs a lookup per component."""
        parts = rel.split("/")
        for i in range(len(parts)):
            here = "/".join(parts[:i])
            if here in self.denied:
                names = self.denied[here]
                if names is None or parts[i] in names:
                    return here
        return None
