"""What an overlay's upper layer means for the checkout: pure, no file system.

The scan (`substrate.layer.changes.scan`) records what stands at a path in each layer
as a `Seen`; `classify` names the steps that turn the checkout (the lower layer) into
what the command left there, or why the path is blocked. `ordered` puts a change set in
the one order it is applied in. The results are `ChangeSet`s of the wire's `Change` and
`Blocked` (substrate.schema.changes; docs/working-layer.md).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from substrate.schema.changes import Blocked as Blocked  # the wire shapes; re-exported
from substrate.schema.changes import Change as Change
from substrate.schema.changes import Op as Op

#: What stands at a path in one layer. `whiteout`: an overlay whiteout (a 0:0 character
#: device, or a file with the `trusted.overlay.whiteout` xattr) in the upper layer.
SeenKind = Literal["file", "dir", "symlink", "whiteout", "fifo", "socket", "device", "other"]


class Seen(msgspec.Struct, frozen=True, kw_only=True):
    """What stands at a path in one layer: metadata and a file's digest, never bytes."""

    kind: SeenKind
    mode: int = 0  # permission bits (S_IMODE)
    nlink: int = 1
    size: int = 0
    sha256: str | None = None  # a regular file's content; a symlink's target (`links.digest`)
    target: bytes | None = None  # a symlink's target, verbatim
    #: An upper directory whose lower contents are hidden (`trusted.overlay.opaque` = y).
    opaque: bool = False
    #: An overlay feature the scan cannot interpret (`metacopy`, `redirect`): blocked.
    overlay_feature: str | None = None


class ChangeSet(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one upper layer changes, in apply order, and what it will not apply."""

    changes: tuple[Change, ...] = ()
    blocked: tuple[Blocked, ...] = ()


#: A step `classify` asks for. `delete_tree`: the lower directory and everything beneath
#: it go (the scan lists them); `delete_absent`: an opaque directory hides its lower
#: entries, so those the upper does not hold go.
Step = Literal[
    "create", "replace", "delete", "chmod", "mkdir", "delete_tree", "delete_absent", "descend"
]


class Verdict(msgspec.Struct, frozen=True):
    """`classify`'s answer: the steps in order, or the reason the path is blocked."""

    steps: tuple[Step, ...] = ()
    blocked: str | None = None


_NONE = Verdict()


def _unlink_lower(lower: Seen) -> Step | None:
    """The step removing what the lower layer holds, None when it cannot be removed."""
    if lower.kind in ("file", "symlink"):
        return "delete"
    if lower.kind == "dir":
        return "delete_tree"
    return None


def classify(upper: Seen, lower: Seen | None) -> Verdict:
    """The steps making the checkout's `lower` (None: absent) what the upper layer holds.

    A whiteout deletes; a file creates, replaces, or only changes the mode (an overlay
    copy-up of unchanged bytes is nothing); a symlink creates or, with another target,
    replaces; a directory is made or, opaque, hides what the lower held. A file of
    several links (hard links made in the sandbox) is a file like any other: each name
    is applied as a separate file. Blocked, never applied: FIFOs, sockets, devices,
    overlay metadata the scan cannot interpret, and any step that would remove a lower
    special file (substrate writes regular files, directories and symlinks only). Which
    symlinks the profile lets through is the scan's (`links.refusal`).
    """
    if upper.overlay_feature is not None:
        return Verdict(blocked=f"overlay_{upper.overlay_feature}")
    match upper.kind:
        case "whiteout":
            if lower is None:
                return _NONE
            step = _unlink_lower(lower)
            if step is None:
                return Verdict(blocked=f"deletes_{lower.kind}")
            return Verdict((step,))
        case "file":
            if lower is None:
                return Verdict(("create",))
            if lower.kind == "file":
                if lower.sha256 != upper.sha256:
                    return Verdict(("replace",))
                return Verdict(("chmod",)) if lower.mode != upper.mode else _NONE
            step = _unlink_lower(lower)
            if step is None:
                return Verdict(blocked=f"replaces_{lower.kind}")
            return Verdict((step, "create"))
        case "symlink":
            if lower is None:
                return Verdict(("create",))
            if lower.kind == "symlink":
                return _NONE if lower.sha256 == upper.sha256 else Verdict(("replace",))
            step = _unlink_lower(lower)
            if step is None:
                return Verdict(blocked=f"replaces_{lower.kind}")
            return Verdict((step, "create"))
        case "dir":
            if lower is None:
                return Verdict(("mkdir", "descend"))
            if lower.kind == "dir":
                steps: list[Step] = []
                if lower.mode != upper.mode:
                    steps.append("chmod")
                if upper.opaque:
                    steps.append("delete_absent")
                steps.append("descend")
                return Verdict(tuple(steps))
            step = _unlink_lower(lower)
            if step is None:
                return Verdict(blocked=f"replaces_{lower.kind}")
            return Verdict((step, "mkdir", "descend"))
        case kind:
            return Verdict(blocked=kind)


def _depth(change: Change) -> int:
    return change.path.count("/")


def ordered(changes: list[Change]) -> tuple[Change, ...]:
    """The apply order: deletes deepest first (a directory after what it held), then new
    directories shallowest first, then files and symlinks by path, then directory mode
    changes deepest first (a directory made read-only last). Deterministic for a given
    set."""
    deletes = sorted(
        (c for c in changes if c.op == "delete"), key=lambda c: (-_depth(c), c.path, c.kind)
    )
    mkdirs = sorted((c for c in changes if c.op == "mkdir"), key=lambda c: (_depth(c), c.path))
    files = sorted(
        (c for c in changes if c.op in ("create", "replace", "chmod") and c.kind != "dir"),
        key=lambda c: c.path,
    )
    dir_modes = sorted(
        (c for c in changes if c.op == "chmod" and c.kind == "dir"),
        key=lambda c: (-_depth(c), c.path),
    )
    return (*deletes, *mkdirs, *files, *dir_modes)
