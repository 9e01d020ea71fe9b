"""Passthrough directories of a `workspace = "layer"` profile (docs/protocol.md §11).

Checkout directories (caches, build output) bound read-write over the merged view, so writes under
them go straight to the checkout and never appear in a change set.

Three checks, at three moments:
- `check_declared` (profile load): relative POSIX paths of plain components, no `.`/`..`,
  not `.git` nor under one, none inside another, at most `MAX_PASSTHROUGH`.
- `check_policy` (sandbox creation): the workspace policy must allow writing everything
  at or under each one — writable by `may_write`, and no write-deny or require-approval
  glob that could match anything beneath it (decided per component, conservatively: an
  unanchored glob such as `*.pem` could match at any depth, so it refuses). Otherwise
  the sandbox is refused `path_denied`: a passthrough write skips the guarded path, so
  it may only cover what the guarded path would allow without asking.
- `existing` (each generation): which of them exist in the checkout now as real
  directories (no symlink on the way). A missing one is not created (substrate does not
  add to a checkout outside a change set) and not bound: writes there go to the upper
  layer like any other; once a change set put it in the checkout, the next generation
  binds it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Callable, Sequence
from typing import NoReturn

from substrate.errors import PathDenied, Refusal
from substrate.fs.paths import open_dir
from substrate.workspace.policy import CompiledPolicy, is_git_path

#: At most this many passthrough directories in one profile.
MAX_PASSTHROUGH = 16
_COMPONENT_RE = re.compile(r"[A-Za-z0-9._@+-]{1,255}")


def check_declared(paths: Sequence[str], fail: Callable[[str, str], NoReturn]) -> None:
    """Refuse (through `fail(key, why)`) a passthrough list that is not well-formed.
    Cost: quadratic in the list, at most 16 entries."""
    if len(paths) > MAX_PASSTHROUGH:
        fail("passthrough", f"at most {MAX_PASSTHROUGH} directories")
    for i, rel in enumerate(paths):
        key = f"passthrough[{i}]"
        parts = rel.split("/")
        if len(rel) > 1024 or not all(_COMPONENT_RE.fullmatch(c) for c in parts):
            fail(key, "a relative path of [A-Za-z0-9._@+-] components")
        if any(c in (".", "..") for c in parts):
            fail(key, "may not contain . or ..")
        if is_git_path(rel):
            fail(key, "may not be .git or under it")
        for j, other in enumerate(paths[:i]):
            if rel == other or rel.startswith(other + "/") or other.startswith(rel + "/"):
                fail(key, f"overlaps passthrough[{j}] {other!r}")


def check_policy(policy: CompiledPolicy, paths: Sequence[str]) -> None:
    """Refuse `path_denied` when the policy does not allow writing everything at or
    under one of `paths` without approval (module docstring). Pure."""
    for rel in paths:
        if not policy.may_write(rel) or policy.needs_approval(rel):
            raise PathDenied(f"passthrough {rel!r} is not writable under the policy", path=rel)
        for glob in (*policy.policy.write_deny, *policy.policy.require_approval):
            if _may_match_beneath(glob, rel):
                raise PathDenied(
                    f"passthrough {rel!r}: the policy glob {glob!r} may deny a path beneath it",
                    path=rel,
                )


def _may_match_beneath(glob: str, rel: str) -> bool:
    """Could `glob` (policy syntax) match `rel` or a path beneath it? Errs towards yes."""
    body = glob.rstrip("/") if glob != "/" else glob
    if "/" not in body:
        return True  # unanchored: matches a name at any depth
    pattern = body.lstrip("/").split("/")
    for i, segment in enumerate(rel.split("/")):
        if i == len(pattern):
            return True  # the glob matches a parent of rel: covered whole
        if pattern[i] == "**":
            return True
        if not fnmatch.fnmatchcase(segment, pattern[i]):
            return False
    return True  # rel consumed: what is left of the glob names rel or something beneath


def existing(root_fd: int, paths: Sequence[str]) -> list[tuple[str, tuple[int, int]]]:
    """(path, (st_dev, st_ino)) of each of `paths` that is a real directory in the
    checkout now, reached from the held root without following a symlink; a missing one,
    or one that is a symlink or not a directory, is left out. Cost: one lstat per path
    plus its parents' opens."""
    found: list[tuple[str, tuple[int, int]]] = []
    for rel in paths:
        *parents, name = rel.split("/")
        try:
            parent = open_dir(root_fd, parents, where=rel)
        except (OSError, Refusal):
            continue
        try:
            st = os.lstat(name, dir_fd=parent)
        except OSError:
            continue
        finally:
            os.close(parent)
        if stat.S_ISDIR(st.st_mode):
            found.append((rel, (st.st_dev, st.st_ino)))
    return sorted(found)
