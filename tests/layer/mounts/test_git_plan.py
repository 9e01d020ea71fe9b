"""The git layer's part of the mount plan and its check (pure; docs/working-layer.md,
"The git layer")."""

from __future__ import annotations

import pytest

from substrate.errors import ConfinementUnmet
from substrate.layer.mounts.git_plan import GitLayerPart, options
from substrate.layer.mounts.mountinfo import Mount, parse_mountinfo
from substrate.layer.mounts.plan import plan, verify

_ROOT = "1 0 8:1 / / rw - ext4 /dev/sda1 rw"
_BASE = "20 1 8:1 /s/layers/sb/merged /s/layers/sb/merged rw shared:5 - ext4 /dev/sda1 rw"
_MERGED = (
    "21 20 0:50 / /s/layers/sb/merged rw shared:6 - overlay overlay "
    "rw,lowerdir=/proc/self/fd/7,upperdir=/s/layers/sb/upper/2,workdir=/s/layers/sb/work/2"
)
_GIT_LAYER = (
    "22 21 0:51 / /s/layers/sb/merged/.git rw shared:7 - overlay overlay "
    "rw,lowerdir=/proc/self/fd/9,upperdir=/s/gitlayers/c/upper,workdir=/s/gitlayers/c/work,"
    "index=off,redirect_dir=off,metacopy=off"
)
_READONLY_GIT = (
    "22 21 0:51 / /s/layers/sb/merged/.git rw shared:7 - overlay overlay "
    "ro,lowerdir=/proc/self/fd/9:/s/layers/sb/empty"
)
PART = GitLayerPart(
    identity=(1, 2), target="", upper="/s/gitlayers/c/upper", work="/s/gitlayers/c/work"
)


def _mounts(*lines: str) -> list[Mount]:
    return parse_mountinfo("\n".join(lines))


def test_the_git_layer_replaces_the_read_only_git_and_keeps_the_others() -> None:
    p = plan("/s", "sb", 2, [(".git", (1, 2)), ("sub/.git", (1, 5))], (), PART)
    assert [part.rel for part in p.readonly] == ["sub/.git"]
    assert p.git is not None and p.git.target == "/s/layers/sb/merged/.git"
    assert options(p.git, "/proc/self/fd/9") == (
        "lowerdir=/proc/self/fd/9,upperdir=/s/gitlayers/c/upper,workdir=/s/gitlayers/c/work,"
        "index=off,metacopy=off,redirect_dir=off"
    )


def test_verify_wants_the_git_layer_on_git() -> None:
    p = plan("/s", "sb", 2, [(".git", (1, 2))], (), PART)
    verify(p, _mounts(_ROOT, _BASE, _MERGED, _GIT_LAYER))
    for lines in (
        (_ROOT, _BASE, _MERGED),  # missing
        (_ROOT, _BASE, _MERGED, _READONLY_GIT),  # the read-only one instead
        (_ROOT, _BASE, _MERGED, _GIT_LAYER.replace("c/upper", "d/upper")),  # another's
    ):
        with pytest.raises(ConfinementUnmet):
            verify(p, _mounts(*lines))
    # Without a git layer, the read-only `.git` is what must be there.
    with pytest.raises(ConfinementUnmet):
        verify(plan("/s", "sb", 2, [(".git", (1, 2))]), _mounts(_ROOT, _BASE, _MERGED, _GIT_LAYER))


def test_a_git_layer_dir_overlayfs_cannot_name_is_refused() -> None:
    bad = GitLayerPart(identity=(1, 2), target="", upper="/s/g,x/upper", work="/s/g/work")
    with pytest.raises(ConfinementUnmet):
        plan("/s", "sb", 0, [], (), bad)
