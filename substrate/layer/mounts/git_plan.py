"""The git layer's part of a working layer's mount plan (pure; docs/working-layer.md,
"The git layer").

A `workspace = "layer"` sandbox whose checkout has a `.git` *directory* gets a second
overlay on the merged view's `.git`: the checkout's `.git` (a held fd) as its only lower
dir, and the checkout's persistent git-layer dirs (`substrate.layer.mounts.git_layer`)
as its upper and work dirs. Every write the sandbox makes under `.git` lands there and
stays there across commands, generations and daemon restarts; the checkout's `.git` is
never written through it. Only new objects and ref moves leave it, at a conclusion,
through `substrate.layer.changes.git_refs`.

overlayfs allows its lower dir to change while it is not mounted when the features that
record lower-layer identities are off: so the git overlay is mounted with `index=off`,
`metacopy=off` and `redirect_dir=off` (git renames files, never directories, in its git
dir), and it is mounted afresh with each generation like the main overlay.
"""

from __future__ import annotations

import msgspec

#: The merged view's path of the git layer: only the checkout's top `.git` directory.
GIT_REL = ".git"
#: The overlay features off (see the module doc): a lower dir changed offline stays valid.
GIT_OVERLAY_FEATURES = "index=off,metacopy=off,redirect_dir=off"


class GitLayerPart(msgspec.Struct, frozen=True, kw_only=True):
    """The git layer of one sandbox's layer: where it is mounted and its dirs."""

    identity: tuple[int, int]  # (st_dev, st_ino) of the checkout's `.git`: re-checked
    target: str  # base + "/.git"
    upper: str  # the checkout's git-layer upper dir (persistent)
    work: str  # its overlayfs work dir


def options(part: GitLayerPart, lower: str) -> str:
    """The git overlay's option string, `lower` the held fd's `/proc/self/fd/<n>`."""
    return f"lowerdir={lower},upperdir={part.upper},workdir={part.work},{GIT_OVERLAY_FEATURES}"


def required(part: GitLayerPart) -> str:
    """What `plan.verify` requires at `part.target`."""
    return f"overlay git upperdir={part.upper} workdir={part.work}"


def describe(super_options: dict[str, str], fd_prefix: str) -> str | None:
    """A mount's description when it is a git overlay (an upper dir, one held-fd lower
    dir); None otherwise, for the caller's own description."""
    lower = super_options.get("lowerdir", "").split(":")
    if "upperdir" in super_options and len(lower) == 1 and lower[0].startswith(fd_prefix):
        return f"overlay git upperdir={super_options['upperdir']} workdir={super_options.get('workdir')}"
    return None
