"""Passthrough directories of a "layer" profile: declaration checks at profile load,
the policy check at sandbox creation, and which of them a generation binds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from substrate.errors import PathDenied
from substrate.layer.mounts import passthrough
from substrate.sandbox.profiles import ProfileError, load_profile
from substrate.schema.workspace import Policy
from substrate.workspace.policy import compile_policy

ROOT = Path(__file__).resolve().parents[3]
SECCOMP = ROOT / "seccomp"
LAYER = """\
description = "test"
workspace = "layer"
seccomp = "strict"
"""


def _load(tmp_path: Path, line: str) -> list[str]:
    path = tmp_path / "x.toml"
    path.write_text(LAYER + line + "\n")
    return load_profile(path, SECCOMP).passthrough


def test_a_layer_profile_declares_passthrough_dirs(tmp_path: Path) -> None:
    assert _load(tmp_path, 'passthrough = ["node_modules", ".venv", "build/out"]') == [
        "node_modules",
        ".venv",
        "build/out",
    ]
    assert _load(tmp_path, "") == []


@pytest.mark.parametrize(
    ("line", "where", "why"),
    [
        ('passthrough = ["/abs"]', "$.passthrough[0]", "relative path"),
        ('passthrough = ["a//b"]', "$.passthrough[0]", "relative path"),
        ('passthrough = ["a/"]', "$.passthrough[0]", "relative path"),
        ('passthrough = [""]', "$.passthrough[0]", "relative path"),
        ('passthrough = ["a/../b"]', "$.passthrough[0]", ". or .."),
        ('passthrough = ["."]', "$.passthrough[0]", ". or .."),
        ('passthrough = ["a b"]', "$.passthrough[0]", "relative path"),
        ('passthrough = ["a,b"]', "$.passthrough[0]", "relative path"),
        ('passthrough = [".git"]', "$.passthrough[0]", ".git"),
        ('passthrough = ["sub/.git/x"]', "$.passthrough[0]", ".git"),
        ('passthrough = ["a", "a/b"]', "$.passthrough[1]", "overlaps passthrough[0]"),
        ('passthrough = ["a/b", "a"]', "$.passthrough[1]", "overlaps passthrough[0]"),
        ('passthrough = ["a", "a"]', "$.passthrough[1]", "overlaps passthrough[0]"),
        (f"passthrough = {[f'd{i}' for i in range(17)]}", "$.passthrough", "at most 16"),
    ],
)
def test_bad_passthrough_is_refused(tmp_path: Path, line: str, where: str, why: str) -> None:
    with pytest.raises(ProfileError) as info:
        _load(tmp_path, line)
    assert f": {where}: " in str(info.value) and why in str(info.value), str(info.value)


def test_passthrough_needs_a_layer_workspace(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text(LAYER.replace('"layer"', '"rw"') + 'passthrough = ["node_modules"]\n')
    with pytest.raises(ProfileError, match=r"\$\.passthrough: .*layer"):
        load_profile(path, SECCOMP)


@pytest.mark.parametrize(
    "policy",
    [
        Policy(),
        Policy(write_deny=[".git/**", "secrets/**", "/build/keep/**"]),
        Policy(write_deny=["node_modules_old/**", "src/*.lock"]),
        Policy(write_allow=["node_modules", "build/**"]),
        Policy(require_approval=["/src/**"]),
    ],
)
def test_a_policy_that_allows_all_beneath_accepts(policy: Policy) -> None:
    passthrough.check_policy(compile_policy(policy), ["node_modules", "build/out"])


@pytest.mark.parametrize(
    "policy",
    [
        Policy(write_deny=["node_modules/**"]),  # the dir itself
        Policy(write_deny=["node_modules/.bin/**"]),  # something beneath it
        Policy(write_deny=["/node_modules/*/x"]),
        Policy(write_deny=["**/cache"]),
        Policy(write_deny=["*.pem"]),  # a name at any depth
        Policy(write_deny=["build/"]),  # a parent of build/out
        Policy(write_deny=["build/o*"]),
        Policy(write_allow=["src/**"]),  # not allowed at all
        Policy(require_approval=["node_modules/**"]),
        Policy(require_approval=["/build/out/x"]),
    ],
)
def test_a_policy_that_may_deny_beneath_refuses(policy: Policy) -> None:
    with pytest.raises(PathDenied):
        passthrough.check_policy(compile_policy(policy), ["node_modules", "build/out"])


def test_only_real_directories_are_bound(tmp_path: Path) -> None:
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "out").write_text("a file\n")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    (tmp_path / "via").symlink_to(".")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = passthrough.existing(
            root, ["node_modules", "build/out", "link", "via/real", "missing", "real"]
        )
    finally:
        os.close(root)
    st = (tmp_path / "node_modules").stat()
    rst = (tmp_path / "real").stat()
    assert found == [("node_modules", (st.st_dev, st.st_ino)), ("real", (rst.st_dev, rst.st_ino))]
