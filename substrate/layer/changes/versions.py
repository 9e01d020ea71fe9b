"""A conflict's version kept as an artifact (docs/working-layer.md, "Conflicts").

Theory of operation. A change the checkout could not take (the host changed the file
meanwhile, or it is not at its base) is never applied; the command's version of the
file — its bytes in the set's upper layer — is copied into the artifact store by a
`FileKeeper` (`layer.keep.ArtifactKeeper`: the layer sits below the artifact
store) and named in the set's row (`KeptVersion`), so the
set's layer can be removed without losing it. Only file versions are kept: a delete or
a directory step has no bytes.

Bounds: a file over `MAX_VERSION_BYTES` is not copied (`reason: "too_large"`); a set
keeps at most `MAX_SET_VERSIONS` versions and `MAX_SET_VERSION_BYTES` bytes in all
(`set_full` past either). A version not kept stays in the layer, which then stays on
disk until `changes.discard`: a cap never drops anything silently. File bytes never go
to the journal.

Blocking I/O: call from a worker thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Protocol

import msgspec

from substrate.errors import Refusal
from substrate.fs import paths
from substrate.layer.changes.apply import Outcomes
from substrate.schema.changes import KeptVersion

log = logging.getLogger("substrate.layer.changes.versions")

#: The largest version kept as an artifact, bytes.
MAX_VERSION_BYTES = 16 << 20
#: At most this many versions per set (entries recorded, kept or not) ...
MAX_SET_VERSIONS = 1000
#: ... and at most this many bytes of artifacts per set.
MAX_SET_VERSION_BYTES = 256 << 20
#: Reasons a version is final without an artifact: asking again would answer the same.
_FINAL = frozenset({"too_large", "empty"})


class FileKeeper(Protocol):
    """Where versions go (implemented over the artifact store)."""

    def keep_file(self, fd: int, size: int, owner: str) -> tuple[str, str] | None:
        """Copy the `size` bytes of the open regular file `fd` into a new artifact owned
        by `owner` (a change set id); return (artifact id, sha256), None if it could not
        be stored whole."""
        ...


def needs_version(o: Outcomes) -> bool:
    """A conflict whose command's version has bytes to keep: a file it created, replaced
    or changed the mode of (`kept` names it)."""
    return o.outcome == "conflict" and o.kind == "file" and o.kept is not None


class Versions(msgspec.Struct, frozen=True, kw_only=True):
    """A set's versions as its row keeps them. `overflow`: a conflict came when
    `MAX_SET_VERSIONS` were recorded already, so its version is only in the layer."""

    items: tuple[KeptVersion, ...] = ()
    overflow: bool = False

    def by_path(self) -> dict[str, KeptVersion]:
        return {v.path: v for v in self.items}


def placeholders(paths: Iterable[str]) -> Versions:
    """Versions for `paths` not copied yet (`reason: "unkept"`): recorded with the set
    before anything else happens, so a crash before they are copied never lets the
    layer go (`settled` needs every entry kept)."""
    items: dict[str, KeptVersion] = {}
    for path in paths:
        if len(items) >= MAX_SET_VERSIONS:
            return Versions(items=tuple(items.values()), overflow=True)
        items[path] = KeptVersion(path=path, size=0, reason="unkept")
    return Versions(items=tuple(items.values()))


def keep(
    keeper: FileKeeper,
    upper_fd: int,
    owner: str,
    wanted: Iterable[str],
    prior: Versions,
) -> Versions:
    """The set's versions after copying, from the upper layer `upper_fd` (never
    following a symlink), those of the paths `wanted` and of `prior`'s entries not kept
    yet (`unkept`, `failed`), as artifacts owned by `owner`: `prior`'s entries first
    (updated in place), then new ones, at most `MAX_SET_VERSIONS` (past it `overflow`).
    Never raises for one file (its entry says `failed`). Costs, per copy, an open and a
    copy into the artifact store (one commit)."""
    by_path = prior.by_path()
    overflow = prior.overflow
    count = sum(1 for v in prior.items if v.artifact is not None)
    spent = sum(v.size for v in prior.items if v.artifact is not None)
    retry = [v.path for v in prior.items if v.artifact is None and v.reason not in _FINAL]
    for path in dict.fromkeys([*retry, *wanted]):
        old = by_path.get(path)
        if old is not None and (old.artifact is not None or old.reason in _FINAL):
            continue
        if old is None and len(by_path) >= MAX_SET_VERSIONS:
            overflow = True  # not recorded: its layer stays (see `settled`)
            continue
        version = _one(keeper, upper_fd, owner, path, count, spent)
        if version.artifact is not None:
            count += 1
            spent += version.size
        by_path[path] = version
    return Versions(items=tuple(by_path.values()), overflow=overflow)


def _one(
    keeper: FileKeeper, upper_fd: int, owner: str, path: str, count: int, spent: int
) -> KeptVersion:
    parts = tuple(path.split("/"))
    try:
        with paths.opened_dir(upper_fd, parts[:-1], path) as parent:
            fd = paths.open_regular(parent, parts[-1], path)
    except Refusal:
        return KeptVersion(path=path, size=0, reason="failed")
    try:
        st = os.fstat(fd)
        size = st.st_size
        if st.st_nlink != 1:
            return KeptVersion(path=path, size=size, reason="failed")
        if size == 0:
            return KeptVersion(path=path, size=0, reason="empty")
        if size > MAX_VERSION_BYTES:
            return KeptVersion(path=path, size=size, reason="too_large")
        if count >= MAX_SET_VERSIONS or spent + size > MAX_SET_VERSION_BYTES:
            return KeptVersion(path=path, size=size, reason="set_full")
        try:
            stored = keeper.keep_file(fd, size, owner)
        except Exception:  # a failed copy only holds the layer: never lose the set for it
            log.exception("keeping the version of a conflict of %s failed", owner)
            stored = None
        if stored is None:
            return KeptVersion(path=path, size=size, reason="failed")
        artifact, sha256 = stored
        return KeptVersion(path=path, size=size, sha256=sha256, artifact=artifact)
    finally:
        os.close(fd)


def settled(conflicts: Iterable[Outcomes], versions: Versions) -> bool:
    """Nothing the layer holds is missing elsewhere: every conflict with bytes to keep
    has an entry, every entry is kept (an artifact, or empty) and none went unrecorded.
    (An entry once not kept holds the layer even if its change applied later: safe.)"""
    if versions.overflow:
        return False
    by_path = versions.by_path()
    if any(needs_version(o) and o.path not in by_path for o in conflicts):
        return False
    return all(v.artifact is not None or v.reason == "empty" for v in versions.items)
