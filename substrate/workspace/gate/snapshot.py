"""The snapshot walk: every denied path of a workspace, what stands there, its kept bytes.

`walk` visits the workspace through directory fds, never following a symlink and not
descending into what the sandbox mounted read-only. It is iterative and holds one
directory fd at a time whatever the depth or width of the tree: it lists a directory
once, remembers its subdirectories by name, descends into each with `O_NOFOLLOW` and
comes back up through `fsops.climb` (the parent checked to be the one it left). Only
denied entries — a gated glob matches them, they are a `.git` (at any depth, as for
guarded writes), or a directory's git content denies them (`gate.gitdirs`, fed the names
each directory holds) — and what lies beneath a denied directory are stat'ed and handed
to a visitor: `take_snapshot`'s reads and keeps a file's bytes (skipping a file
whose stat did not move since the previous snapshot), `scan_after`'s only hashes a file
whose stat moved.

Costs: one `scandir` per directory and one regex match and a set lookup per entry (all
gated globs are one alternation; an entry's ancestors were matched on the way down),
plus two opens and two fstats per directory; reads only of the denied files whose stat
moved.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from substrate.errors import Refusal
from substrate.fs import fsops, paths
from substrate.matching.glob_regex import MAX_SOURCE_CHARS, GlobRegex, compile_sources
from substrate.workspace.gate.attribution import Handle, handle_at
from substrate.workspace.gate.diff import Node
from substrate.workspace.gate.gitdirs import GitContent
from substrate.workspace.gate.keep import MAX_KEPT_FILE, MAX_KEPT_TOTAL, Keep
from substrate.workspace.policy import GIT_NAME, CompiledPolicy, glob_source
from substrate.workspace.registry import Workspace

#: A file changed this close before its snapshot may change again within the same ctime
#: tick: it is re-read whatever its stat says.
RACY_NS = 2_000_000_000

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Matcher:
    """The gated globs as one regex, matched against each path once (its ancestors were
    matched as the walk entered them, and a match there covers everything beneath)."""

    regex: GlobRegex | None

    @classmethod
    def of(cls, patterns: Iterable[str]) -> Matcher:
        # Two policy lists, each within the cap on its own (`compile_policy` checked).
        sources = [glob_source(p) for p in patterns]
        return cls(compile_sources(sources, limit=2 * MAX_SOURCE_CHARS + 1))

    def denied(self, rel: str) -> bool:
        return self.regex is not None and self.regex.match(rel)


_matchers: dict[tuple[str, ...], Matcher] = {}


def gated_globs(policy: CompiledPolicy) -> tuple[str, ...]:
    """The globs the gate enforces on sandboxed code: `write_deny` and `require_approval`."""
    return (*policy.policy.write_deny, *policy.policy.require_approval)


def matcher_for(policy: CompiledPolicy) -> Matcher:
    key = gated_globs(policy)
    found = _matchers.get(key)
    if found is None:
        found = _matchers[key] = Matcher.of(key)
    return found


def _identity_at(ws: Workspace, rel: str) -> os.stat_result | None:
    """lstat of `rel` beneath the root, or None when it cannot be reached."""
    try:
        *parents, name = paths.split_relpath(rel)
        with paths.opened_dir(ws.root_fd, parents, rel) as parent:
            return paths.lstat_at(parent, name)
    except Refusal:
        return None


def readonly_identities(ws: Workspace) -> dict[str, tuple[int, int]]:
    """The policy's read-only dirs that exist (as the sandbox mounts them). The caller
    holds `ws.use()`."""
    found: dict[str, tuple[int, int]] = {}
    for rel in ws.policy.readonly_dirs():
        st = _identity_at(ws, rel)
        if st is not None and (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            found[rel] = (st.st_dev, st.st_ino)
    return found


@dataclass
class Snapshot:
    """The denied paths of a workspace at one moment, plus the skipped read-only dirs."""

    nodes: dict[str, Node]
    readonly: dict[str, tuple[int, int]]  # rel → (dev, ino) not descended into
    taken_ns: int  # wall clock as the walk began
    #: File handles of the directories holding denied paths and of denied directories
    #: (rel, "" for the root): how the attribution names them, kept for when they go.
    handles: dict[str, Handle] = field(default_factory=dict)
    #: The git directories by content the walk met (`gate.gitdirs`).
    git: GitContent = field(default_factory=GitContent)


def racy(node: Node, taken_ns: int) -> bool:
    """Changed so close to the snapshot that a same-tick rewrite would keep its ctime:
    its stat is not trusted to prove it unchanged (git's "racily clean" rule)."""
    return taken_ns - node.ctime_ns <= RACY_NS


def node_of(st: os.stat_result) -> Node:
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


#: `visit(parent_fd, name, rel, node)`: what to record for a denied path.
Visit = Callable[[int, str, str, Node], Node]


@dataclass
class _Dir:
    """A directory of the walk: its path prefix, whether a match above covers it, its
    identity (to check the way back up) and the subdirectories still to walk."""

    prefix: str
    inherited: bool
    identity: fsops.Identity
    pending: list[tuple[str, bool]]


def walk(
    root_fd: int,
    matcher: Matcher,
    readonly: Mapping[str, tuple[int, int]],
    visit: Visit,
    git: GitContent | None = None,
) -> dict[str, Node]:
    """Every denied path beneath `root_fd` → `visit(parent_fd, name, rel, node)`.

    Denied: what a gated glob matches, every `.git` at any depth (`policy.is_git_path`,
    as for guarded writes) and what `git` (default: a baseline's) denies for a
    directory's git content; with everything beneath each. Never follows a symlink;
    does not descend into a `readonly` dir that is still the same inode; holds one
    directory fd at a time (see the module docstring). Raises OSError when a directory
    cannot be listed or was moved while walked.
    """
    git = GitContent() if git is None else git
    out: dict[str, Node] = {}
    cur = os.open(".", fsops.DIR_FLAGS, dir_fd=root_fd)
    try:
        stack = [_Dir("", False, fsops.identity(cur), [])]
        stack[-1].pending = _list(cur, stack[-1], matcher, readonly, visit, git, out)
        while stack:
            top = stack[-1]
            if top.pending:
                name, denied = top.pending.pop()
                try:
                    child = os.open(name, fsops.DIR_FLAGS, dir_fd=cur)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        continue  # swapped for a symlink or gone meanwhile: never followed
                    raise
                os.close(cur)
                cur = child
                below = _Dir(top.prefix + name + "/", denied, fsops.identity(cur), [])
                stack.append(below)
                below.pending = _list(cur, below, matcher, readonly, visit, git, out)
                continue
            stack.pop()
            if stack:
                up = fsops.climb(cur, stack[-1].identity)
                os.close(cur)
                cur = up
    finally:
        os.close(cur)
    return out


def _list(
    dir_fd: int,
    here: _Dir,
    matcher: Matcher,
    readonly: Mapping[str, tuple[int, int]],
    visit: Visit,
    git: GitContent,
    out: dict[str, Node],
) -> list[tuple[str, bool]]:
    """Visit the denied entries of one directory; return its subdirectories to walk."""
    pending: list[tuple[str, bool]] = []
    with os.scandir(dir_fd) as it:
        entries = list(it)
    # Beneath a denied directory everything is denied already: no need to ask.
    by_content = (
        frozenset() if here.inherited else git.entries(here.prefix[:-1], [e.name for e in entries])
    )
    for entry in entries:
        rel = here.prefix + entry.name
        denied = (
            here.inherited
            or by_content is None
            or entry.name in by_content
            or entry.name == GIT_NAME
            or matcher.denied(rel)
        )
        is_dir = entry.is_dir(follow_symlinks=False)
        if denied:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            out[rel] = visit(dir_fd, entry.name, rel, node_of(st))
        if not is_dir:
            continue
        if rel in readonly:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == readonly[rel]:
                continue  # mounted read-only in the sandbox
        pending.append((entry.name, denied))
    return pending


def _read_file(parent_fd: int, name: str, limit: int) -> tuple[os.stat_result, str, bytes | None]:
    """(fstat, sha256, bytes or None when over `limit`) of the regular file `name`: one
    pass that hashes everything and keeps at most `limit` bytes."""
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
    return msgspec.structs.replace(node, sha256=digest, target=target)


def take_snapshot(
    ws: Workspace,
    keep: Keep,
    previous: Snapshot | None,
    readonly: Mapping[str, tuple[int, int]] | None = None,
) -> Snapshot:
    """`before`: the denied paths now, files hashed and kept (reusing an unchanged
    file's digest from `previous`). `readonly`: what the sandbox mounted read-only
    (default: the policy's read-only dirs as they are now). Blocking; the caller holds
    `ws.use()`."""
    now = time.time_ns()
    readonly = dict(readonly_identities(ws) if readonly is None else readonly)
    old = previous.nodes if previous is not None else {}
    kept_total = 0
    handles: dict[str, Handle] = {}

    def remember(parent_fd: int, name: str, rel: str, node: Node) -> None:
        parent = rel.rpartition("/")[0]
        if parent not in handles and (found := handle_at(parent_fd)) is not None:
            handles[parent] = found
        if node.kind == "dir" and (found := handle_at(parent_fd, name)) is not None:
            handles[rel] = found

    def visit(parent_fd: int, name: str, rel: str, node: Node) -> Node:
        nonlocal kept_total
        remember(parent_fd, name, rel, node)
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
            and not racy(prior, previous.taken_ns)
            and (not prior.kept or keep.has(prior.sha256))
        ):
            if prior.kept:
                kept_total += prior.size
            return prior
        limit = min(MAX_KEPT_FILE, MAX_KEPT_TOTAL - kept_total)
        st, sha, data = _read_file(parent_fd, name, max(limit, 0))
        fresh = msgspec.structs.replace(node_of(st), sha256=sha, kept=data is not None)
        if data is not None:
            keep.put(sha, data)
            kept_total += len(data)
        return fresh

    git = GitContent()
    nodes = walk(ws.root_fd, matcher_for(ws.policy), readonly, visit, git)
    keep.collect({n.sha256 for n in nodes.values() if n.kept and n.sha256})
    return Snapshot(nodes, readonly, now, handles, git)


def scan_after(ws: Workspace, before: Snapshot) -> tuple[dict[str, Node], GitContent]:
    """`after`'s walk: stat every denied path; hash a file only where its stat moved
    (or was racy at the snapshot). Also returns what it found of git directories by
    content, against the baseline's (a directory that became one: its new pieces are
    the denied paths). Blocking; the caller holds `ws.use()`."""
    old = before.nodes

    def visit(parent_fd: int, name: str, rel: str, node: Node) -> Node:
        if node.kind == "symlink":
            return _symlink_node(parent_fd, name, node)
        if node.kind != "file":
            return node
        prior = old.get(rel)
        if prior is not None and prior.same_stat(node) and not racy(prior, before.taken_ns):
            return prior
        try:
            st, sha, _ = _read_file(parent_fd, name, -1)
        except FileNotFoundError:
            return node
        return msgspec.structs.replace(node_of(st), sha256=sha)

    git = GitContent(before.git.pieces)
    return walk(ws.root_fd, matcher_for(ws.policy), before.readonly, visit, git), git
