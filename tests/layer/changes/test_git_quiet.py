"""What a git layer's conclusion may skip (`git_quiet`, `git_refs.unchanged`;
docs/working-layer.md, "The git layer"): every write the sandbox could make under
`.git` that a conclusion reads is seen, and only an upper dir nothing touched since the
last conclusion is quiet."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from substrate.layer import git_baseline
from substrate.layer.changes import git_evidence, git_quiet, git_refs

OID_A, OID_B = "a" * 40, "b" * 40


def _upper(tmp_path: Path) -> Path:
    """A git layer's upper dir as an agent's commits leave it."""
    upper = tmp_path / "upper"
    (upper / "refs" / "heads" / "agent").mkdir(parents=True)
    (upper / "refs" / "heads" / "agent" / "fix").write_text(OID_A + "\n")
    (upper / "objects" / "ab").mkdir(parents=True)
    (upper / "objects" / "ab" / ("c" * 38)).write_bytes(b"x")
    (upper / "packed-refs").write_text("# pack-refs with: peeled\n")
    (upper / "index").write_bytes(b"DIRC")
    return upper


def _settled(tmp_path: Path, upper: Path) -> git_baseline.Settled:
    """What a conclusion right now leaves (its mark after every write so far)."""
    now = git_baseline.mark(str(tmp_path))
    baseline = git_baseline.Baseline(refs={}, imported_ns=now, concluded_ns=now)
    return git_quiet.settled_state(str(upper), 7, baseline)


def test_an_upper_dir_nothing_touched_since_is_quiet(tmp_path: Path) -> None:
    upper = _upper(tmp_path)
    settled = _settled(tmp_path, upper)
    assert settled.refs and settled.packed and settled.seen == 7
    assert git_quiet.quiet(str(upper), settled, 64) is True
    # Reading changes nothing; what no conclusion reads (HEAD, the index, logs) is not
    # looked at: a `git status` that rewrites the index stays quiet.
    (upper / "index").write_bytes(b"DIRC2")
    (upper / "HEAD").write_text("ref: refs/heads/agent/fix\n")
    assert git_quiet.quiet(str(upper), settled, 64) is True


def _rewrite_in_place(upper: Path) -> None:
    # The same inode, written again (`echo <oid> > .git/refs/heads/agent/fix`).
    fd = os.open(upper / "refs" / "heads" / "agent" / "fix", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (OID_B + "\n").encode())
    finally:
        os.close(fd)


def _whiteout(upper: Path) -> None:
    os.mknod(upper / "refs" / "heads" / "main", stat.S_IFCHR | 0o000, 0)


def _opaque(upper: Path) -> None:
    os.setxattr(upper / "refs" / "heads" / "agent", "trusted.overlay.opaque", b"y")


def _pack_rewritten(upper: Path) -> None:
    with open(upper / "packed-refs", "a") as f:  # in place
        f.write(f"{OID_B} refs/heads/main\n")


def _remove_refs(upper: Path) -> None:
    (upper / "refs" / "heads" / "agent" / "fix").unlink()
    (upper / "refs" / "heads" / "agent").rmdir()
    (upper / "refs" / "heads").rmdir()
    (upper / "refs").rmdir()


def _new_object_dir(upper: Path) -> None:
    (upper / "objects" / "cd").mkdir()
    (upper / "objects" / "cd" / ("e" * 38)).write_bytes(b"y")


def _new_object(upper: Path) -> None:
    (upper / "objects" / "ab" / ("d" * 38)).write_bytes(b"z")


def _new_pack(upper: Path) -> None:
    (upper / "objects" / "pack").mkdir()


@pytest.mark.parametrize(
    "write",
    [
        _rewrite_in_place,
        lambda u: (u / "refs" / "heads" / "agent" / "new").write_text(OID_B + "\n"),
        lambda u: (u / "refs" / "heads" / "agent" / "fix").unlink(),
        lambda u: os.rename(u / "refs/heads/agent/fix", u / "refs/heads/agent/moved"),
        lambda u: (u / "refs" / "tags").mkdir(),
        _whiteout,
        _opaque,
        lambda u: os.chmod(u / "refs" / "heads" / "agent" / "fix", 0o600),
        _pack_rewritten,
        lambda u: (u / "packed-refs").unlink(),
        _remove_refs,
        _new_object_dir,
        _new_object,
        _new_pack,
    ],
    ids=[
        "ref rewritten in place",
        "ref made",
        "ref removed",
        "ref renamed",
        "refs dir made",
        "whiteout",
        "opaque dir",
        "mode",
        "packed-refs in place",
        "packed-refs removed",
        "refs removed whole",
        "new fan-out dir",
        "new object",
        "new pack dir",
    ],
)
def test_any_write_a_conclusion_reads_is_not_quiet(
    tmp_path: Path, write: Callable[[Path], object]
) -> None:
    upper = _upper(tmp_path)
    settled = _settled(tmp_path, upper)
    write(upper)
    assert git_quiet.quiet(str(upper), settled, 64) is False


def test_what_was_absent_and_is_made_is_not_quiet(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    settled = _settled(tmp_path, upper)
    assert not settled.refs and not settled.packed
    assert git_quiet.quiet(str(upper), settled, 64) is True
    (upper / "packed-refs").write_text("")
    assert git_quiet.quiet(str(upper), settled, 64) is False
    (upper / "packed-refs").unlink()
    os.mknod(upper / "refs", stat.S_IFCHR | 0o000, 0)  # `rm -r .git/refs`: a whiteout
    assert git_quiet.quiet(str(upper), settled, 64) is False


def test_past_the_budget_it_is_not_known(tmp_path: Path) -> None:
    upper = _upper(tmp_path)
    for i in range(10):
        (upper / "refs" / "heads" / f"b{i}").write_text(OID_A + "\n")
    settled = _settled(tmp_path, upper)
    assert git_quiet.quiet(str(upper), settled, 5) is None
    assert git_quiet.quiet(str(upper), settled, 64) is True


def test_a_conclusion_leaves_the_baseline_only_when_nothing_happened() -> None:
    loaded = git_baseline.Baseline(refs={"refs/heads/main": OID_A}, imported_ns=5, concluded_ns=5)
    none = git_evidence.Evidence()
    assert git_refs.unchanged(loaded, {"refs/heads/main": OID_A}, [], none, 5)
    # A ref the host moved shows in the view: the baseline follows it.
    assert not git_refs.unchanged(loaded, {"refs/heads/main": OID_B}, [], none, 5)
    # A move, evidence written (a ref written back to its value), an import, "discard".
    moved = [("refs/heads/agent/x", None, OID_B)]
    assert not git_refs.unchanged(loaded, {"refs/heads/main": OID_A}, moved, none, 5)
    wrote = git_evidence.Evidence(loose={"refs/heads/main"})
    assert not git_refs.unchanged(loaded, {"refs/heads/main": OID_A}, [], wrote, 5)
    assert not git_refs.unchanged(loaded, {"refs/heads/main": OID_A}, [], none, None)
    assert not git_refs.unchanged(loaded, {"refs/heads/main": OID_A}, [], none, 9)
