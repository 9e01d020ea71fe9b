"""Reverting what sandboxed code changed at denied paths (blocking; under the commit lock).

Never follows a symlink: parents are opened beneath the root with `O_NOFOLLOW`, names
are used relative to them, a created symlink is unlinked, not resolved. A created
directory goes with everything beneath it (`fsops.remove_tree`: iterative, one fd at a
time, so no depth is too deep). A modified or deleted file comes back from its kept
bytes through a same-directory temp file that is recorded before it exists
(`TempFiles.create`, as guarded writes do: a crash mid-restore leaves a temp file the
next start removes), filled with the old owner, mode and mtime, fsynced and renamed
over the name (`fsops.rename_into`: the directory is fsynced too). Missing parent
directories are made again with their old owner and mode when the snapshot knows them.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping

from substrate.errors import Refusal
from substrate.fs import fsops, paths
from substrate.workspace.gate.diff import Change, Node, classify
from substrate.workspace.gate.keep import MAX_KEPT_FILE, Keep
from substrate.workspace.registry import Workspace
from substrate.workspace.writes.temp_files import TEMP_PREFIX, TempFiles


class NotReverted(Exception):
    """A change that is detected but cannot be undone; the message says why."""


def why(exc: BaseException) -> str:
    """The reason journalled for a failure: a refusal's name, an errno's text, a type."""
    if isinstance(exc, Refusal):
        return exc.name
    if isinstance(exc, OSError) and exc.errno is not None:
        return os.strerror(exc.errno)
    return type(exc).__name__


def revert(
    ws: Workspace,
    changes: list[tuple[str, Change]],
    before: Mapping[str, Node],
    now: Mapping[str, Node],
    keep: Keep,
    temps: TempFiles,
) -> list[tuple[bool, str | None]]:
    """Undo each change; (reverted, reason when not) per change, in order.

    The caller holds `ws.use()` and `ws.commit_lock`. Costs, per change: opening its
    parent, plus removing what was created or writing back what was kept.
    """
    out: list[tuple[bool, str | None]] = []
    for rel, change in changes:
        try:
            if change == "create":
                _remove(ws, rel)
            elif change == "chmod":
                _chmod(ws, rel, before[rel], now[rel])
            else:
                if change == "modify" and (
                    before[rel].kind != now[rel].kind or before[rel].kind == "dir"
                ):
                    _remove(ws, rel)
                _restore(ws, rel, before[rel], keep, before, temps)
                if before[rel].kind == "dir":
                    for sub in sorted(
                        (r for r in before if r.startswith(rel + "/")),
                        key=lambda r: (r.count("/"), r),
                    ):
                        if classify(before[sub], now.get(sub)) is not None:
                            _restore(ws, sub, before[sub], keep, before, temps)
            out.append((True, None))
        except NotReverted as exc:
            out.append((False, str(exc)))
        except (OSError, Refusal) as exc:
            out.append((False, why(exc)))
    return out


def _dirs(rel: str) -> tuple[str, ...]:
    return tuple(rel.split("/")[:-1])


def _parent(ws: Workspace, rel: str, before: Mapping[str, Node] | None = None) -> int:
    """The parent dir of `rel` beneath the root; when `before` is given and it is missing,
    made again (each directory with its old owner and mode when `before` knows them,
    else the workspace owner's, 0755)."""
    parts = _dirs(rel)
    where = ws.provenance(rel)
    try:
        return paths.open_dir(ws.root_fd, parts, where)
    except Refusal as exc:
        if before is None or exc.name != "not_found":
            raise

    def attrs(i: int) -> tuple[int, fsops.Owner | None]:
        old = before.get("/".join(parts[: i + 1]))
        if old is None:
            return 0o755, (ws.owner_uid, ws.owner_gid)
        return old.mode if old.kind == "dir" else 0o755, (old.uid, old.gid)

    return fsops.make_dirs(ws.root_fd, parts, where, attrs)


def _remove(ws: Workspace, rel: str) -> None:
    try:
        parent = _parent(ws, rel)
    except Refusal as exc:
        if exc.name == "not_found":
            return  # its parent is gone, and it with it
        raise
    try:
        name = rel.rsplit("/", 1)[-1]
        st = paths.lstat_at(parent, name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            fsops.remove_tree(parent, name)
        else:
            os.unlink(name, dir_fd=parent)
    finally:
        os.close(parent)


def _chmod(ws: Workspace, rel: str, old: Node, new: Node) -> None:
    parent = _parent(ws, rel)
    try:
        name = rel.rsplit("/", 1)[-1]
        flags = (
            fsops.DIR_FLAGS if old.kind == "dir" else os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        )
        fd = os.open(name, flags | os.O_CLOEXEC, dir_fd=parent)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (new.dev, new.ino):
                raise NotReverted("replaced while being restored")
            os.fchmod(fd, old.mode)
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def _restore(
    ws: Workspace,
    rel: str,
    old: Node,
    keep: Keep,
    before: Mapping[str, Node],
    temps: TempFiles,
) -> None:
    """Put `old` back at `rel` (a file from the kept bytes, a symlink, a directory)."""
    if old.kind == "file" and not (old.kept and old.sha256):
        raise NotReverted(f"larger than the {MAX_KEPT_FILE} bytes kept: not restored")
    if old.kind == "other":
        raise NotReverted("not a file, directory or symlink: not restored")
    parent = _parent(ws, rel, before)
    try:
        name = rel.rsplit("/", 1)[-1]
        if old.kind == "dir":
            current = paths.lstat_at(parent, name)
            if current is not None and not stat.S_ISDIR(current.st_mode):
                os.unlink(name, dir_fd=parent)
                current = None
            if current is None:
                fsops.make_dir(parent, name, mode=old.mode, owner=(old.uid, old.gid))
            return
        if old.kind == "symlink":
            # Not recorded: the start-up cleaner removes only regular files (a symlink
            # at a recorded name may be anyone's), so a record would never be used.
            assert old.target is not None
            temp = TEMP_PREFIX + secrets.token_hex(8)
            os.symlink(old.target, temp, dir_fd=parent)
            if os.geteuid() == 0:
                os.chown(temp, old.uid, old.gid, dir_fd=parent, follow_symlinks=False)
            recorded = False
        else:
            assert old.sha256 is not None
            temp = _write_temp(ws, parent, rel, keep.get(old.sha256), old, temps)
            recorded = True
        try:
            current = paths.lstat_at(parent, name)
            if current is not None and stat.S_ISDIR(current.st_mode):
                fsops.remove_tree(parent, name)  # a directory stands where the file was
            fsops.rename_into(parent, temp, name)
        except BaseException:
            fsops.unlink_quietly(parent, temp)
            if recorded:
                temps.forget(ws.id, _dirs(rel), temp)
            raise
        if recorded:
            temps.forget(ws.id, _dirs(rel), temp)
    finally:
        os.close(parent)


def _write_temp(
    ws: Workspace, parent: int, rel: str, data: bytes, old: Node, temps: TempFiles
) -> str:
    """The kept bytes in a recorded temp file beside `rel`, with the old owner, mode and
    mtime, fsynced. Returns its name."""
    temp, fd = temps.create(ws.id, parent, _dirs(rel), ws.provenance(rel))
    try:
        fsops.fill(fd, data, mode=old.mode, owner=(old.uid, old.gid), mtime_ns=old.mtime_ns)
    except BaseException:
        os.close(fd)
        temps.discard(ws.id, parent, _dirs(rel), temp)
        raise
    os.close(fd)
    return temp
