"""Bounded, symlink-refusing reads of a workspace (docs/protocol.md §3).

Every function is blocking (call it from a worker thread) and reaches files only through
the workspace's root fd (`substrate.fs.paths`), held against release (`Workspace.use`) while
it opens them. Symlinks are reported as such and never followed; `read_deny` paths are
refused for content and skipped by search (`substrate.workspace.search`, which walks
as `walk_entries` does, with `entered` and `kind_from_dirent`, fused with its reads).
Names that are not UTF-8 are listed escaped (`paths.wire_name`), never refused.

Whole-file digests (`fs.stat`, `fs.read`) cost a pass over the file, so they are bounded:
a caller passes `hash_up_to`, and a file over it that `Digests`
(`substrate.workspace.digests`) does not know yet gets no digest (`sha256_deferred`)
unless the caller asks for any size (`None`), which the API does only on request and
on threads of its own.
"""

from __future__ import annotations

import base64
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from substrate.errors import PathDenied, TooLarge
from substrate.fs import fsops, paths
from substrate.schema.fs import (
    MAX_READ,
    ListEntry,
    ListParams,
    ListResult,
    ReadParams,
    ReadResult,
    StatParams,
    StatResult,
    WalkEntry,
    WalkParams,
    WalkResult,
)
from substrate.workspace.digests import CHUNK, Digests, version_of
from substrate.workspace.ignore import Pruner
from substrate.workspace.registry import Workspace
from substrate.workspace.writes.temp_files import TEMP_PREFIX

#: Files up to this size get their digest with every stat and read (`inline_hash_bytes`).
INLINE_HASH_BYTES = 64 << 20

__all__ = [
    "INLINE_HASH_BYTES",
    "Digests",
    "Found",
    "list_dir",
    "pruner_for",
    "read_file",
    "stat_path",
    "walk",
    "walk_entries",
]


def _check_readable(ws: Workspace, rel: str) -> None:
    if not ws.policy.may_read(rel):
        raise PathDenied(f"{ws.provenance(rel)}: denied by the workspace read policy")


def _open_file(ws: Workspace, parts: tuple[str, ...], rel: str) -> int:
    """Open the regular file `parts` beneath the root fd, which is held only for the open."""
    with ws.use(), paths.opened_dir(ws.root_fd, parts[:-1], ws.provenance(rel)) as parent:
        return paths.open_regular(parent, parts[-1], ws.provenance(rel))


def stat_path(
    ws: Workspace, p: StatParams, digests: Digests, hash_up_to: int | None = INLINE_HASH_BYTES
) -> StatResult:
    """`fs.stat`. Refuses path, symlink-on-the-way and read_deny problems.

    A file's `sha256` is given when `digests` knows it or the file is at most
    `hash_up_to` bytes (`None`: any size); else it is null with `sha256_deferred`. Costs
    a pass over a file whose digest is computed, nothing more for any other.
    """
    parts = paths.split_relpath(p.path, allow_root=True)
    rel = "/".join(parts) or "."
    fd = None
    with ws.use():
        if parts:
            _check_readable(ws, rel)
        with paths.opened_dir(ws.root_fd, parts[:-1], ws.provenance(rel)) as parent:
            if not parts:
                st = os.fstat(parent)
            else:
                found = paths.lstat_at(parent, parts[-1])
                if found is None:
                    raise paths.refusal_for(FileNotFoundError(2, "absent"), ws.provenance(rel))
                st = found
                if stat.S_ISREG(st.st_mode):
                    fd = paths.open_regular(parent, parts[-1], ws.provenance(rel))
    sha = None
    if fd is not None:
        try:
            st, sha = digests.of(fd, hash_up_to)
        finally:
            os.close(fd)
    return StatResult(
        path=rel,
        kind=paths.kind_of(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime_ns=st.st_mtime_ns,
        sha256=sha,
        sha256_deferred=fd is not None and sha is None,
    )


def _pread_range(fd: int, offset: int, length: int) -> bytes:
    chunks: list[bytes] = []
    while length > 0:
        block = os.pread(fd, min(length, CHUNK), offset)
        if not block:
            break
        chunks.append(block)
        offset += len(block)
        length -= len(block)
    return b"".join(chunks)


def read_file(
    ws: Workspace, p: ReadParams, digests: Digests, hash_up_to: int | None = INLINE_HASH_BYTES
) -> ReadResult:
    """`fs.read`: a slice plus the whole file's SHA-256 (so a write can bind to it).

    The digest follows `stat_path`'s rule (`hash_up_to`, `sha256_deferred`); slice and
    digest are of the same version (re-read while the file changes under them, at most
    three times). Refuses `too_large` for length > 4 MiB; `not_a_file` for FIFOs, devices
    and directories (a FIFO is opened non-blocking, so it never hangs). Costs the slice,
    plus a pass over the whole file when its digest is computed.
    """
    if p.length > MAX_READ:
        raise TooLarge(f"length {p.length} exceeds {MAX_READ}", limit=MAX_READ)
    parts = paths.split_relpath(p.path)
    rel = "/".join(parts)
    _check_readable(ws, rel)
    fd = _open_file(ws, parts, rel)
    try:
        for _attempt in range(3):
            st, digest = digests.of(fd, hash_up_to)
            data = _pread_range(fd, p.offset, p.length)
            if version_of(os.fstat(fd)) == version_of(st):
                break
    finally:
        os.close(fd)
    try:
        text, encoding = data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(data).decode("ascii"), "base64"
    return ReadResult(
        path=rel,
        size=st.st_size,
        sha256=digest,
        sha256_deferred=digest is None,
        offset=p.offset,
        eof=p.offset + len(data) >= st.st_size,
        encoding=encoding,  # type: ignore[arg-type]
        data=text,
    )


def _name_key(name: str) -> bytes:
    return os.fsencode(name)


def _scan_sorted(dir_fd: int) -> list[os.DirEntry[str]]:
    """The entries of `dir_fd` in name-byte order. UTF-8 keeps code point order, so
    names without escaped bytes (surrogates) sort as `str`, without an encode each."""
    with os.scandir(dir_fd) as it:
        entries = list(it)
    if all(_name_is_utf8(e.name) for e in entries):
        entries.sort(key=_by_name)
    else:
        entries.sort(key=lambda e: _name_key(e.name))
    return entries


def _by_name(entry: os.DirEntry[str]) -> str:
    return entry.name


def _name_is_utf8(name: str) -> bool:
    return name.isascii() or not any("\udc80" <= c <= "\udcff" for c in name)


def _entry_kind_size(entry: os.DirEntry[str]) -> tuple[paths.Kind, int]:
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return "other", 0
    return paths.kind_of(st.st_mode), st.st_size


def list_dir(ws: Workspace, p: ListParams) -> ListResult:
    """`fs.list`: one directory's entries sorted by name bytes, at most `limit`.

    A name that is not UTF-8 is listed escaped, with its bytes in `name_b64`.
    """
    parts = paths.split_relpath(p.path, allow_root=True)
    rel = "/".join(parts) or "."
    out = []
    with ws.use(), paths.opened_dir(ws.root_fd, parts, ws.provenance(rel)) as fd:
        entries = _scan_sorted(fd)
        # Inside the block: a DirEntry of scandir(fd) stats lazily, relative to that fd.
        for entry in entries[: p.limit]:
            kind, size = _entry_kind_size(entry)
            name, raw = paths.wire_name(entry.name)
            out.append(ListEntry(name=name, kind=kind, size=size, name_b64=raw))
    return ListResult(entries=out, truncated=len(entries) > p.limit)


@dataclass
class Found:
    """One entry met by `walk_entries`; `parent_fd` is open only until the walk moves on."""

    rel: str
    kind: paths.Kind
    size: int
    parent_fd: int
    name: str


def kind_from_dirent(entry: os.DirEntry[str]) -> paths.Kind:
    """The kind from the directory entry's d_type: no syscall (size unknown: 0)."""
    if entry.is_symlink():
        return "symlink"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"


def walk_entries(
    ws: Workspace,
    parts: tuple[str, ...],
    max_depth: int | None,
    include_git: bool,
    *,
    sizes: bool = True,
    prune: Pruner | None = None,
) -> Iterator[Found]:
    """Every entry beneath `parts`: pre-order, name-byte-sorted; `.git` skipped unless
    `include_git`, temp files always. Directories are opened with O_NOFOLLOW, one fd held
    per level of depth; a symlink is yielded, never followed.

    With `sizes=False` entries are classified from d_type and reported with size 0,
    saving an lstat per entry; callers then check what they open with fstat. With
    `prune` (`substrate.workspace.ignore`), what it leaves out is neither yielded nor
    entered, and it reads the ignore files of each directory entered through that
    directory's fd (refusing as `Pruner.enter` does).
    """
    base = "/".join(parts)
    with ws.use():
        if prune is not None and not prune.start(ws.root_fd, parts):
            return
        top = paths.open_dir(ws.root_fd, parts, ws.provenance(base or "."))
    stack: list[tuple[int, str, int, Iterator[os.DirEntry[str]]]] = []
    try:
        stack.append((top, base, 1, iter(entered(top, base, prune))))
        while stack:
            dir_fd, dir_rel, depth, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(dir_fd)
                stack.pop()
                if prune is not None:
                    prune.leave()
                continue
            if entry.name.startswith(TEMP_PREFIX):
                continue
            if entry.name == ".git" and not include_git:
                continue
            rel = f"{dir_rel}/{entry.name}" if dir_rel else entry.name
            if sizes:
                kind, size = _entry_kind_size(entry)
            else:
                kind, size = kind_from_dirent(entry), 0
            if prune is not None and prune.leaves_out(rel, entry.name, kind):
                continue
            yield Found(rel, kind, size, dir_fd, entry.name)
            if kind == "dir" and (max_depth is None or depth < max_depth):
                try:
                    child = os.open(entry.name, fsops.DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    continue  # swapped or vanished meanwhile: never followed
                try:
                    listed = entered(child, rel, prune)
                except BaseException:
                    os.close(child)
                    raise
                stack.append((child, rel, depth + 1, iter(listed)))
    finally:
        for dir_fd, *_ in stack:
            os.close(dir_fd)


def entered(dir_fd: int, rel: str, prune: Pruner | None) -> list[os.DirEntry[str]]:
    """The sorted entries of a directory the walk enters, told to `prune` first."""
    entries = _scan_sorted(dir_fd)
    if prune is not None:
        prune.enter(dir_fd, rel, [e.name for e in entries])
    return entries


def pruner_for(ws: Workspace, exclude: list[str], gitignore: bool) -> Pruner | None:
    """What a walk or search of `ws` leaves out (`exclude` globs, git's ignore rules), or
    None. Refuses `invalid_params` (`$.exclude`) for a bad glob."""
    return Pruner.of(exclude, gitignore, may_read=ws.policy.may_read, where=ws.provenance)


def walk(ws: Workspace, p: WalkParams) -> WalkResult:
    """`fs.walk`: contained, deterministic, never follows a symlink, skips `.git` unless asked.

    A path that is not UTF-8 is listed escaped, with its bytes in `path_b64`. With
    `exclude` or `gitignore` what they match is not listed nor entered (`Pruner`);
    refuses `invalid_params` for a bad glob, `too_large`/`limit_exceeded` for ignore
    files over their bounds. Costs an lstat per entry, plus a read of each ignore file
    met and a few look-ups per entry with `gitignore`.
    """
    parts = paths.split_relpath(p.path, allow_root=True)
    prune = pruner_for(ws, p.exclude, p.gitignore)
    if p.max_depth == 0:
        return WalkResult(paths=[], truncated=False)
    out: list[WalkEntry] = []
    truncated = False
    for found in walk_entries(ws, parts, p.max_depth, p.include_git, prune=prune):
        if len(out) >= p.max_entries:
            truncated = True
            break
        path, raw = paths.wire_name(found.rel)
        out.append(WalkEntry(path=path, kind=found.kind, size=found.size, path_b64=raw))
    return WalkResult(paths=out, truncated=truncated)
