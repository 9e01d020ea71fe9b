"""substrate.workspace.identity: a checkout's identity survives what a checkout lives
through (files made in its root, a rename) and is never inherited by a new directory
that got a removed one's inode, whichever proof the filesystem gives."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import PathDenied
from substrate.workspace import identity
from substrate.workspace.identity import CheckoutId, checkout_identity
from tests.harness import quiet_ext4, reuse_inode


def ident_of(path: Path) -> CheckoutId:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return checkout_identity(fd)
    finally:
        os.close(fd)


@pytest.fixture
def parent(tmp_path: Path) -> Iterator[Path]:
    # Its own filesystem: a freed inode goes to the next directory made there.
    with quiet_ext4(tmp_path / "fs") as root:
        yield root


def test_the_key_holds_the_inode_and_its_birth_and_says_what_older_releases_kept(
    parent: Path,
) -> None:
    (parent / "a").mkdir()
    found = ident_of(parent / "a")
    st = os.stat(parent / "a")
    assert found.dev_ino == (st.st_dev, st.st_ino)
    assert found.key == f"{st.st_dev}:{st.st_ino}:{found.birth}"
    assert found.birth.startswith("b")  # ext4 keeps birth times: the first proof
    assert found.legacy == f"{st.st_dev}:{st.st_ino}"


def test_it_survives_work_in_the_checkout_and_a_rename(parent: Path) -> None:
    (parent / "a").mkdir()
    before = ident_of(parent / "a")
    (parent / "a" / "new-file").write_text("x")  # changes the root's mtime and ctime
    os.chmod(parent / "a", 0o750)
    (parent / "a").rename(parent / "b")
    assert ident_of(parent / "b") == before


@pytest.mark.parametrize("proof", ["birth", "handle"])
def test_a_reused_inode_is_another_identity(
    parent: Path, proof: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if proof == "handle":  # a filesystem without birth times: the file handle decides
        monkeypatch.setattr(identity, "birth_time", lambda fd, ino: None)
    (parent / "old").mkdir()
    old = ident_of(parent / "old")
    new = ident_of(reuse_inode(parent / "old", parent))
    assert new.dev_ino == old.dev_ino
    assert new.key != old.key and new.legacy == old.legacy
    assert new.birth.startswith("b" if proof == "birth" else "h")


def test_no_proof_at_all_refuses(parent: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "birth_time", lambda fd, ino: None)
    monkeypatch.setattr(identity, "file_handle", lambda fd: None)
    (parent / "a").mkdir()
    with pytest.raises(PathDenied):
        ident_of(parent / "a")
