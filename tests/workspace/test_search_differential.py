"""`fs.search`'s fused walk and RE2 calls (`substrate.workspace.search._Scan`) against the
loop they replaced (`tests.harness.search_reference`), on random trees: random names
(also not UTF-8, temp files, `.git`), nested directories, binary files, symlinks that
must not be followed, `read_deny`, `glob`, `exclude`, `.gitignore`, small `max_matches`;
patterns with literals, alternations, classes, digit runs (the strided screen),
anchors, case folding, fixed strings and lookarounds (the backtracking matcher). Every result must be identical, and so must the
search shared with a worker process (`search_pool`), handed off at a random file."""

from __future__ import annotations

import inspect
import itertools
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from substrate.errors import InvalidParams
from substrate.schema.fs import SearchParams
from substrate.schema.workspace import Policy
from substrate.workspace import search as search_module
from substrate.workspace import search_split
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.search_pool import SearchPool
from substrate.workspace.writes.temp_files import TEMP_PREFIX
from tests.harness.search_reference import reference_search

WS = "ws_test"
_FRESH = itertools.count()

WORDS = ["foo", "Foo", "FOO", "bar", "baz", "def", "x_handler(", "Error(", "123456", "é", "\t"]
WORDS += ["12", "AB7"]
_NAMES = st.sampled_from(
    ["a", "b.py", "c.txt", "k.pem", "Z", "é.md", ".git", ".hidden", "n\udcff", TEMP_PREFIX + "t"]
)
_LINE = st.lists(st.sampled_from([*WORDS, " ", "  ", "a", "0"]), max_size=8).map("".join)
_TEXT = st.lists(_LINE, max_size=12).map(lambda lines: "\n".join(lines).encode())
_CONTENT = st.one_of(
    _TEXT,
    _TEXT.map(lambda t: t + b"\n"),
    _TEXT.map(lambda t: b"\x00" + t),  # binary: a NUL in the first 8 KiB
    _TEXT.map(lambda t: b"foo" + b"z" * 8200 + b"\x00" + t),  # a NUL past the sniff
    st.just(b""),
    _TEXT.map(lambda t: t.replace(b"\n", b"\r\n")),
)

PATTERNS = st.one_of(
    st.sampled_from(
        [
            "foo",
            "foo|bar",
            "(foo|baz)+",
            "^def",
            "bar$",
            "^$",
            r"\bFoo\b",
            r"[A-Z][a-z]+Error\(",
            r"def \w+_handler\(",
            r"[0-9]{5}",
            r"\d{3,}",
            r"\b[0-9]{2}\b",
            r"[A-Z]{2}\d",
            r"[0-9]{2}$",
            r"x_handler\(|Error\(",
            r"foo\s+bar",
            "a.*b",
            "(?s)foo.bar",
            r"\B",
            "é",
            "foo(?=bar)",
            "(?<!x)bar",
            r"(foo)\1",
            "(?i:foo)bar",
            "[^a-z]",
            r"\d+\Z",
            "o{2}",
            " {2}",
            "fo+",
            "x_handler(",
        ]
    ),
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map("|".join),
    st.lists(st.sampled_from([*WORDS, ".", "+", "*", "?", "^", "$", "|", "[a-z]"]), max_size=4).map(
        "".join
    ),
)


@st.composite
def trees(draw: Any) -> list[tuple[str, str, Any]]:
    """(kind, relative path, payload) entries: files, dirs, symlinks (payload: target)."""
    entries: list[tuple[str, str, Any]] = []
    dirs = [""]
    for _ in range(draw(st.integers(1, 14))):
        parent = draw(st.sampled_from(dirs))
        name = draw(_NAMES)
        rel = f"{parent}/{name}" if parent else name
        if any(e[1] == rel for e in entries):
            continue
        kind = draw(st.sampled_from(["file", "file", "file", "dir", "link"]))
        if kind == "dir":
            dirs.append(rel)
            entries.append(("dir", rel, None))
        elif kind == "file":
            entries.append(("file", rel, draw(_CONTENT)))
        else:
            entries.append(("link", rel, draw(st.sampled_from(["a", "..", "../..", "/etc"]))))
    return entries


def _build(base: Path, entries: list[tuple[str, str, Any]]) -> None:
    base.mkdir()
    for kind, rel, payload in entries:
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            path.mkdir(exist_ok=True)
        elif kind == "file":
            path.write_bytes(payload)
        else:
            path.symlink_to(payload)
        os.lchown(path, *_owner(base))


def _owner(base: Path) -> tuple[int, int]:
    st_ = os.stat(base.parent)
    return st_.st_uid, st_.st_gid


@pytest.fixture
def dws(registry: WorkspaceRegistry, make_workspace: Callable[..., Path]) -> Workspace:
    """A workspace whose `read_deny` holds a file glob and a directory glob."""
    path = make_workspace("differential", {"top.txt": "foo\n"})
    return registry.adopt(str(path), None, Policy(read_deny=["**/*.pem", "**/Z"]), "agent:0")


@pytest.fixture(scope="module")
def pool() -> Iterator[SearchPool]:
    pool = SearchPool(restart_pause_s=0, spare=lambda: True)
    assert pool.wait_ready(60)
    yield pool
    pool.close()


def _run(fn: Any, ws: Workspace, params: SearchParams) -> Any:
    try:
        return fn(ws, params, search_module.matcher(params))
    except InvalidParams as exc:
        return ("invalid_params", exc.message)


def _both(ws: Workspace, params: SearchParams) -> tuple[Any, Any]:
    return _run(search_module.search, ws, params), _run(reference_search, ws, params)


def _shared(pool: SearchPool, ws: Workspace, params: SearchParams, hand_off: int) -> Any:
    """`pool.search`, handing off at the file of index `hand_off` (or the file past
    the first `hand_off` bytes scanned)."""
    saved = search_split.HAND_OFF_FILES, search_split.HAND_OFF_BYTES
    search_split.HAND_OFF_FILES, search_split.HAND_OFF_BYTES = hand_off, 1 << 30
    try:
        return _run(pool.search, ws, params)
    finally:
        search_split.HAND_OFF_FILES, search_split.HAND_OFF_BYTES = saved


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    entries=trees(),
    pattern=PATTERNS,
    ignore_case=st.booleans(),
    fixed=st.booleans(),
    max_matches=st.sampled_from([1, 2, 5, 1000]),
    glob=st.sampled_from([None, "*.py", "**/*.txt", "a", "b.py"]),
    exclude=st.sampled_from([[], ["Z"], ["*.md", "a/**"]]),
    gitignore=st.booleans(),
    ignored=st.sampled_from([None, "*.txt\n", "a/\n!b.py\n"]),
    hand_off=st.sampled_from([0, 1, 2, 3]),
)
def test_fused_search_equals_the_reference(
    dws: Workspace,
    pool: SearchPool,
    entries: list[tuple[str, str, Any]],
    pattern: str,
    ignore_case: bool,
    fixed: bool,
    max_matches: int,
    glob: str | None,
    exclude: list[str],
    gitignore: bool,
    ignored: str | None,
    hand_off: int,
) -> None:
    ws = dws
    name = f"t{next(_FRESH)}"
    base = Path(ws.host_path) / name
    _build(base, entries)
    if ignored is not None:
        (base / ".gitignore").write_text(ignored)
    try:
        params = SearchParams(
            workspace=WS,
            pattern=pattern,
            path=name,
            ignore_case=ignore_case,
            fixed=fixed,
            max_matches=max_matches,
            glob=glob,
            exclude=exclude,
            gitignore=gitignore,
        )
        ours, theirs = _both(ws, params)
        assert ours == theirs
        assert _shared(pool, ws, params, hand_off) == ours
        assert pool.failed == 0
    finally:
        shutil.rmtree(base)


def test_the_differential_sees_matches_symlinks_and_truncation(
    ws: Workspace, root: Path, pool: SearchPool
) -> None:
    """The random trees above reach what they are for: matches through the RE2, literal
    and backtracking paths, truncation, and symlinked files and dirs never searched;
    and the worker process shares these searches."""
    _build(
        root / "fixed",
        [
            ("dir", "d", None),
            ("file", "d/a.py", b"def x_handler(\nfoo bar\nFOO\n"),
            ("file", "d/k.pem", b"foo\n"),
            ("file", "d/b.bin", b"\x00foo\n"),
            ("link", "d/via", "a.py"),
            ("link", "up", "d"),
        ],
    )
    seen = {}
    for pattern in ["foo", r"def \w+_handler\(", "[0-9]{5}|foo", "foo(?= bar)"]:
        params = SearchParams(workspace=WS, pattern=pattern, path="fixed", ignore_case=True)
        ours, theirs = _both(ws, params)
        assert ours == theirs
        seen[pattern] = [(m.path, m.line) for m in ours.matches]
    assert seen["foo"] == [("fixed/d/a.py", 2), ("fixed/d/a.py", 3)]
    assert seen[r"def \w+_handler\("] == [("fixed/d/a.py", 1)]
    assert seen["[0-9]{5}|foo"] == seen["foo"]
    assert seen["foo(?= bar)"] == [("fixed/d/a.py", 2)]
    params = SearchParams(workspace=WS, pattern="o", path="fixed", max_matches=1)
    ours, theirs = _both(ws, params)
    assert ours == theirs and ours.truncated and ours.files_scanned == 1
    shared = pool.shared
    for pattern in ["foo", r"def \w+_handler\(", "[0-9]{5}|foo", "o"]:
        params = SearchParams(workspace=WS, pattern=pattern, path=".", ignore_case=True)
        assert _shared(pool, ws, params, 0) == _both(ws, params)[0]
    assert pool.shared == shared + 4


def test_a_tree_deeper_than_the_recursion_limit(dws: Workspace) -> None:
    """The walk holds its own stack: searched under a recursion limit a few dozen frames
    above this test's, a tree 200 directories deep is searched whole."""
    depth = 200
    fd = os.open(dws.host_path, os.O_RDONLY | os.O_DIRECTORY)
    uid, gid = os.stat(dws.host_path).st_uid, os.stat(dws.host_path).st_gid
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            os.chown("d", uid, gid, dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"deep foo\n")
        os.close(leaf)
    finally:
        os.close(fd)
    params = SearchParams(workspace=WS, pattern="foo", path="d")
    frames = len(inspect.stack(0))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(frames + 60)
    try:
        ours = search_module.search(dws, params)
    finally:
        sys.setrecursionlimit(limit)
    theirs = reference_search(dws, params)
    assert ours == theirs
    assert [m.path.count("/") for m in ours.matches] == [depth]
