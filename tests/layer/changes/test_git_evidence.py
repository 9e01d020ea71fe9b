"""Which refs the sandbox wrote in its git layer's upper dir (`git_evidence`;
docs/working-layer.md, "The git layer")."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from substrate.layer import git_baseline
from substrate.layer.changes import git_evidence


def _upper(tmp_path: Path) -> Path:
    upper = tmp_path / "upper"
    (upper / "refs" / "heads" / "agent").mkdir(parents=True)
    (upper / "refs" / "heads" / "agent" / "fix").write_text("a" * 40 + "\n")
    os.mknod(upper / "refs" / "heads" / "gone", stat.S_IFCHR | 0o000, 0)  # a whiteout
    (upper / "packed-refs").write_text("# pack-refs with: peeled\n")
    return upper


def test_what_the_sandbox_wrote_since_is_evidence(tmp_path: Path) -> None:
    found = git_evidence.read(str(_upper(tmp_path)), 0)
    assert found.loose == {"refs/heads/agent/fix", "refs/heads/gone"} and found.packed
    assert found.covers("refs/heads/agent/fix", loose_in_checkout=True)
    # Only packed-refs speaks for a ref the checkout has no loose file of.
    assert found.covers("refs/heads/main", loose_in_checkout=False)
    assert not found.covers("refs/heads/main", loose_in_checkout=True)


def test_what_it_wrote_before_the_last_conclusion_is_not(tmp_path: Path) -> None:
    upper = _upper(tmp_path)
    since = git_baseline.mark(str(tmp_path))
    found = git_evidence.read(str(upper), since)
    assert not found.loose and not found.packed
    assert not found.covers("refs/heads/main", loose_in_checkout=False)
    (upper / "refs" / "heads" / "new").write_text("b" * 40 + "\n")
    assert git_evidence.read(str(upper), since).loose == {"refs/heads/new"}


def test_a_mark_is_after_every_file_written_before_it(tmp_path: Path) -> None:
    before = tmp_path / "before"
    before.write_text("x")
    marked = git_baseline.mark(str(tmp_path))
    assert os.stat(before).st_ctime_ns < marked
    after = tmp_path / "after"
    after.write_text("y")
    assert os.stat(after).st_ctime_ns >= marked


def test_an_opaque_directory_speaks_for_every_ref_beneath(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "refs" / "heads" / "x").mkdir(parents=True)
    os.setxattr(upper / "refs" / "heads" / "x", "trusted.overlay.opaque", b"y")
    found = git_evidence.read(str(upper), 0)
    assert found.covers("refs/heads/x/old", loose_in_checkout=True)
    assert not found.covers("refs/heads/y", loose_in_checkout=True)
