"""Persistent homes: the sandbox user's `$HOME` of each workspace, kept under the state dir
(docs/protocol.md §12, docs/environments.md).

Theory of operation. Homes belong to a *checkout*, keyed by its identity
(`substrate.workspace.identity`: its root's st_dev, st_ino and birth time or file
handle) the way its remembered policy is, so releasing and adopting the same checkout
again, or restarting the daemon, finds the same homes, and a new directory that got a
removed one's inode finds none of them. Inside there is one home per uid that sandboxes
of that checkout run as (normally one: the checkout's owner) and per *secret set* of the
profiles run there, owned by that uid:gid, mode 0700:

    <state_dir>/homes/                 0700, the daemon's
      <st_dev>-<st_ino>-<birth>/       0700, the daemon's: one checkout
        <uid>/                         0700, uid:gid: profiles naming no secret
        <uid>-<secret set digest>/     0700, uid:gid: profiles naming exactly that set

A profile holding secrets never shares a home with one that holds other secrets or
none: what the home holds is code its tools run (`usercustomize.py`, `~/.bashrc`, a
venv) and data they leave, so a shared home would let a profile without a secret plant
code that runs with it, or read what a secret profile left (docs/environments.md).

Only the daemon's user can rename or replace a checkout's directory or a home (their
parents are its own, 0700), so the path the engine binds is the directory `prepare`
made; the sandbox's `home_identity` fact proves it from the container's side. What the
sandbox user puts inside (symlinks included) is never followed: `usage` walks and
`remove` removes from held directory fds with `O_NOFOLLOW` (`fsops.remove_tree`).

A home is never removed implicitly: not with its sandboxes, not at idle collection,
not at a plain `workspace.release` (`keep_home` defaults to true), not when its checkout
is gone (an orphan is listed by `orphans`, never handed to another checkout). Only
`workspace.release {keep_home: false}` removes a checkout's homes.

Blocking (directory work): callers use worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from substrate.fs import fsops
from substrate.fs.state import StatePaths
from substrate.schema.workspace import HomeUsage
from substrate.workspace.home_quota import HomeQuota

#: `usage` reads at most this many entries; past it the sizes are a lower bound
#: (`truncated`). One lstat per entry: about 70 ms per 10,000 entries measured here
#: (2 CPUs, shared, warm cache), so at most about 0.7 s. A venv with substrate's dev
#: dependencies is about 6,300 entries.
MAX_USAGE_ENTRIES = 100_000
#: ... and goes at most this deep (a deeper tree counts as truncated, not walked).
MAX_USAGE_DEPTH = 256


@dataclass(frozen=True)
class Home:
    """A prepared home: the host path to bind, the directory's (st_dev, st_ino) (the
    `home_identity` fact), and which one it is: its checkout's key and its name there
    (`home_name`)."""

    source: str
    identity: tuple[int, int]
    checkout: str
    name: str


def home_key(checkout: str) -> str:
    """The directory name of a checkout's homes, from its identity key (`CheckoutId.key`,
    or an older release's `st_dev:st_ino`): `:` becomes `-`."""
    return checkout.replace(":", "-")


def secret_set(secrets: Mapping[str, str]) -> str | None:
    """The digest naming a profile's secret set (its sorted (ENV, secret name) pairs), or
    None for a profile naming none. 128 bits of SHA-256, hex."""
    if not secrets:
        return None
    pairs = sorted(secrets.items())
    return hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()[:32]


def home_name(uid: int, secrets: str | None) -> str:
    """The name of one home inside a checkout's directory."""
    return str(uid) if secrets is None else f"{uid}-{secrets}"


class Homes:
    """The persistent homes under one state dir."""

    def __init__(self, state_dir: Path, quota_bytes: int = 0) -> None:
        self.directory = StatePaths(Path(state_dir)).homes
        # prepare and remove of the same checkout never interleave.
        self._lock = threading.Lock()
        #: `home_quota_bytes` of each home, checked before each command (0: no bound).
        self.quota = HomeQuota(self.usage, quota_bytes)

    def _open_top(self, *, create: bool) -> int | None:
        parent = os.open(self.directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create and _lstat(parent, self.directory.name) is None:
                with contextlib.suppress(FileExistsError):
                    fsops.make_dir(parent, self.directory.name, mode=0o700)
            try:
                return os.open(self.directory.name, fsops.DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                return None
        finally:
            os.close(parent)

    def prepare(self, checkout: str, uid: int, gid: int, secrets: str | None = None) -> Home:
        """The home of `checkout` (its identity key) for sandboxes running as uid:gid
        with secret set `secrets` (`secret_set`; None: no secret), made if missing
        (0700, owned by uid:gid when the daemon is root). An existing one is used as it
        is. Raises OSError (a symlink or non-directory at a name: `ELOOP`/`ENOTDIR`).
        Costs a few opens and fstats; a mkdir, chown and chmod per directory made."""
        key = home_key(checkout)
        name = home_name(uid, secrets)
        with self._lock:
            top = self._open_top(create=True)
            assert top is not None
            try:
                checkout_fd = _open_or_make(top, key, 0o700, None)
                try:
                    home = _open_or_make(checkout_fd, name, 0o700, (uid, gid))
                    st = os.fstat(home)
                    os.close(home)
                finally:
                    os.close(checkout_fd)
            finally:
                os.close(top)
        return Home(
            source=str(self.directory / key / name),
            identity=(st.st_dev, st.st_ino),
            checkout=checkout,
            name=name,
        )

    def usage(
        self, checkout: str, home: str | None = None, *, max_entries: int = MAX_USAGE_ENTRIES
    ) -> HomeUsage | None:
        """Bytes and files in the checkout's homes, all of them (None: it has none yet),
        or in its one home named `home` (`home_name`). A bounded walk
        from held fds that never follows a symlink (a symlink counts as a file of its own
        size); a hard-linked file counts once. `truncated` past `max_entries` (at most
        `MAX_USAGE_ENTRIES`) entries or `MAX_USAGE_DEPTH` levels: the figures are then a
        lower bound."""
        top = self._open_top(create=False)
        if top is None:
            return None
        try:
            try:
                fd = os.open(home_key(checkout), fsops.DIR_FLAGS, dir_fd=top)
                if home is not None:
                    try:
                        fd_home = os.open(home, fsops.DIR_FLAGS, dir_fd=fd)
                    finally:
                        os.close(fd)
                    fd = fd_home
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return None
                raise
        finally:
            os.close(top)
        return _walk(fd, min(max_entries, MAX_USAGE_ENTRIES))

    def remove(self, checkout: str) -> bool:
        """Remove the checkout's homes (every uid and secret set) with everything in
        them; False when there were
        none. Never follows a symlink inside (`fsops.remove_tree`). Raises OSError when
        something appears in a directory while it is removed (ENOTEMPTY) or a directory
        moves (ESTALE), what was removed staying removed; and ENOTDIR, touching nothing,
        for something other than a directory at the checkout's name."""
        key = home_key(checkout)
        with self._lock:
            top = self._open_top(create=False)
            if top is None:
                return False
            try:
                st = _lstat(top, key)
                if st is None:
                    return False
                if not stat.S_ISDIR(st.st_mode):
                    # Never ours (a directory is all `prepare` makes): left alone.
                    raise OSError(errno.ENOTDIR, "not a directory", key)
                fsops.remove_tree(top, key)
                os.fsync(top)
                return True
            finally:
                os.close(top)

    def claim_legacy(self, legacy: str, checkout: str) -> str:
        """Give checkout `checkout` the homes an older release kept under `legacy` (its
        `st_dev:st_ino`), by renaming their directory: the caller has proved it is the
        same checkout as far as it can be (the path recorded with it matches too).
        Returns "moved", "none" (no such homes) or "kept" (the checkout has homes of its
        own already: the legacy ones stay where they are, an orphan, never merged).
        Costs two lstats and a rename."""
        old, new = home_key(legacy), home_key(checkout)
        with self._lock:
            top = self._open_top(create=False)
            if top is None:
                return "none"
            try:
                st = _lstat(top, old)
                if st is None or not stat.S_ISDIR(st.st_mode):
                    return "none"
                if _lstat(top, new) is not None:
                    return "kept"
                os.rename(old, new, src_dir_fd=top, dst_dir_fd=top)
                os.fsync(top)
                return "moved"
            finally:
                os.close(top)


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open_or_make(dir_fd: int, name: str, mode: int, owner: fsops.Owner | None) -> int:
    if _lstat(dir_fd, name) is None:
        with contextlib.suppress(FileExistsError):
            fsops.make_dir(dir_fd, name, mode=mode, owner=owner)
    return os.open(name, fsops.DIR_FLAGS, dir_fd=dir_fd)


class _Counts:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.size = self.files = self.seen = 0
        self.truncated = False
        self.linked: set[tuple[int, int]] = set()

    def scan(self, dir_fd: int) -> list[str]:
        """Count the entries of `dir_fd` that are not directories; return the directories."""
        subdirs: list[str] = []
        with os.scandir(dir_fd) as it:
            for entry in it:
                self.seen += 1
                if self.seen > self.max_entries:
                    self.truncated = True
                    break
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
                    continue
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in self.linked:
                        continue
                    self.linked.add((st.st_dev, st.st_ino))
                self.files += 1
                self.size += st.st_size
        return subdirs


def _walk(root_fd: int, max_entries: int) -> HomeUsage:
    """Sizes beneath `root_fd` (closed here): one fd per level, never one per pending
    directory; each directory is entered by name with `O_NOFOLLOW`."""
    counts = _Counts(max_entries)
    # Each level: (its fd, its subdirectories still to visit).
    stack: list[tuple[int, list[str]]] = [(root_fd, [])]
    try:
        stack[-1][1].extend(counts.scan(root_fd))
        while stack and not counts.truncated:
            fd, todo = stack[-1]
            if not todo:
                os.close(fd)
                stack.pop()
                continue
            name = todo.pop()
            if len(stack) >= MAX_USAGE_DEPTH:
                counts.truncated = True
                break
            try:
                child = os.open(name, fsops.DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue  # gone or swapped for a symlink meanwhile: never followed
            stack.append((child, []))
            stack[-1][1].extend(counts.scan(child))
    finally:
        for fd, _ in stack:
            os.close(fd)
    return HomeUsage(bytes=counts.size, files=counts.files, truncated=counts.truncated)
