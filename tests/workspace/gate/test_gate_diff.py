"""substrate.workspace.gate.diff and the gate's matcher: pure, no file system.

Snapshots here are plain mappings of paths to `Node`s, as the walk would record them.
"""

from __future__ import annotations

import os

import pytest

from substrate.schema.workspace import Policy
from substrate.workspace.gate import Matcher, Node, classify, diff, display_rel
from substrate.workspace.policy import compile_policy

OWNER = 1000
DENY = ["*.lock", ".env", "secrets/*.pem", "build/"]


def node(kind: str = "file", mode: int = 0o644, sha: str | None = "a", ino: int = 1) -> Node:
    return Node(
        kind=kind,  # type: ignore[arg-type]
        mode=mode,
        uid=OWNER,
        gid=OWNER,
        size=1,
        mtime_ns=1,
        ctime_ns=1,
        dev=1,
        ino=ino,
        sha256=sha,
    )


def test_classify() -> None:
    assert classify(None, None) is None
    assert classify(None, node()) == "create"
    assert classify(node(), None) == "delete"
    assert classify(node(), node(ino=2)) is None  # same bytes and mode: no change
    assert classify(node(), node(sha="b")) == "modify"
    assert classify(node(), node(mode=0o755)) == "chmod"
    assert classify(node(), node("symlink")) == "modify"
    assert classify(node("dir", sha=None), node("dir", 0o700, sha=None)) == "chmod"
    assert classify(node("symlink", 0o777), node("symlink", 0o777, sha="b")) == "modify"


def test_diff_folds_beneath_created_and_deleted_dirs() -> None:
    before = {"old": node("dir", sha=None), "old/a.pem": node(), "x.lock": node()}
    after = {"new": node("dir", sha=None), "new/b": node(), "new/c/d": node(), "x.lock": node()}
    assert diff(before, after) == [("new", "create"), ("old", "delete")]
    assert diff(before, before) == []


@pytest.mark.parametrize(
    ("rel", "denied"),
    [
        ("poetry.lock", True),
        ("a/b/Cargo.lock", True),
        (".env", True),
        ("sub/.env", True),
        (".envrc", False),
        ("secrets/k.pem", True),
        ("other/secrets/k.pem", False),
        ("secrets/k.txt", False),
        ("build", True),
        ("src/main.py", False),
    ],
)
def test_matcher(rel: str, denied: bool) -> None:
    assert Matcher.of(DENY).denied(rel) is denied
    assert compile_policy(Policy(write_deny=DENY)).write_deny.matches(rel) is denied


def test_display_rel_escapes_only_what_is_not_utf8() -> None:
    assert display_rel("src/é.lock") == "src/é.lock"
    assert display_rel(os.fsdecode(b"d\xff/\xfe.lock")) == "d\\xff/\\xfe.lock"
