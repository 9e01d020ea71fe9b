"""The write gate for sandboxed code: file-level `write_deny` globs (SPEC §5, issue 4).

Theory of operation. Directories denied whole (`.git/**`) and every `.git` at any depth
are bound read-only into the sandbox (`substrate.sandbox.containers`); everything else a deny
glob names (`*.lock`, `.env`, `secrets/*.pem`) is checked around each command. So is
every `require_approval` glob: sandboxed code cannot ask an operator for an approval, so
until such changes can wait as pending plans (the working layer, SPEC §11) they are
reverted like denied ones and reported with `rule: "require_approval"`.

- `before` walks the workspace once through directory fds (`os.scandir`, `O_NOFOLLOW`,
  never following a symlink, not descending into the read-only-mounted dirs) and records
  every path a deny glob matches: kind, mode, owner, size, times, inode, and for a file
  its SHA-256 with its bytes kept aside in a private store under the state dir (never in
  the journal), so it can be put back. Only matching files are read; a file whose
  inode, size, mtime and ctime are those of the previous snapshot is not read again.
- `after` walks again, compares (`classify`, pure) and reverts each offending change:
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

Costs: two walks of the tree (about 10 ms per 10,000 entries each; see bench/gate.py)
plus reading the denied files whose stat changed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import secrets
import stat
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import trio

from substrate.errors import Refusal
from substrate.schema.proc import PolicyBlocked
from substrate.store.journal import Journal
from substrate.workspace import paths
from substrate.workspace.policy import CompiledPolicy, compile_glob
from substrate.workspace.registry import TEMP_PREFIX, Workspace

log = logging.getLogger("substrate.workspace.gate")

Change = Literal["create", "modify", "delete", "chmod"]
Rule = Literal["write_deny", "require_approval"]

#: Denied files larger than this are hashed but not kept: a change to one is reported
#: with `reverted: false` (a creation is still removed).
MAX_KEPT_FILE = 64 << 20
#: Total bytes kept per workspace snapshot; past it, further files are only hashed.
MAX_KEPT_TOTAL = 512 << 20
#: A file changed this close before its snapshot may change again within the same ctime
#: tick: it is re-read whatever its stat says.
RACY_NS = 2_000_000_000

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


# --- pure parts -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Node:
    """What stood at a denied path: never a file's bytes, only their digest."""

    kind: paths.Kind
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
    (or deleted) directory is folded into it (its revert covers everything beneath)."""
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
    bytes that are not UTF-8 as surrogates (`os.fsdecode`); they become `\\xNN`. Pure."""
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class Matcher:
    """The gated globs as one regex, matched against each path once (its ancestors were
    matched as the walk entered them, and a match there covers everything beneath)."""

    regex: re.Pattern[str] | None

    @classmethod
    def of(cls, patterns: Iterable[str]) -> Matcher:
        parts = [compile_glob(p).pattern for p in patterns]
        if not parts:
            return cls(None)
        return cls(re.compile("|".join(f"(?:{p})" for p in parts), re.DOTALL))

    def denied(self, rel: str) -> bool:
        return self.regex is not None and self.regex.match(rel) is not None


_matchers: dict[tuple[str, ...], Matcher] = {}

#: `before`'s answer when read-only mounts already enforce every deny glob.
_NOTHING_TO_GATE = object()


def gated_globs(policy: CompiledPolicy) -> tuple[str, ...]:
    """The globs the gate enforces on sandboxed code: `write_deny` and `require_approval`."""
    return (*policy.policy.write_deny, *policy.policy.require_approval)


def _mounts_cover_policy(ws: Workspace, readonly: Mapping[str, tuple[int, int]]) -> bool:
    """True when every gated glob is a `write_deny` whole directory that the sandbox has
    mounted read-only and that is still the mounted inode (the default policy, `.git/**`)
    so there is nothing file-level to snapshot. A denied directory that does not exist
    (or is not the one mounted) could be created by the command: then this is False, as
    it is for any `require_approval` glob."""
    if ws.policy.policy.require_approval:
        return False
    for pattern in ws.policy.policy.write_deny:
        stem = pattern[:-3] if pattern.endswith("/**") else pattern.rstrip("/")
        if stem == pattern or stem.lstrip("/") not in readonly:
            return False
    for rel, identity in readonly.items():
        try:
            *parents, name = paths.split_relpath(rel)
            with paths.opened_dir(ws.root_fd, parents, rel) as parent:
                st = paths.lstat_at(parent, name)
        except Refusal:
            return False
        if st is None or (st.st_dev, st.st_ino) != identity:
            return False
    return True


def matcher_for(policy: CompiledPolicy) -> Matcher:
    key = gated_globs(policy)
    found = _matchers.get(key)
    if found is None:
        found = _matchers[key] = Matcher.of(key)
    return found


# --- walking (blocking) -------------------------------------------------------------------------


@dataclass
class Snapshot:
    """The denied paths of a workspace at one moment, plus the skipped read-only dirs."""

    nodes: dict[str, Node]
    readonly: dict[str, tuple[int, int]]  # rel → (dev, ino) not descended into
    taken_ns: int  # wall clock as the walk began


def _racy(node: Node, taken_ns: int) -> bool:
    """Changed so close to the snapshot that a same-tick rewrite would keep its ctime:
    its stat is not trusted to prove it unchanged (git's "racily clean" rule)."""
    return taken_ns - node.ctime_ns <= RACY_NS


def _node(st: os.stat_result) -> Node:
    return Node(
        kind=paths.kind_of(st.st_mode),
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        ctime_ns=st.st_ctime_ns,
        dev=st.st_dev,
        ino=st.st_ino,
    )


def walk(
    root_fd: int,
    matcher: Matcher,
    readonly: Mapping[str, tuple[int, int]],
    visit: Callable[[int, str, str, Node], Node],
) -> dict[str, Node]:
    """Every denied path beneath `root_fd` → `visit(parent_fd, name, rel, node)`.

    Never follows a symlink; does not descend into a `readonly` dir that is still the
    same inode. Costs one `scandir` per directory and one regex match per entry; only
    denied entries are stat'ed.
    """
    out: dict[str, Node] = {}
    top = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
    stack: list[tuple[int, str, bool]] = [(top, "", False)]
    try:
        while stack:
            dir_fd, prefix, inherited = stack.pop()
            try:
                with os.scandir(dir_fd) as it:
                    entries = list(it)
                for entry in entries:
                    rel = prefix + entry.name
                    denied = inherited or matcher.denied(rel)
                    is_dir = entry.is_dir(follow_symlinks=False)
                    if denied:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        is_dir = stat.S_ISDIR(st.st_mode)
                        out[rel] = visit(dir_fd, entry.name, rel, _node(st))
                    if not is_dir:
                        continue
                    if rel in readonly:
                        st = entry.stat(follow_symlinks=False)
                        if (st.st_dev, st.st_ino) == readonly[rel]:
                            continue  # mounted read-only in the sandbox
                    try:
                        child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
                    except OSError:
                        continue  # swapped for a symlink or gone meanwhile: never followed
                    stack.append((child, rel + "/", denied))
            finally:
                os.close(dir_fd)
    finally:
        for dir_fd, _, _ in stack:
            os.close(dir_fd)
    return out


def readonly_identities(ws: Workspace) -> dict[str, tuple[int, int]]:
    """The policy's read-only dirs that exist (as containers.py mounts them)."""
    found: dict[str, tuple[int, int]] = {}
    for rel in ws.policy.readonly_dirs():
        try:
            *parents, name = paths.split_relpath(rel)
            with paths.opened_dir(ws.root_fd, parents, rel) as parent:
                st = paths.lstat_at(parent, name)
        except Refusal:
            continue
        if st is not None and (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            found[rel] = (st.st_dev, st.st_ino)
    return found


def _read_file(parent_fd: int, name: str, limit: int) -> tuple[os.stat_result, str, bytes | None]:
    """(fstat, sha256, bytes or None when over `limit`) of the regular file `name`."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(name)  # swapped since the scan: treat as gone
        digest = hashlib.sha256()
        chunks: list[bytes] | None = [] if st.st_size <= limit else None
        offset = 0
        while True:
            block = os.pread(fd, _CHUNK, offset)
            if not block:
                break
            digest.update(block)
            offset += len(block)
            if chunks is not None:
                chunks.append(block)
                if offset > limit:
                    chunks = None  # it grew past the limit while read
        return st, digest.hexdigest(), None if chunks is None else b"".join(chunks)
    finally:
        os.close(fd)


def _symlink_node(parent_fd: int, name: str, node: Node) -> Node:
    target = os.readlink(name, dir_fd=parent_fd)
    digest = hashlib.sha256(os.fsencode(target)).hexdigest()
    return _replace(node, sha256=digest, target=target)


def _replace(node: Node, **changes: Any) -> Node:
    values = {f: getattr(node, f) for f in Node.__slots__}
    values.update(changes)
    return Node(**values)


# --- the private store of kept bytes ---------------------------------------------------------


class Keep:
    """Content-addressed bytes of denied files for one workspace (0700 dir, 0600 files)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)

    def has(self, sha: str) -> bool:
        return (self.root / sha).is_file()

    def put(self, sha: str, data: bytes) -> None:
        if self.has(sha):
            return
        temp = self.root / f".tmp-{secrets.token_hex(6)}"
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, self.root / sha)

    def get(self, sha: str) -> bytes:
        data = (self.root / sha).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha:
            raise OSError(f"kept copy {sha[:12]} is damaged")
        return data

    def collect(self, keep: set[str]) -> None:
        """Remove every stored blob not in `keep` (and stray temp files)."""
        for name in os.listdir(self.root):
            if name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / name)


def take_snapshot(
    ws: Workspace,
    keep: Keep,
    previous: Snapshot | None,
    readonly: Mapping[str, tuple[int, int]] | None = None,
) -> Snapshot:
    """`before`: the denied paths now, files hashed and kept (reusing an unchanged
    file's digest from `previous`). `readonly`: what the sandbox mounted read-only
    (default: the policy's read-only dirs as they are now). Blocking."""
    now = time.time_ns()
    readonly = dict(readonly_identities(ws) if readonly is None else readonly)
    old = previous.nodes if previous is not None else {}
    kept_total = 0

    def visit(parent_fd: int, name: str, rel: str, node: Node) -> Node:
        nonlocal kept_total
        if node.kind == "symlink":
            return _symlink_node(parent_fd, name, node)
        if node.kind != "file":
            return node
        prior = old.get(rel)
        if (
            prior is not None
            and prior.sha256 is not None
            and previous is not None
            and prior.same_stat(node)
            and not _racy(prior, previous.taken_ns)
            and (not prior.kept or keep.has(prior.sha256))
        ):
            if prior.kept:
                kept_total += prior.size
            return prior
        limit = min(MAX_KEPT_FILE, MAX_KEPT_TOTAL - kept_total)
        st, sha, data = _read_file(parent_fd, name, max(limit, 0))
        fresh = _replace(_node(st), sha256=sha, kept=data is not None)
        if data is not None:
            keep.put(sha, data)
            kept_total += len(data)
        return fresh

    nodes = walk(ws.root_fd, matcher_for(ws.policy), readonly, visit)
    keep.collect({n.sha256 for n in nodes.values() if n.kept and n.sha256})
    return Snapshot(nodes, readonly, now)


def scan_after(ws: Workspace, before: Snapshot) -> dict[str, Node]:
    """`after`'s walk: stat every denied path; hash a file only where its stat moved
    (or was racy at the snapshot). Blocking."""
    old = before.nodes

    def visit(parent_fd: int, name: str, rel: str, node: Node) -> Node:
        if node.kind == "symlink":
            return _symlink_node(parent_fd, name, node)
        if node.kind != "file":
            return node
        prior = old.get(rel)
        if prior is not None and prior.same_stat(node) and not _racy(prior, before.taken_ns):
            return prior
        try:
            st, sha, _ = _read_file(parent_fd, name, -1)
        except FileNotFoundError:
            return node
        return _replace(_node(st), sha256=sha)

    return walk(ws.root_fd, matcher_for(ws.policy), before.readonly, visit)


# --- reverting (blocking; under the workspace's commit lock) ----------------------------------


def revert(
    ws: Workspace,
    changes: list[tuple[str, Change]],
    before: Mapping[str, Node],
    now: Mapping[str, Node],
    keep: Keep,
) -> list[tuple[bool, str | None]]:
    """Undo each change; (reverted, reason when not) per change, in order.

    Never follows a symlink: parents are opened beneath the root with `O_NOFOLLOW`, names
    are used relative to them, a created symlink is unlinked, not resolved.
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
                _restore(ws, rel, before[rel], keep, before)
                if before[rel].kind == "dir":
                    for sub in sorted(
                        (r for r in before if r.startswith(rel + "/")),
                        key=lambda r: (r.count("/"), r),
                    ):
                        if classify(before[sub], now.get(sub)) is not None:
                            _restore(ws, sub, before[sub], keep, before)
            out.append((True, None))
        except _NotReverted as exc:
            out.append((False, str(exc)))
        except (OSError, Refusal, RecursionError) as exc:
            out.append((False, _why(exc)))
    return out


class _NotReverted(Exception):
    """A change that is detected but cannot be undone; the message says why."""


def _why(exc: BaseException) -> str:
    if isinstance(exc, Refusal):
        return exc.name
    if isinstance(exc, OSError) and exc.errno is not None:
        return os.strerror(exc.errno)
    return type(exc).__name__


def _parent(ws: Workspace, rel: str, before: Mapping[str, Node] | None = None) -> int:
    """The parent dir of `rel` beneath the root (made, with its old owner and mode when
    `before` knows them, when `before` is given and it is missing)."""
    parts = tuple(rel.split("/")[:-1])
    try:
        return paths.open_dir(ws.root_fd, parts, ws.provenance(rel))
    except Refusal as exc:
        if before is None or exc.name != "not_found":
            raise
    fd = os.open(".", _DIR_FLAGS, dir_fd=ws.root_fd)
    try:
        for i, name in enumerate(parts):
            if paths.lstat_at(fd, name) is None:
                old = before.get("/".join(parts[: i + 1]))
                _mkdir(fd, name, old, ws)
            nxt = paths.open_dir(fd, (name,), ws.provenance(rel))
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mkdir(parent_fd: int, name: str, old: Node | None, ws: Workspace) -> None:
    mode = old.mode if old is not None and old.kind == "dir" else 0o755
    os.mkdir(name, 0o700, dir_fd=parent_fd)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.geteuid() == 0:
            os.fchown(fd, *((old.uid, old.gid) if old else (ws.owner_uid, ws.owner_gid)))
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


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
            _rmtree(parent, name)
        else:
            os.unlink(name, dir_fd=parent)
    finally:
        os.close(parent)


def _rmtree(parent_fd: int, name: str) -> None:
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _rmtree(fd, entry.name)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _chmod(ws: Workspace, rel: str, old: Node, new: Node) -> None:
    parent = _parent(ws, rel)
    try:
        name = rel.rsplit("/", 1)[-1]
        flags = _DIR_FLAGS if old.kind == "dir" else os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(name, flags | os.O_CLOEXEC, dir_fd=parent)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (new.dev, new.ino):
                raise _NotReverted("replaced while being restored")
            os.fchmod(fd, old.mode)
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def _restore(ws: Workspace, rel: str, old: Node, keep: Keep, before: Mapping[str, Node]) -> None:
    """Put `old` back at `rel` (a file from the kept bytes, a symlink, a directory)."""
    if old.kind == "file" and not (old.kept and old.sha256):
        raise _NotReverted(f"larger than the {MAX_KEPT_FILE} bytes kept: not restored")
    if old.kind == "other":
        raise _NotReverted("not a file, directory or symlink: not restored")
    parent = _parent(ws, rel, before)
    try:
        name = rel.rsplit("/", 1)[-1]
        if old.kind == "dir":
            current = paths.lstat_at(parent, name)
            if current is not None and not stat.S_ISDIR(current.st_mode):
                os.unlink(name, dir_fd=parent)
                current = None
            if current is None:
                _mkdir(parent, name, old, ws)
            return
        temp = TEMP_PREFIX + secrets.token_hex(8)
        if old.kind == "symlink":
            assert old.target is not None
            os.symlink(old.target, temp, dir_fd=parent)
            if os.geteuid() == 0:
                os.chown(temp, old.uid, old.gid, dir_fd=parent, follow_symlinks=False)
        else:
            assert old.sha256 is not None
            _write_temp(parent, temp, keep.get(old.sha256), old)
        try:
            current = paths.lstat_at(parent, name)
            if current is not None and stat.S_ISDIR(current.st_mode):
                _rmtree(parent, name)  # a directory stands where the file was
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=parent)
            raise
        os.fsync(parent)
    finally:
        os.close(parent)


def _write_temp(parent: int, temp: str, data: bytes, old: Node) -> None:
    fd = os.open(
        temp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=parent,
    )
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if os.geteuid() == 0:
            os.fchown(fd, old.uid, old.gid)
        os.fchmod(fd, old.mode)
        os.utime(fd, ns=(old.mtime_ns, old.mtime_ns))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=parent)
        raise
    os.close(fd)


# --- the hook ---------------------------------------------------------------------------------


class _Ticket:
    """One command's hold on its workspace's baseline (dropped: the hold ends)."""

    __slots__ = ("__weakref__", "ws")

    def __init__(self, ws: str) -> None:
        self.ws = ws


@dataclass
class _WsState:
    lock: trio.Lock = field(default_factory=trio.Lock)
    baseline: Snapshot | None = None
    holders: weakref.WeakSet[_Ticket] = field(default_factory=weakref.WeakSet)
    keep: Keep | None = None


class SnapshotGate:
    """`procs.WriteGate`: snapshot before a command, revert offending changes after.

    `before` refuses nothing; an OSError while snapshotting fails the command before it
    runs (the gate fails closed). Costs: see the module docstring.
    """

    def __init__(
        self,
        state_dir: Path,
        journal: Journal,
        *,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._root = state_dir
        self._journal = journal
        self._limiter = limiter
        self._states: dict[str, _WsState] = {}

    def _state(self, ws: Workspace) -> _WsState:
        state = self._states.get(ws.id)
        if state is None:
            state = self._states[ws.id] = _WsState()
        return state

    def _keep(self, ws: Workspace, state: _WsState) -> Keep:
        if state.keep is None:
            state.keep = Keep(self._root / ws.id)
        return state.keep

    async def before(
        self, ws: Workspace, readonly: Mapping[str, tuple[int, int]] | None = None
    ) -> object:
        """Snapshot (or join the running baseline of) `ws`. `readonly`: the paths the
        command's sandbox has mounted read-only, with the identities it mounted (default:
        the policy's read-only dirs as they are now); the gate does not walk them."""

        def mounted() -> dict[str, tuple[int, int]]:
            return dict(readonly_identities(ws) if readonly is None else readonly)

        ro = await trio.to_thread.run_sync(mounted, limiter=self._limiter)
        if await trio.to_thread.run_sync(_mounts_cover_policy, ws, ro, limiter=self._limiter):
            return _NOTHING_TO_GATE
        state = self._state(ws)
        ticket = _Ticket(ws.id)
        async with state.lock:
            if state.baseline is None or not state.holders:
                # Nobody else is running here: the workspace as it is now is the baseline.
                keep = await trio.to_thread.run_sync(self._keep, ws, state, limiter=self._limiter)
                state.baseline = await trio.to_thread.run_sync(
                    take_snapshot, ws, keep, state.baseline, ro, limiter=self._limiter
                )
            state.holders.add(ticket)
        return ticket

    async def after(self, ws: Workspace, snapshot: object) -> list[PolicyBlocked]:
        if snapshot is _NOTHING_TO_GATE:
            return []
        state = self._state(ws)
        try:
            async with state.lock:
                baseline = state.baseline
                if baseline is None or state.keep is None:
                    return []
                keep = state.keep
                with trio.CancelScope(shield=True):  # a revert is never abandoned halfway
                    try:
                        return await trio.to_thread.run_sync(
                            self._check, ws, baseline, keep, limiter=self._limiter
                        )
                    except (OSError, Refusal) as exc:
                        # The command's record must still be finished: say so loudly instead.
                        log.error("write gate check of %s failed: %s", ws.root_id, _why(exc))
                        await trio.to_thread.run_sync(
                            functools.partial(
                                self._journal.append,
                                "policy.gate_failed",
                                {"reason": _why(exc)},
                                workspace=ws.id,
                            )
                        )
                        return []
        finally:
            if isinstance(snapshot, _Ticket):
                state.holders.discard(snapshot)
        return []  # unreachable: the lock's exit never swallows an exception

    def _check(self, ws: Workspace, baseline: Snapshot, keep: Keep) -> list[PolicyBlocked]:
        now = scan_after(ws, baseline)
        changes = diff(baseline.nodes, now)
        if not changes:
            return []
        blocked: list[PolicyBlocked] = []
        with ws.commit_lock:
            outcomes = revert(ws, changes, baseline.nodes, now, keep)
        for (rel, change), (reverted, reason) in zip(changes, outcomes, strict=True):
            where = ws.provenance(display_rel(rel))
            rule: Rule = "write_deny" if ws.policy.write_deny.matches(rel) else "require_approval"
            blocked.append(PolicyBlocked(path=where, change=change, reverted=reverted, rule=rule))
            data: dict[str, Any] = {
                "path": where,
                "change": change,
                "reverted": reverted,
                "rule": rule,
            }
            if reason:
                data["reason"] = reason
            old, new = baseline.nodes.get(rel), now.get(rel)
            data["before"] = old.summary() if old else None
            data["after"] = new.summary() if new else None
            self._journal.append("policy.blocked", data, workspace=ws.id)
        return blocked
