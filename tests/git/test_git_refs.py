"""`substrate.git.refs` and `refnames`: compare-and-swap under git's lock files, with a
reflog line git reads back; names as `git check-ref-format` has them; bounded reads."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from substrate.errors import TooLarge
from substrate.git import RefOutcome, read_refs, update_ref, valid_ref_name
from substrate.git.refs import reflog_line, scan_refs
from tests.harness.gitrepos import Repo, dir_fd

OWNER = (1000, 1000)
AGENT = b"Agent <agent@substrate.invalid>"


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    repo = Repo.init(tmp_path / "repo")
    for i in range(3):
        repo.commit({"f.txt": f"{i}\n"}, f"commit {i}")
    return repo


def update(repo: Repo, name: str, old: str | None, new: str | None, **kw: object) -> RefOutcome:
    with dir_fd(repo.git_dir) as fd:
        return update_ref(
            fd,
            name,
            old,
            new,
            committer=AGENT,
            message=b"agent: move\nit",
            owner=OWNER,
            **kw,  # type: ignore[arg-type]
        )


def git_takes(name: str) -> bool:
    """Whether `git check-ref-format` takes `name` (it reads no repository)."""
    done = subprocess.run(["git", "check-ref-format", name], capture_output=True, check=False)
    return done.returncode == 0


def untouched(repo: Repo) -> dict[str, tuple[bytes, int]]:
    """HEAD, the index, config, hooks and info: what update_ref never writes."""
    seen = {}
    for name in ("HEAD", "index", "config", "description"):
        path = repo.git_dir / name
        seen[name] = (path.read_bytes(), path.stat().st_mtime_ns)
    for sub in ("hooks", "info"):
        for path in sorted((repo.git_dir / sub).rglob("*")):
            seen[str(path)] = (
                path.read_bytes() if path.is_file() else b"",
                path.stat().st_mtime_ns,
            )
    return seen


def test_create_applies_and_git_sees_the_ref_its_log_and_its_reflog(repo: Repo) -> None:
    head = repo.rev("HEAD")
    before = untouched(repo)
    assert update(repo, "refs/heads/agent/work", None, head, now=1_700_000_123) == RefOutcome(
        "applied", head
    )
    assert repo.rev("refs/heads/agent/work") == head
    assert repo.git("log", "--format=%s", "agent/work").split("\n")[:3] == [
        "commit 2",
        "commit 1",
        "commit 0",
    ]
    reflog = repo.git("reflog", "show", "--format=%H %gs", "agent/work").strip()
    assert reflog == f"{head} agent: move it"
    raw = (repo.git_dir / "logs/refs/heads/agent/work").read_bytes()
    assert raw == f"{'0' * 40} {head} ".encode() + AGENT + b" 1700000123 +0000\tagent: move it\n"
    ref = repo.git_dir / "refs/heads/agent/work"
    st = ref.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o644)
    assert (repo.git_dir / "refs/heads/agent").stat().st_uid == 1000
    assert not ref.with_name("work.lock").exists()
    assert untouched(repo) == before


def test_a_move_appends_to_the_reflog_and_a_repeat_is_unchanged(repo: Repo) -> None:
    first, head = repo.rev("HEAD~2"), repo.rev("HEAD")
    update(repo, "refs/heads/agent/work", None, first)
    assert update(repo, "refs/heads/agent/work", first, head) == RefOutcome("applied", head)
    assert update(repo, "refs/heads/agent/work", first, head) == RefOutcome("unchanged", head)
    log = repo.git("reflog", "show", "--format=%H", "agent/work").split()
    assert log == [head, first]


def test_a_ref_the_host_moved_is_host_changed_and_left_alone(repo: Repo) -> None:
    first, second, head = repo.rev("HEAD~2"), repo.rev("HEAD~1"), repo.rev("HEAD")
    update(repo, "refs/heads/agent/work", None, first)
    repo.git("update-ref", "refs/heads/agent/work", second)  # the person moves it
    assert update(repo, "refs/heads/agent/work", first, head) == RefOutcome("host_changed", second)
    assert repo.rev("refs/heads/agent/work") == second
    # One the host made meanwhile, where the agent expected none:
    repo.git("update-ref", "refs/heads/agent/new", second)
    assert update(repo, "refs/heads/agent/new", None, head) == RefOutcome("host_changed", second)


def test_a_packed_ref_is_compared_and_overridden_by_the_loose_one(repo: Repo) -> None:
    first, head = repo.rev("HEAD~2"), repo.rev("HEAD")
    repo.git("update-ref", "refs/heads/agent/packed", first)
    repo.git("pack-refs", "--all")
    assert not (repo.git_dir / "refs/heads/agent/packed").exists()
    assert (
        update(repo, "refs/heads/agent/packed", repo.rev("HEAD~1"), head).outcome == "host_changed"
    )
    assert update(repo, "refs/heads/agent/packed", first, head) == RefOutcome("applied", head)
    assert repo.rev("refs/heads/agent/packed") == head


def test_a_new_id_not_in_the_store_is_missing_object(repo: Repo) -> None:
    absent = hashlib.sha1(b"nothing").hexdigest()
    assert update(repo, "refs/heads/agent/work", None, absent) == RefOutcome("missing_object", None)
    assert not (repo.git_dir / "refs/heads/agent").exists()  # not even its directory
    assert not (repo.git_dir / "logs/refs/heads/agent").exists()
    head = repo.rev("HEAD")
    update(repo, "refs/heads/agent/work", None, head)
    assert update(repo, "refs/heads/agent/work", head, absent) == RefOutcome("missing_object", head)
    assert repo.rev("refs/heads/agent/work") == head
    assert not (repo.git_dir / "refs/heads/agent/work.lock").exists()


def test_deletion_removes_the_loose_ref_and_rewrites_packed_refs(repo: Repo) -> None:
    first, head = repo.rev("HEAD~2"), repo.rev("HEAD")
    repo.git("update-ref", "refs/heads/agent/a", first)
    repo.git("update-ref", "refs/heads/agent/b", head)
    repo.git("update-ref", "refs/tags/keep", head)
    repo.git("pack-refs", "--all")
    repo.git("update-ref", "refs/heads/agent/a", head)  # loose over packed
    assert update(repo, "refs/heads/agent/a", head, None) == RefOutcome("applied", None)
    assert update(repo, "refs/heads/agent/b", head, None) == RefOutcome("applied", None)
    refs = repo.git("show-ref").split("\n")
    names = {line.split(" ")[1] for line in refs if line}
    assert "refs/heads/agent/a" not in names and "refs/heads/agent/b" not in names
    assert {"refs/heads/main", "refs/tags/keep"} <= names
    assert "agent/a" not in (repo.git_dir / "packed-refs").read_text()
    assert not (repo.git_dir / "packed-refs.lock").exists()
    assert update(repo, "refs/heads/agent/b", head, None) == RefOutcome("unchanged", None)


def test_a_lock_someone_holds_is_locked_and_left_where_it_is(repo: Repo) -> None:
    lock = repo.git_dir / "refs/heads/agent/work.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("a git is writing\n")
    assert update(repo, "refs/heads/agent/work", None, repo.rev("HEAD")) == RefOutcome(
        "locked", None
    )
    assert lock.read_text() == "a git is writing\n"
    assert not (repo.git_dir / "refs/heads/agent/work").exists()


def test_a_ref_where_a_directory_would_be_is_a_name_conflict(repo: Repo) -> None:
    head = repo.rev("HEAD")
    repo.git("update-ref", "refs/heads/agent", head)
    assert update(repo, "refs/heads/agent/x", None, head) == RefOutcome("name_conflict", None)
    repo.git("pack-refs", "--all")
    assert update(repo, "refs/heads/agent/x", None, head) == RefOutcome("name_conflict", None)
    os.symlink("main", repo.git_dir / "refs/heads/link")
    assert update(repo, "refs/heads/link", None, head) == RefOutcome("name_conflict", None)
    assert os.readlink(repo.git_dir / "refs/heads/link") == "main"


@pytest.mark.parametrize(
    "name",
    [
        "refs/heads/a..b",
        "refs/heads/x\x01y",
        "refs/heads/x\x7f",
        "refs/heads/x.lock",
        "refs/heads/x.lock/y",
        "refs/heads/.hidden",
        "refs/heads/a@{1}",
        "refs/heads/",
        "refs//x",
        "refs/heads/x.",
        "refs/heads/sp ace",
        "refs/heads/a~1",
        "refs/heads/a^",
        "refs/heads/a:b",
        "refs/heads/a?",
        "refs/heads/a*",
        "refs/heads/a[",
        "refs/heads/a\\b",
        "HEAD",
        "heads/main",
        "refs",
    ],
)
def test_invalid_names_are_refused_as_git_check_ref_format_refuses_them(
    repo: Repo, name: str
) -> None:
    assert not valid_ref_name(name)
    assert update(repo, name, None, repo.rev("HEAD")) == RefOutcome("invalid_name", None)
    if name.startswith("refs/"):
        assert not git_takes(name)


@pytest.mark.parametrize(
    "name", ["refs/heads/agent/feature-1", "refs/tags/v1.0", "refs/heads/ünï", "refs/x"]
)
def test_valid_names_are_taken_as_git_takes_them(name: str) -> None:
    assert valid_ref_name(name)
    assert git_takes(name)


def test_read_refs_has_loose_over_packed_and_skips_symlinks_by_name(repo: Repo) -> None:
    first, head = repo.rev("HEAD~2"), repo.rev("HEAD")
    repo.git("update-ref", "refs/heads/agent/a", first)
    repo.git("pack-refs", "--all")
    repo.git("update-ref", "refs/heads/agent/a", head)
    repo.git("symbolic-ref", "refs/remotes/origin/HEAD", "refs/heads/main")
    os.symlink("/etc/passwd", repo.git_dir / "refs/heads/evil")
    with dir_fd(repo.git_dir) as fd:
        scan = scan_refs(fd, max_refs=100)
        assert read_refs(fd, max_refs=100) == scan.refs
    assert scan.refs == {"refs/heads/main": head, "refs/heads/agent/a": head}
    assert ("refs/heads/evil", "symlink") in scan.skipped
    assert ("refs/remotes/origin/HEAD", "symbolic") in scan.skipped


def test_100000_packed_refs_are_bounded_by_max_refs(repo: Repo) -> None:
    head = repo.rev("HEAD")
    lines = ["# pack-refs with: peeled fully-peeled sorted \n"]
    lines += [f"{head} refs/heads/agent/r{i:06d}\n" for i in range(100_000)]
    (repo.git_dir / "packed-refs").write_text("".join(lines))
    with dir_fd(repo.git_dir) as fd:
        with pytest.raises(TooLarge):
            read_refs(fd, max_refs=1000)
        refs = read_refs(fd, max_refs=200_000)
    assert len(refs) == 100_001  # and refs/heads/main, loose
    assert refs["refs/heads/agent/r099999"] == head


def test_a_reflog_line_is_one_line_whatever_the_message() -> None:
    line = reflog_line(None, "a" * 40, b"A\nB <x@y>", 5, b"one\ntwo\0three" + b"x" * 5000)
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    assert line.startswith(b"0" * 40 + b" " + b"a" * 40 + b" A B <x@y> 5 +0000\tone two three")


def test_loose_refs_past_max_refs_are_too_large(repo: Repo) -> None:
    head = repo.rev("HEAD")
    many = repo.git_dir / "refs" / "heads" / "agent"
    many.mkdir()
    for i in range(50):
        (many / f"r{i}").write_text(f"{head}\n")
    with dir_fd(repo.git_dir) as fd:
        with pytest.raises(TooLarge):
            read_refs(fd, max_refs=10)
        assert len(read_refs(fd, max_refs=100)) == 51
