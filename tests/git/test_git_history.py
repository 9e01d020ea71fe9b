"""`substrate.git.history.commit_subjects`: a ref's new commits, newest first, bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrate.git import commit_subjects
from substrate.git import history as history_module
from substrate.git.store import ObjectStore
from tests.harness.gitrepos import Repo, dir_fd


def subjects(repo: Repo, new: str, old: str | None, limit: int = 100) -> tuple[str, ...]:
    with dir_fd(repo.objects) as fd:
        return commit_subjects(fd, new, old, limit=limit)


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    repo = Repo.init(tmp_path / "repo")
    for i in range(5):
        repo.commit({"f.txt": f"{i}\n"}, f"commit {i}\n\nits body, not its subject")
    return repo


def fast_import(repo: Repo, branch: str, count: int, start: int) -> str:
    """`count` commits on `branch` (a new root) by `git fast-import`; the tip's id."""
    script = []
    for i in range(count):
        when = start + i * 60
        script.append(
            f"commit refs/heads/{branch}\nmark :{i + 1}\n"
            f"committer P <p@example.com> {when} +0000\ndata <<END\n{branch} {i}\nEND\n"
        )
        if i:
            script.append(f"from :{i}\n")
        script.append("\n")
    repo.git("fast-import", "--quiet", stdin="".join(script).encode())
    return repo.rev(f"refs/heads/{branch}")


def test_the_commits_new_to_the_ref_newest_first(repo: Repo) -> None:
    assert subjects(repo, repo.rev("HEAD"), repo.rev("HEAD~2")) == ("commit 4", "commit 3")
    assert subjects(repo, repo.rev("HEAD"), None) == tuple(f"commit {i}" for i in (4, 3, 2, 1, 0))
    assert subjects(repo, repo.rev("HEAD"), repo.rev("HEAD")) == ()
    assert subjects(repo, repo.rev("HEAD"), None, limit=2) == ("commit 4", "commit 3")


def test_a_merge_lists_both_sides_once(repo: Repo) -> None:
    base = repo.rev("HEAD")
    repo.git("checkout", "-q", "-b", "side")
    repo.commit({"side.txt": "s\n"}, "on the side")
    repo.git("checkout", "-q", "main")
    repo.commit({"main.txt": "m\n"}, "on main")
    repo.git("merge", "-q", "--no-edit", "-m", "merge side", "side")
    found = subjects(repo, repo.rev("HEAD"), base)
    assert found[0] == "merge side"
    assert sorted(found[1:]) == ["on main", "on the side"]


def test_a_missing_or_odd_id_ends_the_walk_quietly(repo: Repo) -> None:
    assert subjects(repo, "0" * 40, None) == ()
    assert subjects(repo, "not hex", None) == ()
    tree = repo.rev("HEAD^{tree}")
    assert subjects(repo, tree, None) == ()


def test_the_walk_is_bounded_however_long_the_histories(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = fast_import(repo, "long", 3000, 1_800_000_000)
    older = fast_import(repo, "older", 3000, 1_600_000_000)
    newer = fast_import(repo, "newer", 3000, 1_900_000_000)
    reads = 0
    real = ObjectStore.read

    def counting(self: ObjectStore, oid: str, cap: int) -> tuple[int, bytes] | None:
        nonlocal reads
        reads += 1
        return real(self, oid, cap)

    monkeypatch.setattr(ObjectStore, "read", counting)
    bound = history_module.MAX_WALK_FACTOR * 10 + history_module.MAX_WALK_EXTRA
    assert subjects(repo, new, older, limit=10) == tuple(f"long {i}" for i in range(2999, 2989, -1))
    assert reads <= 12
    reads = 0
    # An unrelated old side newer than every new commit is walked first: the bound
    # stops it, and the subjects found by then are what is listed.
    cut = subjects(repo, new, newer, limit=10)
    assert reads == bound
    assert 0 < len(cut) < 10 and cut[0] == "long 2999"
