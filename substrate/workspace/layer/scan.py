"""The scan: an overlay's upper layer read as a change set of the checkout beneath it.

Theory of operation. Both layers are held as directory fds: the upper (what the
command wrote) and the lower (the checkout the command saw). The walk is iterative: a
stack of relative paths, each directory reopened beneath its layer's root fd
(`paths.open_dir`: no symlink is ever followed), so it holds two directory fds and one
file fd at a time whatever the depth. Each upper entry is `lstat`ed, a regular file is
hashed, and the lower entry of the same name likewise; `changeset.classify` says what
the pair means. A deleted or hidden lower directory is listed whole (one delete per
file, bound to its digest, and one per directory, deepest first) because the guarded
path removes files one by one. Once the set is in apply order, its first
`MAX_PREVIEWS` file changes (all `changes.get` shows) get their `diff` preview, both
sides read again when small enough; the rest carry none, so a large set costs no
diffing nor the space of its previews.

Bounds, each a named refusal (`too_large` with `bound`): entries visited
(`max_entries`), directory depth (`max_depth`) and bytes hashed (`max_bytes`). A single
file larger than the guarded write path takes (`MAX_FILE_BYTES`) is blocked
(`too_large`), not refused.

Blocking I/O: call it from a worker thread. The layer must not change while it is
scanned (the caller scans a layer no command writes any more).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec

from substrate.errors import NotADirectory, NotFound, Refusal, SymlinkRefused, TooLarge
from substrate.workspace import fsops, paths
from substrate.workspace.digests import hash_fd
from substrate.workspace.gate.diff import display_rel
from substrate.workspace.layer.changeset import (
    Blocked,
    Change,
    ChangeSet,
    Seen,
    SeenKind,
    classify,
    ordered,
)
from substrate.workspace.patching import MAX_RESULT_BYTES
from substrate.workspace.preview import PREVIEW_DIFF_LIMIT, unified_preview

MAX_ENTRIES = 200_000
MAX_DEPTH = 256
MAX_BYTES = 4 << 30
#: The largest file a change set carries: what the guarded write path takes.
MAX_FILE_BYTES = MAX_RESULT_BYTES
#: Changes given a `diff` preview: the first ones in apply order, as many as
#: `changes.get` shows (`process.layering.MAX_CHANGE_ENTRIES`); the others never are.
MAX_PREVIEWS = 1000

WHITEOUT_XATTR = "trusted.overlay.whiteout"
OPAQUE_XATTR = "trusted.overlay.opaque"
#: Set by the overlay on what it copied up from the lower layer (a file changed in place,
#: a directory written beneath): its lower origin's file handle.
ORIGIN_XATTR = "trusted.overlay.origin"
#: Overlay metadata meaning the upper entry is not self-contained: never interpreted.
_FEATURE_XATTRS = {"trusted.overlay.metacopy": "metacopy", "trusted.overlay.redirect": "redirect"}


@dataclass
class _Budget:
    max_entries: int
    max_depth: int
    max_bytes: int
    entries: int = 0
    hashed: int = 0

    def entry(self, parts: tuple[str, ...]) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise TooLarge(
                f"the layer holds more than {self.max_entries} entries",
                bound="entries",
                limit=self.max_entries,
            )
        if len(parts) > self.max_depth:
            raise TooLarge(
                f"the layer is deeper than {self.max_depth} directories",
                bound="depth",
                limit=self.max_depth,
            )

    def bytes(self, size: int) -> None:
        self.hashed += size
        if self.hashed > self.max_bytes:
            raise TooLarge(
                f"the layer holds more than {self.max_bytes} bytes to compare",
                bound="bytes",
                limit=self.max_bytes,
            )


@dataclass
class _Out:
    changes: list[Change] = field(default_factory=list)
    blocked: list[Blocked] = field(default_factory=list)

    def block(self, parts: tuple[str, ...], kind: str, reason: str) -> None:
        self.blocked.append(Blocked(path=display_rel("/".join(parts)), kind=kind, reason=reason))


def _kind(st: os.stat_result) -> SeenKind:
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISCHR(mode):
        return "whiteout" if st.st_rdev == os.makedev(0, 0) else "device"
    if stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "other"


def _xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return None
        raise


def _feature(fd: int) -> str | None:
    for attr, feature in _FEATURE_XATTRS.items():
        if _xattr(fd, attr) is not None:
            return feature
    return None


def _hash_fd(fd: int, size: int, budget: _Budget) -> str:
    budget.bytes(size)
    return hash_fd(fd)


def _seen(dir_fd: int, name: str, budget: _Budget, *, upper: bool) -> Seen | None:
    """What stands at `name` in `dir_fd` (None: nothing); files hashed, never followed."""
    st = paths.lstat_at(dir_fd, name)
    if st is None:
        return None
    kind = _kind(st)
    if kind == "whiteout" and not upper:
        kind = "device"  # a 0:0 device in the checkout itself is only a device
    mode = stat.S_IMODE(st.st_mode)
    if kind == "dir":
        if not upper:
            return Seen(kind="dir", mode=mode)
        with paths.opened_dir(dir_fd, (name,), name) as fd:
            return Seen(
                kind="dir",
                mode=mode,
                opaque=_xattr(fd, OPAQUE_XATTR) == b"y",
                overlay_feature=_feature(fd),
            )
    if kind != "file":
        return Seen(kind=kind, mode=mode, nlink=st.st_nlink)
    fd = paths.open_regular(dir_fd, name, name)
    try:
        fst = os.fstat(fd)
        if upper:
            if fst.st_size == 0 and _xattr(fd, WHITEOUT_XATTR) is not None:
                return Seen(kind="whiteout", mode=mode)
            feature = _feature(fd)
            if feature is not None:
                return Seen(kind="file", mode=mode, overlay_feature=feature)
        if fst.st_size > MAX_FILE_BYTES:
            return Seen(kind="file", mode=mode, nlink=fst.st_nlink, size=fst.st_size)
        return Seen(
            kind="file",
            mode=stat.S_IMODE(fst.st_mode),
            nlink=fst.st_nlink,
            size=fst.st_size,
            sha256=_hash_fd(fd, fst.st_size, budget),
        )
    finally:
        os.close(fd)


def _preview_bytes(root_fd: int, parts: tuple[str, ...]) -> bytes | int:
    """A file's bytes for a preview, or its size when too large to diff (b"": absent,
    or not a regular file)."""
    rel = "/".join(parts)
    try:
        with paths.opened_dir(root_fd, parts[:-1], rel) as dir_fd:
            st = paths.lstat_at(dir_fd, parts[-1])
            if st is None or not stat.S_ISREG(st.st_mode):
                return b""
            if st.st_size > PREVIEW_DIFF_LIMIT:
                return st.st_size
            return fsops.read_regular(dir_fd, parts[-1], PREVIEW_DIFF_LIMIT, rel)[1]
    except TooLarge:
        return PREVIEW_DIFF_LIMIT + 1  # grew since the lstat
    except Refusal:
        return b""


def _previewed(upper_fd: int, lower_fd: int, change: Change) -> Change:
    """`change` with its preview: the lower file (its base) against the upper one."""
    if change.kind != "file":
        return change
    parts = tuple(change.path.split("/"))
    old = b"" if change.op == "create" else _preview_bytes(lower_fd, parts)
    new = b"" if change.op == "delete" else _preview_bytes(upper_fd, parts)
    if isinstance(old, int) or isinstance(new, int):
        sizes = [len(x) if isinstance(x, bytes) else x for x in (old, new)]
        diff = f"Files differ ({sizes[0]} -> {sizes[1]} bytes; too large to diff)\n"
        return msgspec.structs.replace(change, diff=diff, diff_truncated=True)
    diff, truncated = unified_preview(old, new, change.path)
    return msgspec.structs.replace(change, diff=diff, diff_truncated=truncated)


@contextlib.contextmanager
def _lower_dir(lower_fd: int, parts: tuple[str, ...]) -> Iterator[int | None]:
    """The lower directory at `parts`, or None when the lower holds no directory there."""
    try:
        fd = paths.open_dir(lower_fd, parts, "/".join(parts))
    except (NotFound, NotADirectory, SymlinkRefused):
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _names(dir_fd: int) -> list[str]:
    with os.scandir(dir_fd) as it:
        return sorted(entry.name for entry in it)


def _delete_lower_tree(lower_fd: int, parts: tuple[str, ...], budget: _Budget, out: _Out) -> None:
    """One delete per file and per directory of the lower tree at `parts` (itself too)."""
    stack = [parts]
    while stack:
        here = stack.pop()
        with paths.opened_dir(lower_fd, here, "/".join(here)) as dfd:
            for name in _names(dfd):
                sub = (*here, name)
                budget.entry(sub)
                seen = _seen(dfd, name, budget, upper=False)
                if seen is None:
                    continue
                _delete_one(lower_fd, dfd, sub, seen, budget, out, stack)
        out.changes.append(Change(path="/".join(here), op="delete", kind="dir"))


def _delete_one(
    lower_fd: int,
    dfd: int,
    sub: tuple[str, ...],
    seen: Seen,
    budget: _Budget,
    out: _Out,
    stack: list[tuple[str, ...]],
) -> None:
    rel = "/".join(sub)
    if not _utf8(rel):
        out.block(sub, seen.kind, "name_not_utf8")
    elif seen.kind == "dir":
        stack.append(sub)
    elif seen.kind != "file":
        out.block(sub, seen.kind, f"deletes_{seen.kind}")
    elif seen.sha256 is None:
        out.block(sub, "file", "too_large")
    else:
        out.changes.append(Change(path=rel, op="delete", base_sha256=seen.sha256))


def _utf8(rel: str) -> bool:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def scan(
    upper_fd: int,
    lower_fd: int,
    *,
    max_entries: int = MAX_ENTRIES,
    max_depth: int = MAX_DEPTH,
    max_bytes: int = MAX_BYTES,
) -> ChangeSet:
    """The change set the upper layer `upper_fd` makes of the checkout `lower_fd`.

    Refuses `too_large` (with `bound`: entries, depth, bytes) past a bound. Names that
    are not UTF-8 are blocked (`name_not_utf8`, shown `\\xNN` as the gate shows them).
    Costs a listing of every upper directory, a hash of every upper file and of the
    lower file it shadows, and a listing and hash of every lower tree it deletes.
    """
    budget = _Budget(max_entries, max_depth, max_bytes)
    out = _Out()
    stack: list[tuple[str, ...]] = [()]
    while stack:
        parts = stack.pop()
        with (
            paths.opened_dir(upper_fd, parts, "/".join(parts)) as udir,
            _lower_dir(lower_fd, parts) as ldir,
        ):
            upper_names = _names(udir)
            for name in upper_names:
                sub = (*parts, name)
                budget.entry(sub)
                _visit(upper_fd, lower_fd, udir, ldir, sub, budget, out, stack)
            if ldir is not None and _opaque(udir):
                present = set(upper_names)
                for name in _names(ldir):
                    if name in present:
                        continue
                    sub = (*parts, name)
                    budget.entry(sub)
                    seen = _seen(ldir, name, budget, upper=False)
                    if seen is not None:
                        _delete_one(lower_fd, ldir, sub, seen, budget, out, [])
                        if seen.kind == "dir" and _utf8("/".join(sub)):
                            _delete_lower_tree(lower_fd, sub, budget, out)
    changes = ordered(out.changes)
    shown = tuple(_previewed(upper_fd, lower_fd, c) for c in changes[:MAX_PREVIEWS])
    return ChangeSet(changes=(*shown, *changes[MAX_PREVIEWS:]), blocked=tuple(out.blocked))


def holds_changes(upper_fd: int) -> bool:
    """Would `scan` find anything in the upper layer `upper_fd`? Only when its root has an
    entry or is opaque (a chmod of the root itself is not a change, as in `scan`). Cost:
    one directory read and one xattr read."""
    with os.scandir(upper_fd) as it:
        if next(it, None) is not None:
            return True
    return _opaque(upper_fd)


def upper_holds_changes(upper: str) -> bool | None:
    """`holds_changes` of the upper dir at `upper` (a path the daemon made under its
    state dir, opened without following a symlink), or None when it is gone."""
    try:
        fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return holds_changes(fd)
    finally:
        os.close(fd)


def _opaque(dir_fd: int) -> bool:
    return _xattr(dir_fd, OPAQUE_XATTR) == b"y"


def seen_in_lower(dir_fd: int) -> bool:
    """Did the command see a lower directory where the upper directory `dir_fd` is? Yes
    when the overlay copied it up (`trusted.overlay.origin`) or made it opaque (it was
    removed, or renamed over, and made again). Two xattr reads."""
    return _xattr(dir_fd, ORIGIN_XATTR) is not None or _opaque(dir_fd)


def _visit(
    upper_fd: int,
    lower_fd: int,
    udir: int,
    ldir: int | None,
    sub: tuple[str, ...],
    budget: _Budget,
    out: _Out,
    stack: list[tuple[str, ...]],
) -> None:
    name = sub[-1]
    rel = "/".join(sub)
    upper = _seen(udir, name, budget, upper=True)
    if upper is None:
        return  # removed since listed: the caller scans a quiet layer; nothing to carry
    if not _utf8(rel):
        out.block(sub, upper.kind, "name_not_utf8")
        return
    lower = _seen(ldir, name, budget, upper=False) if ldir is not None else None
    verdict = classify(upper, lower)
    if verdict.blocked is not None:
        out.block(sub, upper.kind, verdict.blocked)
        return
    for step in verdict.steps:
        match step:
            case "delete":
                assert lower is not None and ldir is not None
                _delete_one(lower_fd, ldir, sub, lower, budget, out, [])
            case "delete_tree":
                _delete_lower_tree(lower_fd, sub, budget, out)
            case "mkdir":
                out.changes.append(Change(path=rel, op="mkdir", kind="dir", mode=upper.mode))
            case "chmod" if upper.kind == "dir":
                out.changes.append(Change(path=rel, op="chmod", kind="dir", mode=upper.mode))
            case "create" | "replace" | "chmod":
                if upper.sha256 is None:
                    out.block(sub, "file", "too_large")
                    continue
                base = lower if step != "create" else None
                out.changes.append(
                    Change(
                        path=rel,
                        op=step,
                        base_sha256=None if base is None else base.sha256,
                        new_sha256=upper.sha256,
                        size=upper.size,
                        mode=upper.mode,
                    )
                )
            case "descend":
                stack.append(sub)
            case "delete_absent":
                pass  # the walk does it once the directory's upper names are known
