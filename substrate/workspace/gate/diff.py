"""What changed at the denied paths between two snapshots: pure, no file system.

A snapshot is a mapping of workspace-relative paths to `Node`s (what stood there: kind,
mode, owner, size, times, identity and a digest, never bytes). `classify` names the
change at one path, `diff` lists them for two snapshots, folding what lies beneath a
created or deleted directory into it (one entry, one revert), and `display_rel` is how
a path read from the disk is shown and journalled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from substrate.fs.paths import Kind

Change = Literal["create", "modify", "delete", "chmod"]


class Node(msgspec.Struct, frozen=True):
    """What stood at a denied path: never a file's bytes, only their digest."""

    kind: Kind
    mode: int  # permission bits (S_IMODE)
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    dev: int
    ino: int
    sha256: str | None = None  # a file's content; a symlink's target
    target: str | None = None  # a symlink's target, as read (never followed)
    kept: bool = False  # the bytes are in the private store

    def same_stat(self, other: Node) -> bool:
        """Nothing observable changed (a write or chmod always moves ctime)."""
        return self.kind == other.kind and (
            self.dev,
            self.ino,
            self.size,
            self.mtime_ns,
            self.ctime_ns,
            self.mode,
        ) == (other.dev, other.ino, other.size, other.mtime_ns, other.ctime_ns, other.mode)

    def summary(self) -> dict[str, Any]:
        """What the journal keeps: kind, mode, size, digest."""
        return {"kind": self.kind, "mode": self.mode, "size": self.size, "sha256": self.sha256}


def classify(before: Node | None, after: Node | None) -> Change | None:
    """The change from `before` to `after` at one denied path, or None (no change).

    Content is compared by digest (both nodes hashed), metadata by mode; a kind change
    (a file swapped for a symlink or a directory) is a modification.
    """
    if before is None:
        return None if after is None else "create"
    if after is None:
        return "delete"
    if before.kind != after.kind:
        return "modify"
    if before.kind in ("file", "symlink") and before.sha256 != after.sha256:
        return "modify"
    if before.kind != "symlink" and before.mode != after.mode:
        return "chmod"
    return None


def diff(before: Mapping[str, Node], after: Mapping[str, Node]) -> list[tuple[str, Change]]:
    """Every change between two snapshots, shallowest first; a path beneath a created
    (or deleted) directory is folded into it (its revert covers everything beneath).
    Costs a sort of the paths of both and a lookup per ancestor of each change."""
    found: dict[str, Change] = {}
    for rel in sorted(set(before) | set(after), key=lambda r: (r.count("/"), r)):
        change = classify(before.get(rel), after.get(rel))
        if change is None:
            continue
        if change in ("create", "delete") and _under_folded(rel, found, change):
            continue
        found[rel] = change
    return list(found.items())


def _under_folded(rel: str, found: Mapping[str, Change], change: Change) -> bool:
    parts = rel.split("/")
    return any(found.get("/".join(parts[:i])) in (change, "modify") for i in range(1, len(parts)))


def display_rel(rel: str) -> str:
    """`rel` as it may be shown and journalled: a name read from the disk carries the
    bytes that are not UTF-8 as surrogates (`os.fsdecode`); they become `\\xNN`."""
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
