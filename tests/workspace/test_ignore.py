"""substrate.workspace.ignore: git's ignore rules (checked against `git check-ignore`
itself on generated trees), `exclude` globs, and `fs.walk`/`fs.search` leaving out
what they match, read through the walk's directory fds."""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from substrate.errors import InvalidParams, LimitExceeded, TooLarge
from substrate.schema.fs import SearchParams, WalkParams
from substrate.schema.workspace import Policy
from substrate.workspace import ignore, reads, search
from substrate.workspace.ignore import IgnoreFile, IgnoreStack, wildmatch_regex
from substrate.workspace.registry import Workspace, WorkspaceRegistry

WS = "ws_test"


def git_env(home: Path) -> dict[str, str]:
    """git with no system or user configuration (no global excludes file)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "LC_ALL": "C",
    }


def git_ignored(repo: Path, rels: list[str]) -> set[str]:
    """The paths of `rels` that git ignores (`check-ignore --no-index`), in `repo`."""
    proc = subprocess.run(
        [
            *("git", "-c", "core.excludesFile=/dev/null", "-c", "safe.directory=*"),
            *("check-ignore", "--no-index", "--stdin", "-z"),
        ],
        cwd=repo,
        input="\0".join(rels).encode() + b"\0",
        capture_output=True,
        env=git_env(repo.parent),
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr.decode()
    return {p.decode() for p in proc.stdout.split(b"\0") if p}


def all_paths(top: Path) -> list[str]:
    out = []
    for base, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in dirs + files:
            out.append(os.path.relpath(os.path.join(base, name), top))
    return sorted(out)


def ours(top: Path) -> set[str]:
    """The paths our rules ignore (a pruning walk, as `Pruner` does, without a workspace)."""
    ignored: set[str] = set()

    def visit(rel: str, stack: IgnoreStack) -> None:
        here = top / rel if rel else top
        names = sorted(os.listdir(here))
        files = []
        if ".git" in names and (here / ".git" / "info" / "exclude").exists():
            files.append(IgnoreFile.parse((here / ".git/info/exclude").read_bytes(), b""))
        if ".gitignore" in names:
            base = (rel + "/").encode() if rel else b""
            files.append(IgnoreFile.parse((here / ".gitignore").read_bytes(), base))
        stack.push(files, ".git" in names)
        for name in names:
            if name == ".git":
                continue
            child = f"{rel}/{name}" if rel else name
            is_dir = (top / child).is_dir() and not (top / child).is_symlink()
            if stack.ignored(child.encode(), name.encode(), is_dir):
                ignored.add(child)
                if is_dir:
                    ignored.update(f"{child}/{p}" for p in all_paths(top / child))
            elif is_dir:
                visit(child, stack)
        stack.pop()

    visit("", IgnoreStack())
    return ignored


# --- the pattern language, against git ---------------------------------------------------

NAMES = ["a", "b", "build", "x.py", "x.pyc", "keep.pyc", "__pycache__", "log.txt", "#h", "c d"]
DIRS = ["src", "build", "docs", "__pycache__", "a", "deep"]


def random_tree(rng: random.Random, top: Path) -> None:
    def fill(where: Path, depth: int) -> None:
        where.mkdir(parents=True, exist_ok=True)
        for name in rng.sample(NAMES, rng.randint(2, 5)):
            (where / name).write_text("x")
        if depth < 3:
            for name in rng.sample(DIRS, rng.randint(1, 3)):
                if not (where / name).exists():
                    fill(where / name, depth + 1)

    fill(top, 0)


PATTERN_PARTS = [
    "build", "build/", "/build", "*.pyc", "!keep.pyc", "__pycache__/", "src/**/x.py",
    "**/a", "deep/**", "docs/*", "[a-c]", "[!x]*.txt", "?.py*", "x.py[cod]", "\\#h",
    "c\\ d", "log.txt   ", "# comment", "!build", "/*.txt", "a/", "**/build/x.py",
    "*", "!*/", "src/", "!src/a", "[[:alpha:]].py", "b/**/", "deep/a/", "!deep/",
]  # fmt: skip


def random_ignore(rng: random.Random) -> str:
    lines = rng.sample(PATTERN_PARTS, rng.randint(1, 7))
    return "\n".join(lines) + rng.choice(["\n", "", "\r\n"])


@pytest.mark.parametrize("seed", range(40))
def test_rules_agree_with_git_check_ignore(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    repo = tmp_path / "repo"
    random_tree(rng, repo)
    subprocess.run(["git", "init", "-q", str(repo)], env=git_env(tmp_path), check=True)
    dirs = [repo] + [repo / p for p in all_paths(repo) if (repo / p).is_dir()]
    for where in rng.sample(dirs, min(len(dirs), rng.randint(1, 4))):
        (where / ".gitignore").write_text(random_ignore(rng))
    if rng.random() < 0.3:
        (repo / ".git" / "info" / "exclude").write_text(random_ignore(rng))
    rels = [p for p in all_paths(repo) if not p.endswith(".gitignore")]
    assert ours(repo) & set(rels) == git_ignored(repo, rels)


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("a/**/b", "a/b", True),
        ("a/**/b", "a/x/y/b", True),
        ("**/foo", "x/y/foo", True),
        ("foo/**", "foo", False),
        ("foo/**", "foo/x/y", True),
        ("a*b", "a/b", False),  # `*` never crosses a slash with a slash in the pattern
        ("a**b", "ax/yb", False),  # an unbounded `**` is a `*`
        ("[[:digit:]]x", "5x", True),
        ("[]]", "]", True),
        ("[!a]", "/", False),
        ("[a-", "[a-", False),  # git aborts an unclosed class: nothing matches
        ("x\\", "x\\", False),
        ("[[:nope:]]", "n", False),
        ("\\*", "*", True),
        ("\\*", "x", False),
    ],
)
def test_wildmatch_with_slashes(pattern: str, path: str, matches: bool) -> None:
    import re2  # type: ignore[import-untyped]

    source = wildmatch_regex(pattern.encode(), pathname=True)
    found = source is not None and re2.compile(source, ignore._options()).fullmatch(path.encode())
    assert bool(found) is matches


def test_a_pathological_pattern_is_matched_in_linear_time() -> None:
    # Backtracking would take ~255^20 steps here; RE2 takes one pass.
    rules = IgnoreFile.parse(b"*a" * 20 + b"b\n", b"")
    stack = IgnoreStack()
    stack.push([rules], True)
    assert not stack.ignored(b"a" * 255, b"a" * 255, False)


def test_deeper_files_win_and_a_repository_hides_the_rules_above() -> None:
    stack = IgnoreStack()
    stack.push([IgnoreFile.parse(b"*.log\n", b"")], True)
    stack.push([IgnoreFile.parse(b"!keep.log\n", b"sub/")], False)
    assert stack.ignored(b"sub/x.log", b"x.log", False)
    assert not stack.ignored(b"sub/keep.log", b"keep.log", False)
    stack.push([], True)  # sub/nested holds a .git: another repository
    assert not stack.ignored(b"sub/nested/x.log", b"x.log", False)
    stack.pop()
    assert stack.ignored(b"sub/y.log", b"y.log", False)


# --- walks and searches -------------------------------------------------------------------

TREE: dict[str, str | bytes] = {
    ".gitignore": "__pycache__/\n*.log\n/build\n!important.log\n",
    "src/app.py": "print('hello')\n",
    "src/app.log": "hello log\n",
    "src/important.log": "hello kept\n",
    "src/build/x.py": "hello nested build\n",  # `/build` is anchored: this one stays
    "build/out.txt": "hello built\n",
    "vendor/.gitignore": "*.txt\n!notes.txt\n",
    "vendor/a.txt": "hello vendor\n",
    "vendor/notes.txt": "hello notes\n",
    "vendor/deep/b.txt": "hello deep\n",
    "docs/readme.md": "hello docs\n",
}


@pytest.fixture
def tree(make_workspace: Callable[..., Path]) -> Path:
    path = make_workspace("ign", TREE, git=True)
    for i in range(300):  # the flood one agent met: 823 entries from byte-code caches
        cache = path / "src" / f"m{i}" / "__pycache__"
        cache.mkdir(parents=True)
        (cache / f"m{i}.cpython-311.pyc").write_bytes(b"hello, as text: searched unless left out")
        (path / "src" / f"m{i}" / "mod.py").write_text("x = 1\n")
    return path


@pytest.fixture
def tree_ws(registry: WorkspaceRegistry, tree: Path) -> Workspace:
    return registry.adopt(str(tree), None, Policy(read_deny=["secret/**"]), "agent:0")


def walk(ws: Workspace, **kw: Any) -> list[str]:
    result = reads.walk(ws, WalkParams(workspace=WS, **kw))
    return [e.path for e in result.paths]


def found(ws: Workspace, pattern: str, **kw: Any) -> list[str]:
    result = search.search(ws, SearchParams(workspace=WS, pattern=pattern, **kw))
    return sorted({m.path for m in result.matches})


def test_gitignore_leaves_out_the_pycache_flood_and_nested_rules(tree_ws: Workspace) -> None:
    everything = walk(tree_ws, max_entries=100000)
    assert sum("__pycache__" in p for p in everything) == 600
    kept = walk(tree_ws, gitignore=True, max_entries=100000)
    assert not any("__pycache__" in p for p in kept)
    assert [p for p in kept if not p.startswith("src/m")] == [
        ".gitignore",
        "docs",
        "docs/readme.md",
        "src",
        "src/app.py",
        "src/build",
        "src/build/x.py",
        "src/important.log",
        "vendor",
        "vendor/.gitignore",
        "vendor/deep",
        "vendor/notes.txt",
    ]


def test_gitignore_agrees_with_git_on_the_tree(tree_ws: Workspace, tree: Path) -> None:
    everything = walk(tree_ws, max_entries=100000)
    ignored = git_ignored(tree, everything)
    assert walk(tree_ws, gitignore=True, max_entries=100000) == [
        p for p in everything if p not in ignored
    ]


def test_search_honours_gitignore_and_exclude(tree_ws: Workspace) -> None:
    assert found(tree_ws, "hello", gitignore=True) == [
        "docs/readme.md",
        "src/app.py",
        "src/build/x.py",
        "src/important.log",
        "vendor/notes.txt",
    ]
    assert found(tree_ws, "hello", gitignore=True, exclude=["vendor", "src/build/"]) == [
        "docs/readme.md",
        "src/app.py",
        "src/important.log",
    ]
    without = search.search(tree_ws, SearchParams(workspace=WS, pattern="hello", max_matches=1000))
    pruned = search.search(tree_ws, SearchParams(workspace=WS, pattern="hello", gitignore=True))
    # 300 caches, app.log, build/out.txt, vendor/a.txt, vendor/deep/b.txt: never read.
    assert without.files_scanned - pruned.files_scanned == 304


def test_exclude_globs_prune_whole_directories(tree_ws: Workspace) -> None:
    kept = walk(tree_ws, exclude=["__pycache__", "src/m*/mod.py", "/vendor"], max_entries=100000)
    assert not any("__pycache__" in p or p.endswith("mod.py") for p in kept)
    assert not any(p.startswith("vendor") for p in kept)
    assert "build/out.txt" in kept  # exclude alone reads no .gitignore
    assert walk(tree_ws, path="vendor/deep", exclude=["vendor"]) == []


def test_a_walk_below_an_ignored_directory_lists_nothing(tree_ws: Workspace) -> None:
    assert walk(tree_ws, path="build", gitignore=True) == []
    assert walk(tree_ws, path="build") == ["build/out.txt"]
    # Starting below a directory with a .gitignore still applies it.
    assert walk(tree_ws, path="vendor/deep", gitignore=True) == []


def test_info_exclude_applies_and_a_nested_repository_has_its_own_rules(
    tree_ws: Workspace, tree: Path
) -> None:
    (tree / ".git" / "info").mkdir(exist_ok=True)
    (tree / ".git" / "info" / "exclude").write_text("docs/\n")
    nested = tree / "src" / "nested"
    (nested / ".git").mkdir(parents=True)
    (nested / "x.log").write_text("log\n")
    (nested / "y.txt").write_text("y\n")
    (nested / ".gitignore").write_text("y.txt\n")
    kept = walk(tree_ws, gitignore=True, max_entries=100000)
    assert "docs" not in kept
    # The outer `*.log` does not reach into another repository; its own rules do.
    assert "src/nested/x.log" in kept
    assert "src/nested/y.txt" not in kept


def test_ignore_files_are_never_followed_through_symlinks(
    tree_ws: Workspace, tree: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside-ignore"
    outside.write_text("*\n")
    (tree / "docs" / ".gitignore").symlink_to(outside)
    assert "docs/readme.md" in walk(tree_ws, gitignore=True, max_entries=100000)


def test_read_denied_ignore_files_are_not_read(tree_ws: Workspace, tree: Path) -> None:
    (tree / "secret").mkdir()
    (tree / "secret" / ".gitignore").write_text("*.txt\n")
    (tree / "secret" / "a.txt").write_text("a\n")
    assert "secret/a.txt" in walk(tree_ws, gitignore=True, max_entries=100000)


def test_bounds_are_named_refusals(
    tree_ws: Workspace, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tree / "docs" / ".gitignore").write_bytes(b"#" * (ignore.MAX_IGNORE_FILE_BYTES + 1))
    with pytest.raises(TooLarge) as too_large:
        walk(tree_ws, gitignore=True, max_entries=100000)
    assert "docs/.gitignore" in too_large.value.message
    (tree / "docs" / ".gitignore").write_text("a\nb\nc\n")
    monkeypatch.setattr(ignore, "MAX_IGNORE_PATTERNS", 5)
    with pytest.raises(LimitExceeded) as limit:
        walk(tree_ws, gitignore=True, max_entries=100000)
    assert limit.value.data["scope"] == "gitignore_patterns"
    with pytest.raises(InvalidParams) as bad:
        walk(tree_ws, exclude=["!negated"])
    assert bad.value.data["path"] == "$.exclude"


def test_git_internals_are_never_subject_to_ignore_rules(tree_ws: Workspace, tree: Path) -> None:
    (tree / ".gitignore").write_text("HEAD\n.git\n")
    (tree / "HEAD").write_text("a file named HEAD\n")
    kept = walk(tree_ws, gitignore=True, include_git=True, max_entries=100000)
    assert "HEAD" not in kept
    assert ".git" in kept and ".git/HEAD" in kept
