"""Refs read and changed beneath a held git directory fd, as git's own lock files have it.

Theory of operation (docs/git.md "Refs"). A ref is a loose file `refs/...` holding an
object id, or a line of `packed-refs`; a loose one wins. `read_refs` walks `refs/` one
`O_NOFOLLOW` directory at a time (a symlink is skipped and named, never followed) and
streams `packed-refs`; both are bounded by `max_refs`.

`update_ref` is `git update-ref <name> <new> <old>`: it takes `<ref>.lock`
(`O_CREAT | O_EXCL`, so a host `git` holding it means `locked`, and ours keeps it out),
reads the current value, compares it with `old_oid`, checks that `new_oid` is in the
object store, appends the reflog line, writes the lock, fsyncs it and renames it over
the ref. A deletion also takes `packed-refs.lock` and rewrites `packed-refs` without the
ref. Only `refs/...`, `packed-refs` and `logs/refs/...` are ever written: never `HEAD`,
the index, `config`, hooks or `info/`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
import time
from collections.abc import Iterator
from typing import IO, Literal

import msgspec

from substrate.errors import InvalidParams, NotADirectory, NotFound, Refusal, TooLarge
from substrate.fs import fsops, paths
from substrate.git.history import commit_subjects
from substrate.git.refnames import MAX_REF_BYTES, valid_ref_name
from substrate.git.store import ZERO_OID, ObjectStore, valid_oid

__all__ = [
    "RefOutcome",
    "RefScan",
    "commit_subjects",
    "read_refs",
    "scan_refs",
    "update_ref",
    "valid_ref_name",
]

#: A directory of refs or logs, and a ref or reflog file, as git makes them.
DIR_MODE, FILE_MODE = 0o755, 0o644
#: The longest line of packed-refs read (an id, a space, a name, the newline).
MAX_LINE = 40 + 1 + MAX_REF_BYTES + 1
#: A loose ref file is read up to this many bytes (an id and a newline, or `ref: ...`).
MAX_LOOSE = MAX_LINE
#: A reflog message is cut to this many bytes.
MAX_MESSAGE = 1024

Outcome = Literal[
    "applied",
    "unchanged",
    "host_changed",
    "missing_object",
    "invalid_name",
    "locked",
    "name_conflict",
]


class RefOutcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `update_ref` did. `applied`: the ref now holds the new id (or is gone);
    `unchanged`: it already held it; `host_changed`: it held neither the old id nor the
    new one (`current`: what it holds); `missing_object`: the new id is not in the
    store; `invalid_name`: not a ref name `valid_ref_name` takes; `locked`: the ref or
    `packed-refs` is locked (a `git` is changing it); `name_conflict`: the name is held
    by something that is not a ref file (a directory, a symlink, a symbolic ref), or a
    ref is where one of its directories would be (`refs/heads/a` for `refs/heads/a/b`)."""

    outcome: Outcome
    current: str | None


class RefScan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `scan_refs` found: each ref's id, and the entries skipped with why
    (`symlink`, `not_a_file`, `invalid_name`, `symbolic`, `unparsable`)."""

    refs: dict[str, str]
    skipped: tuple[tuple[str, str], ...]


# --- reading --------------------------------------------------------------------------------


def read_refs(git_dir_fd: int, *, max_refs: int) -> dict[str, str]:
    """Every ref under `refs/` with the id it holds: loose refs over `packed-refs`.

    Raises TooLarge when more than `max_refs` refs, or loose entries (files and
    directories), are met. Costs a walk of `refs/` and one pass over `packed-refs`.
    """
    return scan_refs(git_dir_fd, max_refs=max_refs).refs


def scan_refs(git_dir_fd: int, *, max_refs: int) -> RefScan:
    """`read_refs` with the entries it skipped (symbolic refs, symlinks, others)."""
    skipped: list[tuple[str, str]] = []
    refs: dict[str, str] = {}
    for name, oid in _packed(git_dir_fd):
        if len(refs) >= max_refs:
            raise TooLarge(f"packed-refs holds more than {max_refs} refs", limit=max_refs)
        refs[name] = oid
    met = 0
    for name, value in _loose(git_dir_fd, skipped, max_refs):
        met += 1
        if met > max_refs:
            raise TooLarge(f"refs/ holds more than {max_refs} entries", limit=max_refs)
        if not valid_ref_name(name):
            skipped.append((name, "invalid_name"))
        elif value is None:
            continue  # a directory
        elif value.startswith("ref:"):
            skipped.append((name, "symbolic"))
        elif not valid_oid(value):
            skipped.append((name, "unparsable"))
        else:
            refs[name] = value
            if len(refs) > max_refs:
                raise TooLarge(f"more than {max_refs} refs", limit=max_refs)
    return RefScan(refs, tuple(skipped))


def _packed(git_dir_fd: int) -> Iterator[tuple[str, str]]:
    """(name, id) of each line of `packed-refs` naming a valid ref; peeled lines (`^`)
    and the header are skipped. Streams; memory is one line."""
    try:
        fd = paths.open_regular(git_dir_fd, "packed-refs", "packed-refs")
    except NotFound:
        return
    with os.fdopen(fd, "rb") as file:
        yield from _packed_lines(file)


def _packed_lines(file: IO[bytes]) -> Iterator[tuple[str, str]]:
    while line := file.readline(MAX_LINE + 1):
        if len(line) > MAX_LINE:
            raise TooLarge(f"a line of packed-refs is over {MAX_LINE} bytes", limit=MAX_LINE)
        if line[:1] in (b"#", b"^"):
            continue
        oid, _, raw = line.rstrip(b"\n").partition(b" ")
        try:
            name, text = raw.decode("utf-8"), oid.decode("ascii")
        except UnicodeDecodeError:
            continue
        if valid_oid(text) and valid_ref_name(name):
            yield name, text


def _loose(
    git_dir_fd: int, skipped: list[tuple[str, str]], max_entries: int
) -> Iterator[tuple[str, str | None]]:
    """(name, content) of each file under `refs/` (None for a directory), depth first,
    holding one fd per level; `.lock` files are skipped, symlinks and others named."""
    try:
        top = paths.open_dir(git_dir_fd, ("refs",), "refs")
    except Refusal:
        return
    stack: list[tuple[int, str, Iterator[os.DirEntry[str]]]] = []
    try:
        stack.append((top, "refs", _listing(top, max_entries)))
        while stack:
            fd, prefix, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(fd)
                stack.pop()
                continue
            name = f"{prefix}/{entry.name}"
            if entry.name.endswith(".lock"):
                continue
            st = paths.lstat_at(fd, entry.name)
            if st is None:
                continue
            if stat.S_ISLNK(st.st_mode):
                skipped.append((name, "symlink"))
            elif stat.S_ISDIR(st.st_mode):
                if len(name.encode("utf-8", "surrogateescape")) >= MAX_REF_BYTES:
                    skipped.append((name, "invalid_name"))  # and a bound on the fds held
                    continue
                yield name, None
                try:
                    sub = paths.open_dir(fd, (entry.name,), name)
                except Refusal:
                    skipped.append((name, "symlink"))
                    continue
                stack.append((sub, name, _listing(sub, max_entries)))
            elif not stat.S_ISREG(st.st_mode):
                skipped.append((name, "not_a_file"))
            else:
                value = _read_loose(fd, entry.name, name)
                yield name, value if value is not None else ""
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _listing(fd: int, cap: int) -> Iterator[os.DirEntry[str]]:
    """The entries of the directory `fd` by name; more than `cap` is TooLarge (a
    directory's listing is held to be sorted)."""
    with os.scandir(fd) as entries:
        held = list(itertools.islice(entries, cap + 1))
    if len(held) > cap:
        raise TooLarge(f"refs/ holds more than {cap} entries", limit=cap)
    return iter(sorted(held, key=lambda e: e.name))


def _read_loose(dir_fd: int, leaf: str, where: str) -> str | None:
    """The first line of the loose ref `leaf`, or None when it is not a regular file."""
    try:
        fd = paths.open_regular(dir_fd, leaf, where)
    except Refusal:
        return None
    try:
        data = os.read(fd, MAX_LOOSE + 1)
    finally:
        os.close(fd)
    return data.split(b"\n", 1)[0].decode("utf-8", "replace").strip()


# --- changing -------------------------------------------------------------------------------


def update_ref(
    git_dir_fd: int,
    name: str,
    old_oid: str | None,
    new_oid: str | None,
    *,
    committer: bytes,
    message: bytes,
    owner: tuple[int, int],
    now: int | None = None,
) -> RefOutcome:
    """Move the ref `name` from `old_oid` (None: it must not exist) to `new_oid` (None:
    delete it), as `git update-ref` would (module docstring; docs/git.md "Refs").

    `committer` is `Name <email>` for the reflog line, stamped `now` (seconds, default
    the clock) in UTC; `message` has its whitespace collapsed. Files and directories
    made are given `owner` (when the daemon is root). A current value equal to
    `new_oid` is `unchanged` whatever `old_oid` said. Raises InvalidParams for an id
    that is not 40 hex, and the fs refusals (`symlink_refused`, ...) for a symlink among
    the directories on the way. Costs a lock, a read of the ref (and a pass over
    `packed-refs` when it is not loose), an object lookup, a reflog append and two
    fsyncs; a deletion rewrites `packed-refs` when the ref is there.
    """
    if not valid_ref_name(name):
        return RefOutcome("invalid_name", None)
    for oid in (old_oid, new_oid):
        if oid is not None and not valid_oid(oid):
            raise InvalidParams("an object id is 40 lowercase hex digits")
    parts = name.split("/")
    if new_oid is not None and not _has(git_dir_fd, new_oid):
        # Before any directory is made for it (checked again under the lock).
        return RefOutcome("missing_object", _current_unlocked(git_dir_fd, parts))
    try:
        if new_oid is not None:
            ref_dir = fsops.make_dirs(git_dir_fd, parts[:-1], name, lambda _: (DIR_MODE, owner))
        else:
            ref_dir = paths.open_dir(git_dir_fd, parts[:-1], name)
    except NotADirectory:
        return RefOutcome("name_conflict", None)
    except NotFound:
        return _delete_packed_only(git_dir_fd, name, old_oid, committer, message, owner, now)
    try:
        return _locked_update(
            git_dir_fd, ref_dir, name, old_oid, new_oid, committer, message, owner, now
        )
    finally:
        os.close(ref_dir)


def _locked_update(
    git_dir_fd: int,
    ref_dir: int,
    name: str,
    old_oid: str | None,
    new_oid: str | None,
    committer: bytes,
    message: bytes,
    owner: tuple[int, int],
    now: int | None,
) -> RefOutcome:
    leaf = name.rsplit("/", 1)[1]
    lock = leaf + ".lock"
    try:
        lock_fd = fsops.create_exclusive(ref_dir, lock, mode=FILE_MODE)
    except FileExistsError:
        return RefOutcome("locked", None)
    renamed = False
    try:
        st = paths.lstat_at(ref_dir, leaf)
        loose = st is not None
        if st is not None and not stat.S_ISREG(st.st_mode):
            return RefOutcome("name_conflict", None)
        if loose:
            current = _read_loose(ref_dir, leaf, name)
            if current is None or not valid_oid(current):
                return RefOutcome("name_conflict", None)  # a symbolic ref, or not a ref
            packed_conflict = False
        else:
            current, packed_conflict = packed_lookup(git_dir_fd, name)
        if packed_conflict and new_oid is not None:
            return RefOutcome("name_conflict", None)
        if current == new_oid:
            return RefOutcome("unchanged", current)
        if current != old_oid:
            return RefOutcome("host_changed", current)
        if new_oid is not None and not _has(git_dir_fd, new_oid):
            return RefOutcome("missing_object", current)
        if new_oid is None:
            packed = packed_lookup(git_dir_fd, name)[0] is not None
            if packed and not _rewrite_packed(git_dir_fd, name):
                return RefOutcome("locked", current)
            _append_log(git_dir_fd, name, current, None, committer, message, owner, now)
            if loose:
                fsops.unlink_quietly(ref_dir, leaf)
                os.fsync(ref_dir)
            return RefOutcome("applied", None)
        _append_log(git_dir_fd, name, current, new_oid, committer, message, owner, now)
        fsops.fill(lock_fd, f"{new_oid}\n".encode(), mode=FILE_MODE, owner=owner)
        fsops.rename_into(ref_dir, lock, leaf)
        renamed = True
        return RefOutcome("applied", new_oid)
    finally:
        os.close(lock_fd)
        if not renamed:
            fsops.unlink_quietly(ref_dir, lock)


def _current_unlocked(git_dir_fd: int, parts: list[str]) -> str | None:
    """What the ref holds now, read without its lock (for a refusal's `current` only)."""
    try:
        with paths.opened_dir(git_dir_fd, parts[:-1], "/".join(parts)) as ref_dir:
            loose = _read_loose(ref_dir, parts[-1], "/".join(parts))
    except Refusal:
        loose = None
    if loose is not None:
        return loose if valid_oid(loose) else None
    return packed_lookup(git_dir_fd, "/".join(parts))[0]


def _delete_packed_only(
    git_dir_fd: int,
    name: str,
    old_oid: str | None,
    committer: bytes,
    message: bytes,
    owner: tuple[int, int],
    now: int | None,
) -> RefOutcome:
    """A deletion whose loose directory does not exist: the ref is packed or absent."""
    current, _ = packed_lookup(git_dir_fd, name)
    if current is None:
        return RefOutcome("unchanged", None)
    if current != old_oid:
        return RefOutcome("host_changed", current)
    if not _rewrite_packed(git_dir_fd, name):
        return RefOutcome("locked", current)
    _append_log(git_dir_fd, name, current, None, committer, message, owner, now)
    return RefOutcome("applied", None)


def packed_lookup(git_dir_fd: int, name: str) -> tuple[str | None, bool]:
    """(the id `packed-refs` gives `name` or None, whether a packed ref's name is a
    directory of `name` or has `name` as one). Streams the file."""
    value: str | None = None
    conflict = False
    for other, oid in _packed(git_dir_fd):
        if other == name:
            value = oid
        elif other.startswith(name + "/") or name.startswith(other + "/"):
            conflict = True
    return value, conflict


def _has(git_dir_fd: int, oid: str) -> bool:
    try:
        objects = paths.open_dir(git_dir_fd, ("objects",), "objects")
    except Refusal:
        return False
    try:
        with ObjectStore(objects) as store:
            return store.has(oid)
    finally:
        os.close(objects)


def _rewrite_packed(git_dir_fd: int, name: str) -> bool:
    """Rewrite `packed-refs` without `name` (and its peeled line) under
    `packed-refs.lock`, keeping the file's owner and mode; False when it is locked."""
    try:
        lock_fd = fsops.create_exclusive(git_dir_fd, "packed-refs.lock", mode=FILE_MODE)
    except FileExistsError:
        return False
    renamed = False
    try:
        src = paths.open_regular(git_dir_fd, "packed-refs", "packed-refs")
        with os.fdopen(src, "rb") as file:
            st = os.fstat(file.fileno())
            with os.fdopen(os.dup(lock_fd), "wb") as out:
                dropping = False
                while line := file.readline(MAX_LINE + 1):
                    if line[:1] == b"^" and dropping:
                        continue
                    dropping = line.rstrip(b"\n").partition(b" ")[2] == name.encode()
                    if not dropping:
                        out.write(line)
        fsops.fill(lock_fd, b"", mode=stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))
        fsops.rename_into(git_dir_fd, "packed-refs.lock", "packed-refs")
        renamed = True
        return True
    finally:
        os.close(lock_fd)
        if not renamed:
            fsops.unlink_quietly(git_dir_fd, "packed-refs.lock")


def reflog_line(
    old_oid: str | None, new_oid: str | None, committer: bytes, when: int, message: bytes
) -> bytes:
    """One reflog line as git writes it: `<old> <new> <committer> <when> +0000\\t<msg>\\n`.
    Pure; newlines and runs of whitespace in `committer` and `message` become one space."""
    who = b" ".join(committer.replace(b"\0", b" ").split())
    text = b" ".join(message.replace(b"\0", b" ").split())[:MAX_MESSAGE]
    ids = f"{old_oid or ZERO_OID} {new_oid or ZERO_OID} ".encode()
    return ids + who + f" {when} +0000\t".encode() + text + b"\n"


def _append_log(
    git_dir_fd: int,
    name: str,
    old_oid: str | None,
    new_oid: str | None,
    committer: bytes,
    message: bytes,
    owner: tuple[int, int],
    now: int | None,
) -> None:
    """Append the line to `logs/<name>`, made (with its directories) when missing."""
    parts = ["logs", *name.split("/")]
    line = reflog_line(
        old_oid, new_oid, committer, int(time.time()) if now is None else now, message
    )
    log_dir = fsops.make_dirs(git_dir_fd, parts[:-1], "logs/" + name, lambda _: (DIR_MODE, owner))
    try:
        try:
            fd = fsops.create_exclusive(log_dir, parts[-1], mode=FILE_MODE)
            if os.geteuid() == 0:
                os.fchown(fd, *owner)
            os.fchmod(fd, FILE_MODE)
        except FileExistsError:
            fd = paths.open_regular(log_dir, parts[-1], "logs/" + name, os.O_WRONLY | os.O_APPEND)
        try:
            os.lseek(fd, 0, os.SEEK_END)
            fsops.write_all(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.close(log_dir)
