"""The git layers: each checkout's writable `.git` for its layer sandboxes, kept under
the state dir (docs/working-layer.md, "The git layer").

Theory of operation. A checkout whose `.git` is a directory has one git layer, keyed by
its identity (`Workspace.checkout`, as its persistent homes are), so release and
adoption of the same checkout, idle collection and daemon restarts find it again:

    <state_dir>/gitlayers/                  0700, the daemon's
      <checkout key>/                       0700, the daemon's
        upper/                              the git overlay's upper dir: every write the
                                            sandbox made under `.git` (HEAD, index,
                                            config, hooks, logs, objects, refs)
        work/                               its overlayfs work dir
        baseline                            msgpack {ref: oid}: the refs the sandbox's
                                            view showed at the last conclusion

The git overlay (`git_plan`) is mounted by each generation of one layer sandbox of the
checkout at a time (`claim`): an upper dir under two live overlays at once is undefined
in overlayfs, so a second layer sandbox of the same checkout meanwhile gets the
read-only `.git` of old (`held`, journaled). A `.git` that is a file (a worktree's or
submodule's `gitdir:` pointer), a symlink or anything but a directory gets no git layer:
it stays read-only, nothing it names is followed (`gitfile`, `not_a_directory`).

A git layer is never removed implicitly: only `workspace.release {keep_git: false}`
(`remove`). Nothing in it is ever applied to the checkout but new objects and ref moves,
at a conclusion (`substrate.layer.changes.git_refs`).

Blocking (directory work): callers use worker threads.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass
from typing import Literal

from substrate.fs import fsops
from substrate.fs.state import ENTRIES
from substrate.git.refs import read_refs
from substrate.layer import git_baseline
from substrate.layer.mounts.git_plan import GIT_REL, GitLayerPart

#: Why a layer sandbox got no git layer (its `.git` stays read-only), or `mounted`.
GitOutcome = Literal["mounted", "absent", "gitfile", "not_a_directory", "held"]
#: `usage` reads at most this many entries (a lower bound past it).
MAX_USAGE_ENTRIES = 200_000


@dataclass(frozen=True)
class GitClaim:
    """A checkout's git layer held by one sandbox's layer (its `part` is mounted)."""

    key: str
    part: GitLayerPart
    dir: str  # <state>/gitlayers/<key>


def git_key(checkout: str) -> str:
    """The directory name of a checkout's git layer (`:` of its identity key becomes `-`)."""
    return checkout.replace(":", "-").replace("/", "-")


class GitLayers:
    """The git layers under `<state_dir>/gitlayers`."""

    def __init__(self, state_dir: str) -> None:
        self.top = f"{state_dir.rstrip('/')}/{ENTRIES.gitlayers.name}"
        self._lock = threading.Lock()
        self._held: set[str] = set()

    def claim(self, checkout: str, root_fd: int) -> tuple[GitOutcome, GitClaim | None]:
        """The checkout's git layer for a new layer sandbox, made if missing (its
        baseline: the checkout's refs now), held until `release`. No claim (the outcome
        says why) when `.git` beneath `root_fd` is not a directory or another sandbox
        holds the layer. Raises OSError when the state dir's entries are not
        directories. Costs a few mkdirs, and a read of the refs when it is made."""
        try:
            st = os.lstat(GIT_REL, dir_fd=root_fd)
        except FileNotFoundError:
            return "absent", None
        if stat.S_ISREG(st.st_mode):
            return "gitfile", None
        if not stat.S_ISDIR(st.st_mode):
            return "not_a_directory", None
        key = git_key(checkout)
        with self._lock:
            if key in self._held:
                return "held", None
            layer_dir = f"{self.top}/{key}"
            for path in (self.top, layer_dir):
                _mkdir(path, 0o700)
            upper, work = f"{layer_dir}/upper", f"{layer_dir}/work"
            made = _mkdir(upper, stat.S_IMODE(st.st_mode))
            _mkdir(work, 0o700)
            # The merged `.git` shows the upper dir's owner and mode: the checkout's.
            os.chown(upper, st.st_uid, st.st_gid)
            if made:
                os.chmod(upper, stat.S_IMODE(st.st_mode))
            if made or not git_baseline.exists(layer_dir):
                git_fd = os.open(GIT_REL, fsops.DIR_FLAGS, dir_fd=root_fd)
                try:
                    refs = read_refs(git_fd, max_refs=git_baseline.MAX_REFS)
                    now = git_baseline.stamp(layer_dir)
                    made_at = git_baseline.Baseline(refs=refs, concluded_ns=now)
                    git_baseline.save(layer_dir, made_at)
                finally:
                    os.close(git_fd)
            self._held.add(key)
        part = GitLayerPart(identity=(st.st_dev, st.st_ino), target="", upper=upper, work=work)
        return "mounted", GitClaim(key=key, part=part, dir=layer_dir)

    def release(self, part: GitLayerPart | None) -> None:
        """The sandbox whose layer mounted `part` is gone: another may claim it."""
        if part is None:
            return
        with self._lock:
            self._held.discard(part.upper.rsplit("/", 2)[-2])

    def dir_of(self, part: GitLayerPart) -> str:
        """The git layer's directory (where its baseline is) from its mounted part."""
        return part.upper.rsplit("/", 1)[0]

    def usage(self, checkout: str) -> int | None:
        """Bytes (st_size) in the checkout's git layer; None: it has none. A bounded walk
        that never follows a symlink (a lower bound past `MAX_USAGE_ENTRIES`)."""
        try:
            fd = os.open(f"{self.top}/{git_key(checkout)}", fsops.DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None
            raise
        return _size(fd)

    def remove(self, checkout: str) -> bool:
        """Remove the checkout's git layer whole; False when it had none. Refuses (OSError
        EBUSY) while a sandbox holds it. Never follows a symlink inside."""
        key = git_key(checkout)
        with self._lock:
            if key in self._held:
                raise OSError(errno.EBUSY, "the git layer is mounted", key)
            try:
                top = os.open(self.top, fsops.DIR_FLAGS)
            except FileNotFoundError:
                return False
            try:
                fsops.remove_tree(top, key)
            except FileNotFoundError:
                return False
            finally:
                os.close(top)
            return True


def _mkdir(path: str, mode: int) -> bool:
    """Make `path` (True) or find it a real directory (False); OSError otherwise."""
    try:
        os.mkdir(path, mode)
        return True
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OSError(errno.ENOTDIR, "not a directory", path) from None
        return False


def _size(root_fd: int) -> int:
    """Bytes beneath `root_fd` (closed here), at most `MAX_USAGE_ENTRIES` entries read."""
    total = seen = 0
    stack = [root_fd]
    try:
        while stack and seen < MAX_USAGE_ENTRIES:
            fd = stack.pop()
            try:
                with os.scandir(fd) as it:
                    for entry in it:
                        seen += 1
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            try:
                                stack.append(os.open(entry.name, fsops.DIR_FLAGS, dir_fd=fd))
                            except OSError:
                                continue
                        else:
                            total += st.st_size
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return total
