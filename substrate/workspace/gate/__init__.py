"""The write gate for sandboxed code: file-level `write_deny` globs (docs/protocol.md §5).

Theory of operation. Directories denied whole (`.git/**`) and every `.git` at any depth
are bound read-only into the sandbox (`substrate.sandbox.containers`); everything else a deny
glob names (`*.lock`, `.env`, `secrets/*.pem`) is checked around each command. So is
every `require_approval` glob: sandboxed code cannot ask an operator for an approval, so
until such changes can wait as pending plans (the working layer, docs/protocol.md §11) they are
reverted like denied ones and reported with `rule: "require_approval"`.

- `before` walks the workspace once through directory fds (`os.scandir`, `O_NOFOLLOW`,
  never following a symlink, not descending into the read-only-mounted dirs) and records
  every path a deny glob matches: kind, mode, owner, size, times, inode, and for a file
  its SHA-256 with its bytes kept aside in a private store under the state dir (never in
  the journal), so it can be put back. Only matching files are read; a file whose
  inode, size, mtime and ctime are those of the previous snapshot is not read again.
- `after` walks again, compares (`diff`, pure) and reverts each offending change:
  a creation is removed (a directory with everything beneath it; a symlink itself, never
  what it points at), a modification or deletion is restored from the kept bytes through
  a same-directory temp file and `rename` (old owner, mode and mtime), a mode change is
  undone. Each one becomes a `policy_blocked` entry of the result and a `policy.blocked`
  journal entry (paths, kinds, modes, sizes and digests: no bytes). Names are whatever
  bytes the command chose: the bytes of one that are not UTF-8 are reported as `\\xNN`
  (`display_rel`), so the result and the journal can always be encoded.

Commands that overlap in one workspace share one baseline: it is taken when the first
starts and kept until the last ends, so a command never "restores" another's offending
write. The seams this leaves (changes are reverted after the fact, background writers
between commands, interactive terminals, `write_allow`) are in docs/write-gate.md.

Git directories (`gitdirs`): every `.git` at any depth is denied as for guarded writes,
and so is what host git would take for a repository by content (`discoverable`): a
directory that became one during the command loses the pieces the sandbox added (a
person's repository that was there stays, guarded inside like `.git`). Every rw command
is walked, whatever the policy: telling a new repository from a person's needs the
baseline.

Attribution (docs/protocol.md §11): a denied change is reverted only when the kernel saw
the command's sandbox make it and nothing else touch it (`attribution`, `fanotify`, and
the `relay` process that reads fanotify from inside the sandbox's pid namespace); any
other — a person's edit on the host — is kept and reported `reason: "unattributed"`.

Modules: `diff` (pure: nodes, `classify`, `diff`, `display_rel`), `gitdirs` (pure: the
git-content rule per directory), `snapshot` (the walk and what it records), `keep` (the kept bytes), `revert` (undoing changes) and
`hook` (`SnapshotGate`, the per-workspace baseline). Costs: two walks of the tree (about
10 ms per 10,000 entries each; see bench/gate.py) plus reading the denied files whose
stat changed.
"""

from substrate.workspace.gate.attribution import (
    EVERY_CHANGE_IS_THE_SANDBOXS,
    Attribution,
    Touches,
    Unavailable,
    Watch,
)
from substrate.workspace.gate.diff import Change, Node, classify, diff, display_rel
from substrate.workspace.gate.fanotify import FanotifyAttribution
from substrate.workspace.gate.gitdirs import GitContent
from substrate.workspace.gate.hook import Rule, SnapshotGate
from substrate.workspace.gate.keep import MAX_KEPT_FILE, MAX_KEPT_TOTAL, Keep
from substrate.workspace.gate.revert import NotReverted, revert
from substrate.workspace.gate.snapshot import (
    RACY_NS,
    Matcher,
    Snapshot,
    gated_globs,
    matcher_for,
    readonly_identities,
    scan_after,
    take_snapshot,
    walk,
)

__all__ = [
    "EVERY_CHANGE_IS_THE_SANDBOXS",
    "MAX_KEPT_FILE",
    "MAX_KEPT_TOTAL",
    "RACY_NS",
    "Attribution",
    "Change",
    "FanotifyAttribution",
    "GitContent",
    "Keep",
    "Matcher",
    "Node",
    "NotReverted",
    "Rule",
    "Snapshot",
    "SnapshotGate",
    "Touches",
    "Unavailable",
    "Watch",
    "classify",
    "diff",
    "display_rel",
    "gated_globs",
    "matcher_for",
    "readonly_identities",
    "revert",
    "scan_after",
    "take_snapshot",
    "walk",
]
