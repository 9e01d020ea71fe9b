"""The working layer's pure mount plan and its check against the kernel's mount table
(substrate.layer.mounts.plan)."""

from __future__ import annotations

import pytest

from substrate.errors import ConfinementUnmet
from substrate.layer.mounts.mountinfo import Mount, parse_mountinfo
from substrate.layer.mounts.plan import merged_options, plan, verify

# -- the plan (pure) -----------------------------------------------------------------------


def test_plan_lays_out_one_sandbox_generation() -> None:
    p = plan("/state", "sb1", 3, [("sub/.git", (1, 3)), (".git", (1, 2))])
    assert p.layers_dir == "/state/layers"
    assert p.base == "/state/layers/sb1/merged"
    assert (p.upper, p.work) == ("/state/layers/sb1/upper/3", "/state/layers/sb1/work/3")
    assert [(r.rel, r.target, r.identity) for r in p.readonly] == [
        (".git", "/state/layers/sb1/merged/.git", (1, 2)),
        ("sub/.git", "/state/layers/sb1/merged/sub/.git", (1, 3)),
    ]
    assert p == plan("/state/", "sb1", 3, [(".git", (1, 2)), ("sub/.git", (1, 3))])


@pytest.mark.parametrize(
    ("state", "sandbox", "generation", "rel"),
    [
        ("state", "sb", 0, ".git"),
        ("/st,ate", "sb", 0, ".git"),
        ("/state", "../x", 0, ".git"),
        ("/state", "a/b", 0, ".git"),
        ("/state", "sb", -1, ".git"),
        ("/state", "sb", 0, "../.git"),
        ("/state", "sb", 0, "/.git"),
        ("/state", "sb", 0, "a//.git"),
    ],
)
def test_plan_refuses_what_it_cannot_lay_out(
    state: str, sandbox: str, generation: int, rel: str
) -> None:
    with pytest.raises(ConfinementUnmet):
        plan(state, sandbox, generation, [(rel, (1, 2))])


def _mountinfo(*lines: str) -> list[Mount]:
    return parse_mountinfo("\n".join(lines))


_ROOT = "1 0 8:1 / / rw - ext4 /dev/sda1 rw"
_BASE = "20 1 8:1 /s/layers/sb/merged /s/layers/sb/merged rw shared:5 - ext4 /dev/sda1 rw"
_MERGED = (
    "21 20 0:50 / /s/layers/sb/merged rw shared:6 - overlay overlay "
    "rw,lowerdir=/proc/self/fd/7,upperdir=/s/layers/sb/upper/2,workdir=/s/layers/sb/work/2"
)
_GIT = (
    "22 21 0:51 / /s/layers/sb/merged/.git rw shared:7 - overlay overlay "
    "ro,lowerdir=/proc/self/fd/9:/s/layers/sb/empty"
)


def test_verify_accepts_the_planned_mounts() -> None:
    p = plan("/s", "sb", 2, [(".git", (1, 2))])
    verify(p, _mountinfo(_ROOT, _BASE, _MERGED, _GIT))
    # mountinfo shows a feature only where it is not the module's default.
    off = ",index=off,metacopy=off,redirect_dir=nofollow,xino=off"
    verify(p, _mountinfo(_ROOT, _BASE, _MERGED + off, _GIT))
    assert merged_options(p, 7).endswith(off)


_NODE = (
    "23 21 8:1 /c/node_modules /s/layers/sb/merged/node_modules rw,nosuid,nodev - ext4 /dev/sda1 rw"
)


def test_verify_wants_each_passthrough_as_a_rw_nosuid_nodev_bind() -> None:
    p = plan("/s", "sb", 2, [(".git", (1, 2))], [("node_modules", (1, 3))])
    assert p.passthrough[0].staging == "/s/layers/sb/pt/0"
    verify(p, _mountinfo(_ROOT, _BASE, _MERGED, _GIT, _NODE))
    for lines in (
        (_ROOT, _BASE, _MERGED, _GIT),
        (_ROOT, _BASE, _MERGED, _GIT, _NODE.replace(" rw,", " ro,")),
        (_ROOT, _BASE, _MERGED, _GIT, _NODE.replace("node_modules rw", "other rw")),
        (_ROOT, _BASE, _MERGED, _GIT, _NODE.replace("rw,nosuid,nodev", "rw,nodev")),
        (_ROOT, _BASE, _MERGED, _GIT, _NODE.replace("rw,nosuid,nodev", "rw,nosuid")),
    ):
        with pytest.raises(ConfinementUnmet):
            verify(p, _mountinfo(*lines))
    with pytest.raises(ConfinementUnmet):
        plan("/s", "sb", 2, [], [("../up", (1, 3))])


@pytest.mark.parametrize(
    "lines",
    [
        pytest.param((_ROOT, _BASE, _GIT), id="no-overlay"),
        pytest.param((_ROOT, _BASE, _MERGED), id="readonly-part-missing"),
        pytest.param(
            (_ROOT, _BASE, _MERGED, _GIT.replace("ro,lowerdir", "rw,lowerdir")), id="rw-part"
        ),
        pytest.param(
            (
                _ROOT,
                _BASE,
                _MERGED,
                "22 21 8:1 /c/.git /s/layers/sb/merged/.git ro shared:7 - ext4 /dev/sda1 rw",
            ),
            id="ro-bind-only",
        ),
        pytest.param((_ROOT, _BASE, _MERGED.replace("upper/2", "upper/1"), _GIT), id="old-gen"),
        # A feature that keeps state about the lower in the upper or work dir: a remount
        # over a changed checkout would not be sound (docs/working-layer.md, "The fresh
        # view").
        pytest.param((_ROOT, _BASE, _MERGED + ",index=on", _GIT), id="index"),
        pytest.param((_ROOT, _BASE, _MERGED + ",metacopy=on", _GIT), id="metacopy"),
        pytest.param((_ROOT, _BASE, _MERGED + ",redirect_dir=on", _GIT), id="redirect-on"),
        pytest.param((_ROOT, _BASE, _MERGED + ",redirect_dir=follow", _GIT), id="redirects"),
        pytest.param((_ROOT, _BASE, _MERGED + ",xino=auto", _GIT), id="xino"),
        pytest.param(
            (_ROOT, _BASE, _MERGED, _GIT, "23 21 0:52 / /s/layers/sb/merged/x rw - tmpfs t rw"),
            id="extra-mount",
        ),
        pytest.param(
            (_ROOT, _BASE, _MERGED, _GIT, "23 21 0:53 / /s/layers/sb/merged rw - tmpfs t rw"),
            id="covered",
        ),
    ],
)
def test_verify_refuses_any_other_mount_state(lines: tuple[str, ...]) -> None:
    with pytest.raises(ConfinementUnmet) as caught:
        verify(plan("/s", "sb", 2, [(".git", (1, 2))]), _mountinfo(*lines))
    assert (
        caught.value.data["required"]["layer_mounts"]
        != caught.value.data["observed"]["layer_mounts"]
    )
