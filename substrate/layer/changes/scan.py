"""The scan: an overlay's upper layer read as a change set of the checkout beneath it.

Theory of operation. Both layers are held as directory fds: the upper (what the
command wrote) and the lower (the checkout the command saw). The walk is iterative: a
stack of relative paths, each directory reopened beneath its layer's root fd
(`paths.open_dir`: no symlink is ever followed), so it holds two directory fds and one
file fd at a time whatever the depth. Each upper entry is `lstat`ed, a regular file is
hashed, a symlink's target read (`readlinkat`, never followed; `links`), and the lower
entry of the same name likewise; a link the profile's `symlinks` refuses, or whose
target substrate will not make, is blocked whole (`links.refusal`) before anything of
its path is classified; `changeset.classify` says what the pair means. A deleted or hidden lower directory is listed whole (one delete per
file, bound to its digest, and one per directory, deepest first) because the guarded
path removes files one by one. Once the set is in apply order, its first
`MAX_PREVIEWS` file changes (all `changes.get` shows) get their `diff` preview, both
sides read again when small enough; the rest carry none, so a large set costs no
diffing nor the space of its previews.

Bounds. Past one, the part past it is blocked by name — the shallowest path past the
bound, with the bound as its reason — and the rest of the set is scanned as usual, so
nothing is dropped silently and the daemon's memory stays bounded whatever the layer
holds: a path deeper than `max_depth` directories (`too_deep`) or longer than the
guarded path takes (`max_path_bytes`, `too_long`); a directory holding more names than
the entries left (`max_entries` counts every name listed, upper and lower) or whose
paths would pass the path text left (`MAX_PATH_TEXT`) is blocked whole (`too_many`)
and never listed past that; a file past the bytes left to hash (`max_bytes`, the
`max_changeset_bytes` config key: upper and lower files counted) or larger than
`max_file_bytes` (`max_change_file_bytes`) is blocked `too_large`. A lower
tree to delete that passes a bound is blocked whole at its root (a half-deleted tree
would be worse than none). What a bound blocked stays in the layer, which a settled
set then keeps (`BOUND_REASONS`, `store.Changesets`).

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
from substrate.fs import fsops, paths
from substrate.layer.changes import links
from substrate.layer.changes.changeset import (
    Blocked,
    Change,
    ChangeSet,
    Op,
    Seen,
    SeenKind,
    classify,
    ordered,
)
from substrate.schema.profile import SymlinkMode
from substrate.workspace import discoverable
from substrate.workspace.digests import hash_fd
from substrate.workspace.gate.diff import display_rel
from substrate.workspace.preview import PREVIEW_DIFF_LIMIT, unified_preview
from substrate.workspace.writes import MAX_CHANGE_FILE_BYTES, MAX_CHANGESET_BYTES

MAX_ENTRIES = 200_000
MAX_DEPTH = 256
#: The bytes the scan hashes in all (upper and lower files): `max_changeset_bytes`.
MAX_BYTES = MAX_CHANGESET_BYTES
#: The longest path a change carries: what the guarded path takes.
MAX_PATH_BYTES = paths.MAX_PATH_BYTES
#: The path text (bytes) of all names listed: with `MAX_ENTRIES`, what bounds the set.
MAX_PATH_TEXT = 64 << 20
#: `Blocked.reason`s of what a scan bound left in the layer, not in the set: a set with
#: any keeps its layer (the command's files are only there).
BOUND_REASONS = frozenset({"too_deep", "too_long", "too_many", "too_large"})
#: The largest file a change set carries (`max_change_file_bytes`): what the guarded
#: path's batches take, streamed (`substrate.workspace.writes.streamed`).
MAX_FILE_BYTES = MAX_CHANGE_FILE_BYTES
#: Changes given a `diff` preview: the first ones in apply order, as many as
#: `changes.get` shows (`layer.conclusion.MAX_CHANGE_ENTRIES`); the others never are.
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
    max_path_bytes: int
    symlinks: SymlinkMode = "any"
    max_file_bytes: int = MAX_FILE_BYTES
    max_text: int = MAX_PATH_TEXT
    entries: int = 0
    text: int = 0
    hashed: int = 0

    def past(self, parts: tuple[str, ...]) -> str | None:
        """The bound the path `parts` passes (a `Blocked.reason`), None within them."""
        if len(parts) > self.max_depth:
            return "too_deep"
        if len("/".join(parts).encode("utf-8", "surrogateescape")) > self.max_path_bytes:
            return "too_long"
        return None

    def bytes(self, size: int) -> bool:
        """Take `size` bytes to hash; False (nothing taken) past the bound."""
        if self.hashed + size > self.max_bytes:
            return False
        self.hashed += size
        return True


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
    if kind == "symlink":
        try:
            target = links.read_target(dir_fd, name)
        except OSError:
            return None  # gone (or replaced) since the lstat: the layer is quiet; nothing
        return Seen(
            kind="symlink",
            mode=mode,
            size=len(target),
            sha256=links.digest(target),
            target=target,
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
        if fst.st_size > budget.max_file_bytes or not budget.bytes(fst.st_size):
            return Seen(kind="file", mode=mode, nlink=fst.st_nlink, size=fst.st_size)
        return Seen(
            kind="file",
            mode=stat.S_IMODE(fst.st_mode),
            nlink=fst.st_nlink,
            size=fst.st_size,
            sha256=hash_fd(fd),
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


def _names(dir_fd: int, here: tuple[str, ...], budget: _Budget) -> list[str] | None:
    """The sorted names in `dir_fd` (the directory at `here`), taken from the entries and
    path text left; None, having read at most one name more than fit, when they do not
    fit (nothing taken)."""
    room = budget.max_entries - budget.entries
    text_room = budget.max_text - budget.text
    prefix = len("/".join(here).encode("utf-8", "surrogateescape")) + 1
    names: list[str] = []
    text = 0
    with os.scandir(dir_fd) as it:
        for entry in it:
            names.append(entry.name)
            text += prefix + len(entry.name.encode("utf-8", "surrogateescape"))
            if len(names) > room or text > text_room:
                return None
    budget.entries += len(names)
    budget.text += text
    return sorted(names)


def _delete_lower_tree(
    lower_fd: int, parts: tuple[str, ...], budget: _Budget, out: _Out
) -> str | None:
    """One delete per file and per directory of the lower tree at `parts` (itself too),
    added to `out` only when the whole tree fits the bounds; else the bound it passes
    (nothing added, the entries it listed given back)."""
    entries, text = budget.entries, budget.text
    tree = _Out()
    stack = [parts]
    while stack:
        here = stack.pop()
        with paths.opened_dir(lower_fd, here, "/".join(here)) as dfd:
            names = _names(dfd, here, budget)
            if names is None:
                budget.entries, budget.text = entries, text
                return "too_many"
            for name in names:
                sub = (*here, name)
                seen = _seen(dfd, name, budget, upper=False)
                if seen is None:
                    continue
                bound = budget.past(sub)
                if bound is None and seen.kind == "file" and seen.sha256 is None:
                    bound = "too_large"  # its delete could not be bound to its bytes
                if bound is not None:
                    budget.entries, budget.text = entries, text
                    return bound
                _delete_one(dfd, sub, seen, tree, stack)
        tree.changes.append(Change(path="/".join(here), op="delete", kind="dir"))
    out.changes.extend(tree.changes)
    out.blocked.extend(tree.blocked)
    return None


def _delete_one(
    dfd: int,
    sub: tuple[str, ...],
    seen: Seen,
    out: _Out,
    stack: list[tuple[str, ...]],
) -> None:
    rel = "/".join(sub)
    if not _utf8(rel):
        out.block(sub, seen.kind, "name_not_utf8")
    elif seen.kind == "dir":
        stack.append(sub)
    elif seen.kind == "symlink":
        out.changes.append(Change(path=rel, op="delete", kind="symlink", base_sha256=seen.sha256))
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
    max_path_bytes: int = MAX_PATH_BYTES,
    symlinks: SymlinkMode = "any",
    max_file_bytes: int = MAX_FILE_BYTES,
) -> ChangeSet:
    """The change set the upper layer `upper_fd` makes of the checkout `lower_fd`.

    A symlink the command made is a change (`kind: "symlink"`) when `symlinks` (the
    profile's) lets it through and its target is one substrate makes; else it is
    blocked whole with `links.refusal`'s reason, and what it would replace stays.

    Past a bound, the part past it is blocked by name (`too_deep`, `too_long`,
    `too_many`, `too_large`: see the module doc) and the rest scanned. Names that are
    not UTF-8 are blocked (`name_not_utf8`, shown `\\xNN` as the gate shows them).
    Costs a listing of every upper directory, a hash of every upper file and of the
    lower file it shadows, and a listing and hash of every lower tree it deletes; holds
    at most `max_entries` names and `MAX_PATH_TEXT` bytes of paths.
    """
    budget = _Budget(max_entries, max_depth, max_bytes, max_path_bytes, symlinks, max_file_bytes)
    out = _Out()
    stack: list[tuple[str, ...]] = [()]
    while stack:
        parts = stack.pop()
        with (
            paths.opened_dir(upper_fd, parts, "/".join(parts)) as udir,
            _lower_dir(lower_fd, parts) as ldir,
        ):
            upper_names = _names(udir, parts, budget)
            hidden: list[str] | None = []
            if upper_names is not None and ldir is not None and _opaque(udir):
                present = set(upper_names)
                listed = _names(ldir, parts, budget)
                hidden = None if listed is None else [n for n in listed if n not in present]
            if upper_names is None or hidden is None:
                out.block(parts or (".",), "dir", "too_many")
                continue
            for name in upper_names:
                _visit(upper_fd, lower_fd, udir, ldir, (*parts, name), budget, out, stack)
            assert ldir is not None or not hidden
            for name in hidden:
                assert ldir is not None
                sub = (*parts, name)
                seen = _seen(ldir, name, budget, upper=False)
                if seen is None:
                    continue
                bound = budget.past(sub)
                if bound is None and seen.kind == "dir" and _utf8("/".join(sub)):
                    bound = _delete_lower_tree(lower_fd, sub, budget, out)
                elif bound is None:
                    _delete_one(ldir, sub, seen, out, [])
                if bound is not None:
                    out.block(sub, seen.kind, bound)
    # Screened whole: no piece of a git directory by content, no misleading new name.
    kept, refused = discoverable.screen(out.changes, lower_fd)
    for change, reason in refused:
        out.block(tuple(change.path.split("/")), change.kind, reason)
    changes = ordered(kept)
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
    bound = budget.past(sub)
    if bound is not None:  # never opened nor hashed: only its kind is looked at
        st = paths.lstat_at(udir, name)
        if st is not None:
            out.block(sub, _kind(st), bound)
        return
    upper = _seen(udir, name, budget, upper=True)
    if upper is None:
        return  # removed since listed: the caller scans a quiet layer; nothing to carry
    if not _utf8(rel):
        out.block(sub, upper.kind, "name_not_utf8")
        return
    if upper.kind == "symlink":
        assert upper.target is not None
        refused = links.refusal(rel, upper.target, budget.symlinks)
        if refused is not None:  # blocked whole: what it would replace stays
            out.block(sub, "symlink", refused)
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
                _delete_one(ldir, sub, lower, out, [])
            case "delete_tree":
                tree_bound = _delete_lower_tree(lower_fd, sub, budget, out)
                if tree_bound is not None:  # what would replace the tree waits with it
                    out.block(sub, upper.kind, tree_bound)
                    return
            case "mkdir":
                out.changes.append(Change(path=rel, op="mkdir", kind="dir", mode=upper.mode))
            case "chmod" if upper.kind == "dir":
                out.changes.append(Change(path=rel, op="chmod", kind="dir", mode=upper.mode))
            case "create" | "replace" if upper.kind == "symlink":
                out.changes.append(_link_change(rel, step, upper, lower))
            case "create" | "replace" | "chmod":
                base = lower if step != "create" else None
                if upper.sha256 is None or (base is not None and base.sha256 is None):
                    out.block(sub, "file", "too_large")
                    continue
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


def _link_change(rel: str, op: Op, upper: Seen, lower: Seen | None) -> Change:
    """The change making the link `upper` (its target checked by `links.refusal`) at
    `rel`; a replace is bound to the lower link's digest."""
    assert upper.target is not None
    target = upper.target.decode("utf-8")
    return Change(
        path=rel,
        op=op,
        kind="symlink",
        base_sha256=lower.sha256 if op == "replace" and lower is not None else None,
        new_sha256=upper.sha256,
        size=upper.size,
        target=target,
        escapes=links.escapes(rel, target),
    )
