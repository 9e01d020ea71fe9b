"""Which changes of a layer's set the host overtook while its generation was mounted
(docs/working-layer.md, "Host edits during a command").

Theory of operation. The scan reads each change's base from the checkout at the end, so
after a host edit it reads the host's version: a file the host deleted or renamed away
looks as if it never was (the command's change to it reads as a create), one it replaced
looks like the base. The overlay does not help the command either: it may keep showing a
lower file the host replaced by rename or unlinked (its cached dentry still holds the old
inode), so a generation's view can be as old as its first user. What the host did since
then (`since_ns`: that user's start, less the coarse clock's slack) is told here from the
checkout's ctimes and the overlay's own marks, and each such change is a conflict, never
applied:

- a file replaced, deleted or chmodded: the checkout file's ctime is at or after
  `since_ns` (an edit in place, or a replace by rename: a new inode);
- a directory made: nothing is there now, yet the overlay marked the upper directory as
  one the command saw in the lower (`trusted.overlay.origin`, set when it was copied up;
  `trusted.overlay.opaque`, when it was removed and made again): the host removed or
  renamed it away. A directory with neither mark is the command's own, and so is
  everything beneath it;
- a file created: no mark tells a new file from one the command changed (a rename over
  it — `sed -i`, an editor's save — or a removal and create leave none, nor does a
  copy-up of a lower file the host had already unlinked: verified on Linux 6.18), so it
  is a conflict when the checkout directory holding it changed (ctime) since: a removal
  or a rename there always changes it. A create beside an unrelated host change in the
  same directory is a conflict too: safe (its version is kept), where a missed one would
  re-create what a person deleted. When the checkout's watch says which names the host
  changed since the generation was mounted (`names`, docs/working-layer.md "The fresh
  view"), a create is a conflict only when the host changed that name (made, removed,
  renamed or wrote it) or the directory itself, or the directory is gone: a create
  beside an unrelated host change applies. Unknown (no watch, an overflow, a directory
  moved, a directory not watched): the ctime rule.

What the layer's own previous set put in the checkout is not the host's: files holding
the digest it wrote (`landed`) and directories whose ctime is still the one its apply
left (`landed_dirs`, from `dir_stamps`).

Blocking I/O (an lstat per changed file, per directory holding a create, an xattr read
per directory made): call from a worker thread.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping

import msgspec

from substrate.errors import Refusal
from substrate.fs import paths
from substrate.layer.changes.apply import Outcomes
from substrate.layer.changes.changeset import Change, ChangeSet
from substrate.layer.changes.scan import seen_in_lower

#: `Outcomes.reason` of a change the host overtook.
HOST_CHANGED = "host_changed"


def _parent(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


def _split(rel: str) -> tuple[str, ...]:
    return tuple(rel.split("/")) if rel else ()


def _lstat(root_fd: int, rel: str) -> os.stat_result | None:
    """The checkout entry at `rel` ("" is the root), never followed; None when absent or
    unreachable (a symlink or a file on the way)."""
    if not rel:
        return os.fstat(root_fd)
    parts = _split(rel)
    try:
        with paths.opened_dir(root_fd, parts[:-1], rel) as parent:
            return paths.lstat_at(parent, parts[-1])
    except Refusal:
        return None


class _Overtaken:
    """The per-path answers, each computed once."""

    def __init__(
        self,
        root_fd: int,
        upper_fd: int,
        since_ns: int,
        landed_dirs: Mapping[str, int],
        made: set[str],
        names: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self._root_fd = root_fd
        self._upper_fd = upper_fd
        self._since_ns = since_ns
        self._landed_dirs = landed_dirs
        self._made = made
        self._names = names
        self._moved: dict[str, bool] = {}
        self._seen: dict[str, bool] = {}

    def under(self, dir_rel: str) -> bool:
        """May the host have removed an entry the command saw in `dir_rel`?"""
        if dir_rel in self._made:
            return self.made_over(dir_rel)
        moved = self._moved.get(dir_rel)
        if moved is None:
            st = _lstat(self._root_fd, dir_rel)
            moved = (
                st is None
                or not stat.S_ISDIR(st.st_mode)
                or (
                    st.st_ctime_ns >= self._since_ns
                    and self._landed_dirs.get(dir_rel) != st.st_ctime_ns
                )
            )
            self._moved[dir_rel] = moved
        return moved

    def created_over(self, rel: str) -> bool:
        """May the host have removed, made or renamed the entry at `rel` the command
        creates? By the names the host changed where known, else `under`."""
        parent = _parent(rel)
        touched = None if self._names is None else self._names.get(parent)
        if parent in self._made or touched is None:
            return self.under(parent)
        st = _lstat(self._root_fd, parent)
        if st is None or not stat.S_ISDIR(st.st_mode):
            return True
        return "" in touched or rel.rsplit("/", 1)[-1] in touched

    def made_over(self, rel: str) -> bool:
        """Is the directory the set makes at `rel` one the command saw in the lower (now
        gone), or beneath one?"""
        seen = self._seen.get(rel)
        if seen is None:
            parent = _parent(rel)
            if rel and parent in self._made and self.made_over(parent):
                seen = True
            else:
                try:
                    with paths.opened_dir(self._upper_fd, _split(rel), rel) as fd:
                        seen = seen_in_lower(fd)
                except Refusal:
                    seen = True  # not the directory scanned: never applied unchecked
            self._seen[rel] = seen
        return seen


def _file_overtaken(root_fd: int, change: Change, since_ns: int, landed: Mapping[str, str]) -> bool:
    st = _lstat(root_fd, change.path)
    ours = landed.get(change.path) == change.base_sha256
    return st is not None and st.st_ctime_ns >= since_ns and not ours


def overtaken(
    root_fd: int,
    upper_fd: int,
    changeset: ChangeSet,
    since_ns: int,
    landed: Mapping[str, str],
    landed_dirs: Mapping[str, int],
    *,
    names: Mapping[str, frozenset[str]] | None = None,
) -> tuple[ChangeSet, tuple[Outcomes, ...]]:
    """Split `changeset` (scanned from the upper layer `upper_fd` against the checkout
    `root_fd`) into the changes to apply and the conflicts (`host_changed`) the host
    overtook since `since_ns` (see the module doc). Every change at a path with a
    conflict is one too (a delete and the create replacing it go together). A conflict
    of a file the command wrote names it in `kept` (its version, in the upper layer);
    `current_sha256` is the checkout's digest as scanned (None: absent). `names`: the
    names the host changed per watched directory since the generation was mounted
    (None: not known; the ctime rule for creates). Costs an
    lstat per file change and per directory holding a create, an open and two xattr
    reads per directory made."""
    made = {c.path for c in changeset.changes if c.op == "mkdir"}
    check = _Overtaken(root_fd, upper_fd, since_ns, landed_dirs, made, names)
    hit: set[str] = set()
    for change in changeset.changes:
        if change.kind != "dir" and change.op in ("replace", "delete", "chmod"):
            moved = _file_overtaken(root_fd, change, since_ns, landed)
        elif change.op == "mkdir":
            moved = check.made_over(change.path)
        elif change.op == "create":
            moved = check.created_over(change.path)
        else:
            moved = False  # a directory's delete or mode: its own checks hold at the apply
        if moved:
            hit.add(change.path)
    kept: list[Change] = []
    conflicts: list[Outcomes] = []
    for change in changeset.changes:
        if change.path not in hit:
            kept.append(change)
            continue
        wrote = change.kind == "file" and change.op != "delete"
        conflicts.append(
            Outcomes(
                path=change.path,
                op=change.op,
                kind=change.kind,
                outcome="conflict",
                reason=HOST_CHANGED,
                current_sha256=change.base_sha256,
                kept=change.path if wrote else None,
            )
        )
    return msgspec.structs.replace(changeset, changes=tuple(kept)), tuple(conflicts)


def dir_stamps(root_fd: int, changes: Iterable[Change]) -> dict[str, int]:
    """The ctime of each checkout directory `changes` (just applied) changed: the parent
    of each, and each directory made or moded. The next conclusion takes a directory
    still at that ctime as the layer's, not the host's. Costs an lstat per directory."""
    rels: set[str] = set()
    for change in changes:
        rels.add(_parent(change.path))
        if change.kind == "dir" and change.op != "delete":
            rels.add(change.path)
    stamps: dict[str, int] = {}
    for rel in sorted(rels):
        st = _lstat(root_fd, rel)
        if st is not None and stat.S_ISDIR(st.st_mode):
            stamps[rel] = st.st_ctime_ns
    return stamps
