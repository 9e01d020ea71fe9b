"""substrate.layer.changes.changeset: what a pair of layer entries means, and the apply order (pure)."""

from __future__ import annotations

import pytest

from substrate.layer.changes.changeset import Change, Seen, Verdict, classify, ordered

A = "a" * 64
B = "b" * 64


def file(sha: str = A, mode: int = 0o644, nlink: int = 1) -> Seen:
    return Seen(kind="file", mode=mode, sha256=sha, size=3, nlink=nlink)


def folder(mode: int = 0o755, opaque: bool = False) -> Seen:
    return Seen(kind="dir", mode=mode, opaque=opaque)


def link(sha: str = A) -> Seen:
    return Seen(kind="symlink", sha256=sha, size=1, target=b"t")


WHITEOUT = Seen(kind="whiteout")


@pytest.mark.parametrize(
    ("upper", "lower", "verdict"),
    [
        (file(), None, Verdict(("create",))),
        (file(B), file(A), Verdict(("replace",))),
        (file(A, 0o755), file(A, 0o644), Verdict(("chmod",))),
        (file(A), file(A), Verdict()),  # a copy-up of unchanged bytes is no change
        (file(), folder(), Verdict(("delete_tree", "create"))),
        (file(), link(), Verdict(("delete", "create"))),
        # Hard links made in the sandbox: each name a separate file.
        (file(nlink=2), None, Verdict(("create",))),
        (file(B, nlink=2), file(), Verdict(("replace",))),
        (WHITEOUT, file(), Verdict(("delete",))),
        (WHITEOUT, folder(), Verdict(("delete_tree",))),
        (WHITEOUT, None, Verdict()),
        (WHITEOUT, link(), Verdict(("delete",))),
        (folder(), None, Verdict(("mkdir", "descend"))),
        (folder(), folder(), Verdict(("descend",))),
        (folder(0o700), folder(0o755), Verdict(("chmod", "descend"))),
        (folder(opaque=True), folder(), Verdict(("delete_absent", "descend"))),
        (folder(), file(), Verdict(("delete", "mkdir", "descend"))),
        (folder(), Seen(kind="fifo"), Verdict(blocked="replaces_fifo")),
        (link(), None, Verdict(("create",))),
        (link(B), link(A), Verdict(("replace",))),
        (link(A), link(A), Verdict()),
        (link(), file(), Verdict(("delete", "create"))),
        (link(), folder(), Verdict(("delete_tree", "create"))),
        (link(), Seen(kind="fifo"), Verdict(blocked="replaces_fifo")),
        (folder(), link(), Verdict(("delete", "mkdir", "descend"))),
        (Seen(kind="fifo"), None, Verdict(blocked="fifo")),
        (Seen(kind="socket"), None, Verdict(blocked="socket")),
        (Seen(kind="device"), file(), Verdict(blocked="device")),
        (
            Seen(kind="file", overlay_feature="metacopy"),
            file(),
            Verdict(blocked="overlay_metacopy"),
        ),
        (Seen(kind="dir", overlay_feature="redirect"), None, Verdict(blocked="overlay_redirect")),
    ],
)
def test_classify(upper: Seen, lower: Seen | None, verdict: Verdict) -> None:
    assert classify(upper, lower) == verdict


def test_order_deletes_deepest_first_then_dirs_then_files_then_dir_modes() -> None:
    changes = [
        Change(path="b/new.txt", op="create"),
        Change(path="a", op="chmod", kind="dir", mode=0o500),
        Change(path="a/b", op="chmod", kind="dir", mode=0o500),
        Change(path="old", op="delete", kind="dir"),
        Change(path="old/x/y", op="delete"),
        Change(path="old/x", op="delete", kind="dir"),
        Change(path="b/c", op="mkdir", kind="dir"),
        Change(path="b", op="mkdir", kind="dir"),
        Change(path="a.txt", op="replace"),
        Change(path="m.txt", op="chmod", mode=0o600),
    ]
    assert [(c.path, c.op) for c in ordered(changes)] == [
        ("old/x/y", "delete"),
        ("old/x", "delete"),
        ("old", "delete"),
        ("b", "mkdir"),
        ("b/c", "mkdir"),
        ("a.txt", "replace"),
        ("b/new.txt", "create"),
        ("m.txt", "chmod"),
        ("a/b", "chmod"),
        ("a", "chmod"),
    ]
    assert ordered(list(reversed(changes))) == ordered(changes)
