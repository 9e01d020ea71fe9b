"""Bounded, symlink-refusing reads of a workspace (SPEC §3).

Every function is blocking (call it from a worker thread) and reaches files only through
the workspace's root fd (`substrate.paths`). Symlinks are reported as such and never
followed; `read_deny` paths are refused for content and skipped by search.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from substrate import paths
from substrate.errors import InvalidParams, PathDenied, TooLarge
from substrate.policy import GlobSet
from substrate.schema.fs import (
    MAX_READ,
    ListEntry,
    ListParams,
    ListResult,
    ReadParams,
    ReadResult,
    SearchMatch,
    SearchParams,
    SearchResult,
    StatParams,
    StatResult,
    WalkEntry,
    WalkParams,
    WalkResult,
)
from substrate.workspaces import TEMP_PREFIX, Workspace

#: The stdlib's own regex parser (private, stable since 3.11): see `_Prefilter`.
_sre: Any = importlib.import_module("re._constants")
_sre_parser: Any = importlib.import_module("re._parser")

CHUNK = 1 << 20
#: Files larger than this are skipped by search (reported in files_scanned only when read).
SEARCH_MAX_FILE = 64 << 20
_BINARY_SNIFF = 8192
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _check_readable(ws: Workspace, rel: str) -> None:
    if not ws.policy.may_read(rel):
        raise PathDenied(f"{ws.provenance(rel)}: denied by the workspace read policy")


def hash_fd(fd: int) -> str:
    """SHA-256 of a whole open file, from offset 0."""
    digest = hashlib.sha256()
    offset = 0
    while True:
        block = os.pread(fd, CHUNK, offset)
        if not block:
            return digest.hexdigest()
        digest.update(block)
        offset += len(block)


def stat_path(ws: Workspace, p: StatParams) -> StatResult:
    """`fs.stat`. Refuses path, symlink-on-the-way and read_deny problems."""
    parts = paths.split_relpath(p.path, allow_root=True)
    rel = "/".join(parts) or "."
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
        kind = paths.kind_of(st.st_mode)
        sha = None
        if kind == "file":
            fd = paths.open_regular(parent, parts[-1], ws.provenance(rel))
            try:
                sha = hash_fd(fd)
            finally:
                os.close(fd)
    return StatResult(
        path=rel,
        kind=kind,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime_ns=st.st_mtime_ns,
        sha256=sha,
    )


def read_file(ws: Workspace, p: ReadParams) -> ReadResult:
    """`fs.read`: a slice plus the whole file's SHA-256 (so a write can bind to it).

    Refuses `too_large` for length > 4 MiB; `not_a_file` for FIFOs, devices and
    directories (a FIFO is opened non-blocking, so it never hangs). Costs one pass over
    the whole file for the digest; the slice is taken from the same pass.
    """
    if p.length > MAX_READ:
        raise TooLarge(f"length {p.length} exceeds {MAX_READ}", limit=MAX_READ)
    parts = paths.split_relpath(p.path)
    rel = "/".join(parts)
    _check_readable(ws, rel)
    with paths.opened_dir(ws.root_fd, parts[:-1], ws.provenance(rel)) as parent:
        fd = paths.open_regular(parent, parts[-1], ws.provenance(rel))
    try:
        for _attempt in range(3):
            before = os.fstat(fd)
            digest = hashlib.sha256()
            piece = bytearray()
            end = p.offset + p.length
            offset = 0
            while True:
                block = os.pread(fd, CHUNK, offset)
                if not block:
                    break
                digest.update(block)
                lo, hi = max(p.offset, offset), min(end, offset + len(block))
                if lo < hi:
                    piece += block[lo - offset : hi - offset]
                offset += len(block)
            after = os.fstat(fd)
            if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns):
                break
        size = offset
    finally:
        os.close(fd)
    data = bytes(piece)
    try:
        text, encoding = data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(data).decode("ascii"), "base64"
    return ReadResult(
        path=rel,
        size=size,
        sha256=digest.hexdigest(),
        offset=p.offset,
        eof=p.offset + len(data) >= size,
        encoding=encoding,  # type: ignore[arg-type]
        data=text,
    )


def _name_key(name: str) -> bytes:
    return os.fsencode(name)


def _scan_sorted(dir_fd: int) -> list[os.DirEntry[str]]:
    with os.scandir(dir_fd) as it:
        return sorted(it, key=lambda e: _name_key(e.name))


def _entry_kind_size(entry: os.DirEntry[str]) -> tuple[paths.Kind, int]:
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return "other", 0
    return paths.kind_of(st.st_mode), st.st_size


def list_dir(ws: Workspace, p: ListParams) -> ListResult:
    """`fs.list`: one directory's entries sorted by name bytes, at most `limit`."""
    parts = paths.split_relpath(p.path, allow_root=True)
    rel = "/".join(parts) or "."
    out = []
    with paths.opened_dir(ws.root_fd, parts, ws.provenance(rel)) as fd:
        entries = _scan_sorted(fd)
        # Inside the block: a DirEntry of scandir(fd) stats lazily, relative to that fd.
        for entry in entries[: p.limit]:
            kind, size = _entry_kind_size(entry)
            out.append(ListEntry(name=entry.name, kind=kind, size=size))
    return ListResult(entries=out, truncated=len(entries) > p.limit)


@dataclass
class _Found:
    rel: str
    kind: paths.Kind
    size: int
    parent_fd: int
    name: str


def _kind_from_dirent(entry: os.DirEntry[str]) -> paths.Kind:
    """The kind from the directory entry's d_type: no syscall (size unknown: 0)."""
    if entry.is_symlink():
        return "symlink"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"


def _walk(
    ws: Workspace,
    parts: tuple[str, ...],
    max_depth: int | None,
    include_git: bool,
    *,
    sizes: bool = True,
) -> Iterator[_Found]:
    """Pre-order, name-byte-sorted walk. Directories are opened with O_NOFOLLOW.

    With `sizes=False` entries are classified from d_type and reported with size 0,
    saving an lstat per entry; callers then check what they open with fstat.
    """
    base = "/".join(parts)
    top = paths.open_dir(ws.root_fd, parts, ws.provenance(base or "."))
    stack: list[tuple[int, str, int, Iterator[os.DirEntry[str]]]] = [
        (top, base, 1, iter(_scan_sorted(top)))
    ]
    try:
        while stack:
            dir_fd, dir_rel, depth, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(dir_fd)
                stack.pop()
                continue
            if entry.name.startswith(TEMP_PREFIX):
                continue
            if entry.name == ".git" and not include_git:
                continue
            rel = f"{dir_rel}/{entry.name}" if dir_rel else entry.name
            if sizes:
                kind, size = _entry_kind_size(entry)
            else:
                kind, size = _kind_from_dirent(entry), 0
            yield _Found(rel, kind, size, dir_fd, entry.name)
            if kind == "dir" and (max_depth is None or depth < max_depth):
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    continue  # swapped or vanished meanwhile: never followed
                stack.append((child, rel, depth + 1, iter(_scan_sorted(child))))
    finally:
        for dir_fd, *_ in stack:
            os.close(dir_fd)


def walk(ws: Workspace, p: WalkParams) -> WalkResult:
    """`fs.walk`: contained, deterministic, never follows a symlink, skips `.git` unless asked."""
    parts = paths.split_relpath(p.path, allow_root=True)
    if p.max_depth == 0:
        return WalkResult(paths=[], truncated=False)
    out: list[WalkEntry] = []
    truncated = False
    for found in _walk(ws, parts, p.max_depth, p.include_git):
        if len(out) >= p.max_entries:
            truncated = True
            break
        out.append(WalkEntry(path=found.rel, kind=found.kind, size=found.size))
    return WalkResult(paths=out, truncated=truncated)


def _compile_search(p: SearchParams) -> re.Pattern[bytes]:
    flags = re.MULTILINE | (re.IGNORECASE if p.ignore_case else 0)
    source = re.escape(p.pattern) if p.fixed else p.pattern
    try:
        return re.compile(source.encode("utf-8", "surrogateescape"), flags)
    except re.error as exc:
        raise InvalidParams(f"pattern: {exc}", path="$.pattern") from None


def search(ws: Workspace, p: SearchParams) -> SearchResult:
    """`fs.search`: regex (or fixed string) over the tree's text files, bounded.

    Skips symlinks, binary files (a NUL in the first 8 KiB), files over 64 MiB, `.git`,
    and `read_deny` paths. `column` is the 1-based byte column. Costs one read of every
    scanned file, plus regex work only where a literal every match must contain occurs
    (see `_Prefilter`); stops at `max_matches`.
    """
    regex = _compile_search(p)
    prefilter = _Prefilter.of(regex)
    try:
        globs = GlobSet.of([p.glob]) if p.glob else None
    except InvalidParams as exc:
        raise InvalidParams(exc.message, path="$.glob") from None
    parts = paths.split_relpath(p.path, allow_root=True)
    matches: list[SearchMatch] = []
    files = 0
    scanned = 0
    for found in _walk(ws, parts, None, include_git=False, sizes=False):
        if found.kind != "file" or found.size > SEARCH_MAX_FILE:
            continue
        if not ws.policy.may_read(found.rel):
            continue
        if globs is not None and not globs.matches(found.rel):
            continue
        try:
            fd = os.open(
                found.name,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=found.parent_fd,
            )
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > SEARCH_MAX_FILE:
                continue
            # One read of the expected size (+1 to see the end): a 1 MiB read buffer per
            # file costs more than the search itself (an mmap and page faults each time).
            data = os.read(fd, st.st_size + 1)
            if len(data) > st.st_size:  # it grew meanwhile: read the rest
                data += _read_all(fd)
        finally:
            os.close(fd)
        if data.find(b"\x00", 0, _BINARY_SNIFF) >= 0:
            continue
        files += 1
        scanned += len(data)
        if _collect(regex, prefilter, data, found.rel, p.max_line_bytes, matches, p.max_matches):
            return SearchResult(
                matches=matches, truncated=True, files_scanned=files, bytes_scanned=scanned
            )
    return SearchResult(
        matches=matches, truncated=False, files_scanned=files, bytes_scanned=scanned
    )


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        block = os.read(fd, CHUNK)
        if not block:
            return b"".join(chunks)
        chunks.append(block)


@dataclass(frozen=True)
class _Prefilter:
    """What a search may skip without changing its result (grep's "must" literal).

    `literal`: bytes every match contains (lowercased when `fold`, for IGNORECASE, whose
    bytes folding is ASCII-only like `bytes.lower`); a file without it has no match, and
    `bytes.find` rejects it far faster than the regex engine. `line_bound`: no match can
    contain a newline or look past its line's end, so the regex needs to run only on the
    lines where the literal occurs. Both are derived from the stdlib's own parse of the
    pattern; anything unrecognised makes them empty/False (search every byte).
    """

    literal: bytes = b""
    fold: bool = False
    line_bound: bool = False

    @classmethod
    def of(cls, regex: re.Pattern[bytes]) -> _Prefilter:
        try:
            parsed = _sre_parser.parse(regex.pattern, regex.flags)
        except Exception:  # a parser this code does not know: no shortcut
            return cls()
        flags = parsed.state.flags
        if flags & _sre.SRE_FLAG_LOCALE or _scoped_flags(parsed.data):
            return cls()
        fold = bool(flags & _sre.SRE_FLAG_IGNORECASE)
        literal = max(_literals(parsed.data), key=len, default=b"")
        # With DOTALL, `.` matches a newline: the literal still filters files, not lines.
        dotall = bool(flags & _sre.SRE_FLAG_DOTALL)
        return cls(
            literal=literal.lower() if fold else literal,
            fold=fold,
            line_bound=bool(literal) and not dotall and _line_bound(parsed.data),
        )


def _scoped_flags(items: Any) -> bool:
    """True when any `(?flags:...)` group changes the flags of part of the pattern."""
    for op, av in items:
        if op is _sre.SUBPATTERN and (av[1] or av[2]):
            return True
        for sub in _children(op, av):
            if _scoped_flags(sub):
                return True
    return False


def _children(op: Any, av: Any) -> list[Any]:
    if op is _sre.SUBPATTERN:
        return [av[3]]
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
        return [av[2]]
    if op is _sre.ATOMIC_GROUP:
        return [av]
    if op is _sre.BRANCH:
        return list(av[1])
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if op is _sre.GROUPREF_EXISTS:
        return [x for x in av[1:] if x is not None]
    return []


def _literals(items: Any) -> list[bytes]:
    """Byte strings that every match of the sequence `items` contains."""
    found: list[bytes] = []
    run: list[int] = []
    for op, av in items:
        if op is _sre.LITERAL:
            run.append(av)
            continue
        found.append(bytes(run))
        run = []
        if op is _sre.SUBPATTERN:
            found += _literals(av[3])
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT) and av[0] >= 1:
            found += _literals(av[2])
        elif op is _sre.ATOMIC_GROUP:
            found += _literals(av)
    found.append(bytes(run))
    return [f for f in found if f]


#: Classes that never match a newline: \d, \S, \w.
_LINE_CATEGORIES = {_sre.CATEGORY_DIGIT, _sre.CATEGORY_NOT_SPACE, _sre.CATEGORY_WORD}
_NL = 10


def _set_matches_newline(items: Any) -> bool:
    hit = False
    negate = False
    for op, av in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            hit = hit or av == _NL
        elif op is _sre.RANGE:
            hit = hit or av[0] <= _NL <= av[1]
        elif op is _sre.CATEGORY:
            hit = hit or av not in _LINE_CATEGORIES
        else:
            return True
    return hit != negate


def _line_bound(items: Any) -> bool:
    """True when no match of `items` can hold a newline or depend on the text past its line.

    Lookarounds and `\\Z` are refused: searching a line with `endpos` at its end would
    change what they see.
    """
    for op, av in items:
        if op is _sre.LITERAL:
            ok = av != _NL
        elif op is _sre.NOT_LITERAL:
            ok = av == _NL
        elif op is _sre.ANY:
            ok = True  # without DOTALL (checked by the caller), `.` never matches a newline
        elif op is _sre.IN:
            ok = not _set_matches_newline(av)
        elif op is _sre.AT:
            ok = av is not _sre.AT_END_STRING
        elif op is _sre.GROUPREF:
            ok = True  # repeats text of this match, which is on this line
        elif op in (_sre.SUBPATTERN, _sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            ok = _line_bound(_children(op, av)[0])
        elif op in (_sre.ATOMIC_GROUP, _sre.BRANCH, _sre.GROUPREF_EXISTS):
            ok = all(_line_bound(sub) for sub in _children(op, av))
        else:
            ok = False
        if not ok:
            return False
    return True


def _collect(
    regex: re.Pattern[bytes],
    prefilter: _Prefilter,
    data: bytes,
    rel: str,
    max_line_bytes: int,
    out: list[SearchMatch],
    limit: int,
) -> bool:
    """Append one match per matching line; True when `limit` was reached.

    The result is the same as `regex.search` over the whole file from each line's start;
    the prefilter only skips work that cannot find anything.
    """
    literal = prefilter.literal
    hay = data.lower() if literal and prefilter.fold else data
    if literal and hay.find(literal) < 0:
        return False
    line_no = 1
    counted_to = 0

    def add(start: int, end: int, column: int) -> bool:
        nonlocal line_no, counted_to
        line_no += data.count(b"\n", counted_to, start)
        counted_to = start
        text = data[start : min(end, start + max_line_bytes)].decode("utf-8", "replace")
        out.append(SearchMatch(path=rel, line=line_no, column=column, text=text))
        return len(out) >= limit

    if prefilter.line_bound:
        # Only lines holding the literal can match; a match never leaves its line.
        at = hay.find(literal)
        while at >= 0:
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end
            m = regex.search(data, start, end)
            if m is not None and add(start, end, m.start() - start + 1):
                return True
            at = hay.find(literal, end + 1)
        return False
    pos = 0
    while pos <= len(data):
        m = regex.search(data, pos)
        if m is None:
            return False
        start = data.rfind(b"\n", 0, m.start()) + 1
        end = data.find(b"\n", m.start())
        end = len(data) if end < 0 else end
        if add(start, end, m.start() - start + 1):
            return True
        pos = end + 1
    return False
