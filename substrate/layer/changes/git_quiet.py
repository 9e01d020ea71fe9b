"""Did anything a git layer's conclusion reads change since the last one? (docs/
working-layer.md, "The git layer").

Most commands never touch `.git`: their git conclusion (`git_refs.conclude`) reads the
refs three times and finds nothing. `quiet` tells that in advance from the git layer's
upper dir alone — a few lstats on the state dir's own disk — given what the last
conclusion left (`git_baseline.Settled`); the caller adds that the checkout did not
change (its watch). Every write the sandbox makes under `.git` after a conclusion's
mark (`git_baseline.mark`) stamps what it touched, or the directory it changed, at or
after that mark: so an upper dir whose `refs` tree is all older, whose `packed-refs`
and `refs` are there as they were, and whose `objects/` fan-out directories did not
change since the last import holds no ref move, no evidence and nothing to import.
Blocking (lstats): the caller bounds what it reads on the event loop.
"""

from __future__ import annotations

import os
import re
import stat

from substrate.fs import fsops
from substrate.layer import git_baseline

#: A fan-out directory of an object store (as `git_refs.import_from` takes them).
FANOUT = re.compile(r"[0-9a-f]{2}")


def settled_state(upper: str, seen: int, baseline: git_baseline.Baseline) -> git_baseline.Settled:
    """What a conclusion that left `baseline` (having begun at the checkout watch's
    change count `seen`) leaves for `quiet`: the baseline's times and which of `refs`
    and `packed-refs` the upper dir `upper` holds now. Two lstats."""
    top = os.open(upper, fsops.DIR_FLAGS)
    try:
        return git_baseline.Settled(
            seen=seen,
            concluded_ns=baseline.concluded_ns,
            imported_ns=baseline.imported_ns,
            refs=_lstat(top, "refs") is not None,
            packed=_lstat(top, "packed-refs") is not None,
        )
    finally:
        os.close(top)


def quiet(upper: str, settled: git_baseline.Settled, budget: int) -> bool | None:
    """Has nothing a conclusion reads in the git layer's upper dir `upper` changed since
    the conclusion that left `settled`? True when `refs` and `packed-refs` are there as
    they were then, every entry beneath `refs/` is older than its `concluded_ns` (a write,
    a whiteout, a removal, a rename or an xattr after that conclusion's mark stamps
    what it touched or the directory it changed at or after it) and no fan-out
    directory of `objects/` changed since its `imported_ns` (`import_from`'s own rule).
    With the checkout's refs unchanged too (the caller's watch), the sandbox's view of
    the refs is the baseline's, no evidence was written and nothing is to import: the
    conclusion would find nothing and leave the baseline as it is (`unchanged`). None
    when more than `budget` entries would have to be read (the caller asks again with
    a bigger one, off the event loop). Never follows a symlink. Costs an lstat per
    entry of the upper's `refs/` and `objects/`."""
    since = settled.concluded_ns
    try:
        top = os.open(upper, fsops.DIR_FLAGS)
    except FileNotFoundError:
        return False
    try:
        packed = _lstat(top, "packed-refs")
        if (packed is not None) != settled.packed:
            return False
        if packed is not None and packed.st_ctime_ns >= since:
            return False
        refs = _lstat(top, "refs")
        if (refs is not None) != settled.refs:
            return False
        left = budget
        if refs is not None:
            if refs.st_ctime_ns >= since:
                return False
            if stat.S_ISDIR(refs.st_mode):
                rest = _older_than(top, "refs", since, budget)
                if rest is None or rest < 0:
                    return None if rest is None else False
                left = rest
        return _objects_quiet(top, settled.imported_ns, left)
    finally:
        os.close(top)


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None


def _older_than(parent: int, name: str, since_ns: int, budget: int) -> int | None:
    """The budget left after checking that every entry beneath directory `name` of
    `parent` has a ctime before `since_ns`: -1 when one does not (or cannot be read),
    None past the budget."""
    try:
        first = os.open(name, fsops.DIR_FLAGS, dir_fd=parent)
    except OSError:
        return -1
    stack = [first]
    try:
        while stack:
            fd = stack.pop()
            try:
                with os.scandir(fd) as listing:
                    for entry in listing:
                        budget -= 1
                        if budget < 0:
                            return None
                        est = entry.stat(follow_symlinks=False)
                        if est.st_ctime_ns >= since_ns:
                            return -1
                        if stat.S_ISDIR(est.st_mode):
                            try:
                                stack.append(os.open(entry.name, fsops.DIR_FLAGS, dir_fd=fd))
                            except OSError:
                                return -1
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return budget


def _objects_quiet(top: int, since_ns: int, budget: int) -> bool | None:
    """No fan-out (or `pack`) directory of the upper's `objects/` changed since
    `since_ns` (then `import_from` finds nothing to import)? None past `budget` entries."""
    try:
        source = os.open("objects", fsops.DIR_FLAGS, dir_fd=top)
    except FileNotFoundError:
        return True  # nothing to import, as `import_from` finds
    except OSError:
        return False
    try:
        with os.scandir(source) as listing:
            for entry in listing:
                budget -= 1
                if budget < 0:
                    return None
                if (FANOUT.fullmatch(entry.name) or entry.name == "pack") and entry.stat(
                    follow_symlinks=False
                ).st_mtime_ns >= since_ns:
                    return False
    finally:
        os.close(source)
    return True
