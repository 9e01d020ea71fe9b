"""Which refs the sandbox itself wrote since the last conclusion, from its git layer's
upper dir (docs/working-layer.md, "The git layer").

The sandbox's view of a ref differs from the checkout's for two reasons: the sandbox
moved it, or its view is stale — a `packed-refs` it rewrote once (`git branch -d`,
`git pack-refs`) shadows the checkout's, so when the host packs its refs later (`git
gc`), refs the sandbox never touched vanish or show old values in its view. Read as
moves, those would be applied back onto the checkout (a deletion of a branch the host
just packed). So a ref is the sandbox's change only with evidence written in the upper
dir since the last conclusion (`Evidence`): its loose file or whiteout there, an
opaque directory above it (`rm -r` then made again), or a `packed-refs` the sandbox
rewrote then (and no loose file of it anywhere). Pure but for `read`, which walks the
upper's `refs/` (bounded, no symlink followed). Blocking.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from substrate.errors import Refusal
from substrate.fs import fsops, paths

#: The walk of the upper's `refs/` reads at most this many entries (past it, nothing
#: more counts as evidence: those refs wait for a later conclusion).
MAX_ENTRIES = 100_000
_OPAQUE = "trusted.overlay.opaque"


@dataclass
class Evidence:
    """What the sandbox wrote under its `.git` since a time."""

    loose: set[str] = field(default_factory=set)  # ref names: loose file or whiteout
    opaque: list[str] = field(default_factory=list)  # "refs/heads/x/": re-made dirs
    packed: bool = False  # its `packed-refs` was rewritten

    def any(self) -> bool:
        """Did the sandbox write any evidence at all (then a conclusion moves its
        baseline's `concluded_ns` past it)?"""
        return bool(self.loose or self.opaque or self.packed)

    def covers(self, name: str, loose_in_checkout: bool) -> bool:
        """Is a change of ref `name` the sandbox's? `loose_in_checkout`: the checkout has
        a loose file for it (then only the sandbox's own loose file or whiteout, or an
        opaque directory above, can have hidden or changed it)."""
        if name in self.loose or any(name.startswith(p) for p in self.opaque):
            return True
        return self.packed and not loose_in_checkout


def read(upper: str, since_ns: int) -> Evidence:
    """The evidence in the git layer's upper dir `upper` written at or after `since_ns`
    (ctime). Costs a stat per entry of the upper's `refs/` (what the sandbox wrote)."""
    found = Evidence()
    try:
        top = os.open(upper, fsops.DIR_FLAGS)
    except FileNotFoundError:
        return found
    try:
        try:
            st = os.lstat("packed-refs", dir_fd=top)
            found.packed = not stat.S_ISDIR(st.st_mode) and st.st_ctime_ns >= since_ns
        except FileNotFoundError:
            pass
        try:
            refs = os.open("refs", fsops.DIR_FLAGS, dir_fd=top)
        except OSError:
            return found
    finally:
        os.close(top)
    seen = 0
    stack = [(refs, "refs/")]
    try:
        while stack and seen < MAX_ENTRIES:
            fd, prefix = stack.pop()
            try:
                with os.scandir(fd) as listing:
                    for entry in listing:
                        seen += 1
                        est = entry.stat(follow_symlinks=False)
                        name = prefix + entry.name
                        if not stat.S_ISDIR(est.st_mode):
                            if est.st_ctime_ns >= since_ns:
                                found.loose.add(name)
                            continue
                        try:
                            sub = os.open(entry.name, fsops.DIR_FLAGS, dir_fd=fd)
                        except OSError:
                            continue
                        if est.st_ctime_ns >= since_ns and _opaque(sub):
                            found.opaque.append(name + "/")
                        stack.append((sub, name + "/"))
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return found


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, _OPAQUE) == b"y"
    except OSError:
        return False


def loose_in(git_fd: int, name: str) -> bool:
    """Does the git dir `git_fd` hold a loose file for ref `name` (no symlink followed)?"""
    *parents, leaf = name.split("/")
    try:
        fd = paths.open_dir(git_fd, parents, name)
    except Refusal:  # missing, or a symlink on the way: never followed
        return False
    try:
        return stat.S_ISREG(os.lstat(leaf, dir_fd=fd).st_mode)
    except OSError:
        return False
    finally:
        os.close(fd)
