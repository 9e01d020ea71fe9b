"""`substrate.git.store.ObjectStore`: every object of a real store read back as git reads it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from substrate.git.store import TYPE_NAMES, ObjectStore, StoreDamaged
from tests.harness.gitrepos import Repo, dir_fd, history


@pytest.mark.parametrize("packed", [False, True])
def test_every_object_reads_back_as_git_cat_file_gives_it(tmp_path: Path, packed: bool) -> None:
    repo = Repo.init(tmp_path / "repo")
    history(repo, 8)
    if packed:
        repo.git("gc", "-q", "--aggressive", "--prune=now")
        chains = repo.git("verify-pack", "-v", str(repo.packs()[0].with_suffix(".idx")))
        assert "chain length = 2" in chains
    ids = sorted(repo.object_ids())
    with dir_fd(repo.objects) as fd, ObjectStore(fd) as store:
        for oid in ids:
            found = store.read(oid, 1 << 20)
            assert found is not None
            kind, content = found
            expected = subprocess.run(
                ["git", "cat-file", TYPE_NAMES[kind].decode(), oid],
                cwd=repo.path,
                capture_output=True,
                check=True,
            ).stdout
            assert content == expected
        assert store.read("0" * 40, 1 << 20) is None
        with pytest.raises(StoreDamaged):
            store.read(repo.rev("HEAD:big.txt"), 100)  # over the caller's cap
