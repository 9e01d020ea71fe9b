"""Symlinks in a change set: what a link's target means, and which ones are applied.

A symlink the command made is a change of `kind: "symlink"` (docs/working-layer.md,
"Symlinks"). Its "content" is its target, as git takes it: `digest` is the SHA-256 of
the target's bytes (the change's `new_sha256`, or `base_sha256` for the link it
replaces or deletes) and its length is the change's `size`. The target is kept
verbatim; substrate never follows or resolves a link, only reads it (`read_target`:
`readlinkat` through the held directory fd).

`escapes` resolves the target lexically from the link's directory: an absolute target
always leaves the checkout, a relative one leaves it when its `..` components climb
past the root. The test is lexical, as the profile's `inside` promises: a target that
descends through another link (`a/..` where `a` is itself a link) is judged by its
text, not by what the kernel would resolve it to.

`refusal` says why a link is not applied, or None: the profile's `symlinks` mode
(`none`; `inside` and an escaping target: `symlink`), a target longer than
`MAX_TARGET_BYTES` (`target_too_long`), one that is not UTF-8 (`target_not_utf8`: the
wire carries text) or that holds a control or bidi character (`target_control_character`:
it would mislead `ls -l`, a reviewer, a line-based tool). Pure apart from `read_target`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from substrate.schema.changes import Change
from substrate.schema.profile import SymlinkMode
from substrate.workspace.discoverable import name_problem
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Landing, LinkChange, Writer, link_digest

#: The longest target a link applied may have. Linux takes up to 4,095 bytes (a page
#: less its NUL); real trees' links (npm's `.bin`, pnpm's store, a venv's interpreter)
#: are a few hundred at most. Past it: `target_too_long`.
MAX_TARGET_BYTES = 1024
#: The blocked reason of a link the profile's `symlinks` refuses.
SYMLINK = "symlink"
TARGET_TOO_LONG = "target_too_long"
TARGET_NOT_UTF8 = "target_not_utf8"
TARGET_CONTROL_CHARACTER = "target_control_character"


#: A link's digest: the SHA-256 of its target's bytes (`writes.link_digest`). Pure.
digest = link_digest


def read_target(dir_fd: int, name: str) -> bytes:
    """The target of the link `name` in `dir_fd`, verbatim (never followed). Raises
    OSError (EINVAL: not a link; ENOENT: gone). One `readlinkat`, at most 4 KiB."""
    return os.readlink(os.fsencode(name), dir_fd=dir_fd)


def escapes(path: str, target: str) -> bool:
    """Does the link at workspace-relative `path` point outside the checkout, its
    `target` resolved lexically from the link's directory? An absolute target does;
    `..` past the root does. Pure; linear in the target."""
    if target.startswith("/"):
        return True
    depth = path.count("/")  # the directories the link sits beneath
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        else:
            depth += 1
    return False


def decode(target: bytes) -> str | None:
    """The target as text, None when it is not UTF-8. Pure."""
    try:
        return target.decode("utf-8")
    except UnicodeDecodeError:
        return None


def refusal(path: str, target: bytes, mode: SymlinkMode) -> str | None:
    """Why the link at `path` to `target` is not applied under `mode` (a blocked
    reason), or None: it is. Pure."""
    if mode == "none":
        return SYMLINK
    if len(target) > MAX_TARGET_BYTES:
        return TARGET_TOO_LONG
    text = decode(target)
    if text is None:
        return TARGET_NOT_UTF8
    if name_problem(text) is not None:
        return TARGET_CONTROL_CHARACTER
    if mode == "inside" and escapes(path, text):
        return SYMLINK
    return None


def apply_links(
    writer: Writer, ws: Workspace, changes: Sequence[Change], actor: str, dry_run: bool
) -> list[Landing]:
    """The symlink changes of one apply phase (all deletes, or all creates and
    replaces), through the guarded path (`writes.batch_links`); their landings, in
    order."""
    made = [
        LinkChange(c.path, c.base_sha256, c.target, bool(c.escapes))
        for c in changes
        if c.kind == "symlink"
    ]
    return writer.batch.apply_links(ws, made, actor, dry_run=dry_run)
