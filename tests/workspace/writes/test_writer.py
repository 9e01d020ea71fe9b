"""substrate.workspace.writes.writer in-process: plans, digests, atomic apply, owners and
modes, the journal."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.config import Config
from substrate.errors import (
    AlreadyExists,
    ApprovalRequired,
    InvalidParams,
    NotAFile,
    NotFound,
    PatchConflict,
    PathDenied,
    PathInvalid,
    PlanMismatch,
    Refusal,
    StaleBase,
    SymlinkRefused,
    UnknownWorkspace,
)
from substrate.schema.fs import (
    BytesContent,
    DeleteParams,
    Edit,
    Edits,
    PatchParams,
    Plan,
    TextContent,
    UnifiedDiff,
    WriteParams,
    patch_request,
    write_request,
)
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import writes
from substrate.workspace.registry import TEMP_PREFIX, Workspace, WorkspaceRegistry
from substrate.workspace.writes import Writer, writer

WS = "ws_test"
ACTOR = "agent:0"
FILES: dict[str, str | bytes] = {
    "README.md": "# demo\n\nhello\n",
    "src/main.py": "def main() -> None:\n    print('hello')\n",
    "src/util.py": "VALUE = 1\n",
    "ci/deploy.yml": "steps: []\n",
}


@dataclass
class Env:
    root: Path
    ws: Workspace
    writer: Writer
    store: Store
    journal: Journal
    registry: WorkspaceRegistry

    def write(self, path: str, content: str | None, base: str | None, **kw: Any) -> Plan:
        p = WriteParams(workspace=WS, path=path, content=content, base_sha256=base, **kw)
        return self.writer.write(self.ws, write_request(p), ACTOR)

    def patch(self, path: str, base: str, **kw: Any) -> Plan:
        p = PatchParams(workspace=WS, path=path, base_sha256=base, **kw)
        return self.writer.patch(self.ws, patch_request(p), ACTOR)

    def delete(self, path: str, base: str, **kw: Any) -> Plan:
        p = DeleteParams(workspace=WS, path=path, base_sha256=base, **kw)
        return self.writer.delete(self.ws, p, ACTOR)

    def sha(self, rel: str) -> str:
        return hashlib.sha256((self.root / rel).read_bytes()).hexdigest()

    def write_entries(self) -> list[Any]:
        return [e for e in self.journal.read(limit=10000) if e.kind.startswith("fs.")]


def open_env(adopt_root: Path, state: Path, root: Path, policy: Policy | None) -> Env:
    state.mkdir(mode=0o700, exist_ok=True)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, state)
    ws = registry.adopt(str(root), None, policy, ACTOR)
    return Env(root, ws, Writer(store, journal), store, journal, registry)


@pytest.fixture
def policy() -> Policy | None:
    return Policy(require_approval=["ci/**"])


@pytest.fixture
def env(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path], policy: Policy | None
) -> Iterator[Env]:
    root = make_workspace("demo", FILES, git=True)
    e = open_env(adopt_root, tmp_path / "state", root, policy)
    try:
        yield e
    finally:
        e.registry.close()
        e.store.close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def temp_files(root: Path) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(root)
        for n in dirs + files
        if n.startswith(TEMP_PREFIX)
    ]


# --- the plan digest ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "base", "new", "mode"),
    [
        ("create", None, "b" * 64, 0o644),
        ("replace", "a" * 64, "b" * 64, 0o755),
        ("delete", "a" * 64, None, None),
    ],
)
def test_plan_digest_formula(op: Any, base: str | None, new: str | None, mode: int | None) -> None:
    canonical = json.dumps(["demo", "src/a.py", op, base, new, mode], separators=(",", ":"))
    expected = hashlib.sha256(canonical.encode()).hexdigest()
    assert writes.plan_digest("demo", "src/a.py", op, base, new, mode) == expected


def test_plan_digest_binds_every_field() -> None:
    base: list[Any] = ["demo", "a", "replace", "1" * 64, "2" * 64, 0o644]
    digests = {writes.plan_digest(*base)}
    for i, other in enumerate(["other", "b", "create", "3" * 64, "4" * 64, 0o600]):
        changed = list(base)
        changed[i] = other
        digests.add(writes.plan_digest(*changed))
    assert len(digests) == 7


def test_plan_carries_the_digest_of_its_fields(env: Env) -> None:
    base = env.sha("src/util.py")
    plan = env.write("src/util.py", "VALUE = 2\n", base, dry_run=True)
    assert plan.path == "demo:src/util.py"
    assert (plan.op, plan.base_sha256, plan.new_sha256) == ("replace", base, sha(b"VALUE = 2\n"))
    assert (plan.size, plan.mode, plan.applied) == (10, 0o644, False)
    assert plan.plan_digest == writes.plan_digest(
        "demo", "src/util.py", "replace", base, sha(b"VALUE = 2\n"), 0o644
    )
    assert "-VALUE = 1" in plan.diff and "+VALUE = 2" in plan.diff
    assert not plan.diff_truncated


# --- dry runs, digests, approvals ---------------------------------------------------------------


def test_dry_run_changes_nothing(env: Env, snapshot_tree: Callable[[Path], dict[str, Any]]) -> None:
    before = snapshot_tree(env.root)
    journal_before = env.journal.read(limit=1000)
    edits = [Edit(old="hello", new="bye")]
    plans = [
        env.write("src/util.py", "x\n", env.sha("src/util.py"), dry_run=True),
        env.write("new/dir/file.txt", "x\n", None, create_parents=True, dry_run=True),
        env.patch("src/main.py", env.sha("src/main.py"), edits=edits, dry_run=True),
        env.delete("README.md", env.sha("README.md"), dry_run=True),
        env.write("ci/deploy.yml", "steps: [x]\n", env.sha("ci/deploy.yml"), dry_run=True),
    ]
    assert not any(p.applied for p in plans)
    assert snapshot_tree(env.root) == before
    assert env.journal.read(limit=1000) == journal_before


def test_the_dry_run_digest_applies(env: Env) -> None:
    base = env.sha("src/util.py")
    plan = env.write("src/util.py", "VALUE = 3\n", base, dry_run=True)
    applied = env.write("src/util.py", "VALUE = 3\n", base, plan_digest=plan.plan_digest)
    assert applied.applied and applied.plan_digest == plan.plan_digest
    assert (env.root / "src" / "util.py").read_text() == "VALUE = 3\n"


def test_plan_mismatch(env: Env) -> None:
    base = env.sha("src/util.py")
    plan = env.write("src/util.py", "VALUE = 3\n", base, dry_run=True)
    with pytest.raises(PlanMismatch) as info:
        env.write("src/util.py", "VALUE = 4\n", base, plan_digest=plan.plan_digest)
    assert info.value.data["plan_digest"] != plan.plan_digest
    with pytest.raises(PlanMismatch):
        env.write("src/util.py", "VALUE = 3\n", base, mode=0o600, plan_digest=plan.plan_digest)
    assert (env.root / "src" / "util.py").read_text() == "VALUE = 1\n"
    assert temp_files(env.root) == []


def test_approval_required_then_consumed(env: Env) -> None:
    base = env.sha("ci/deploy.yml")
    plan = env.write("ci/deploy.yml", "steps: [deploy]\n", base, dry_run=True)
    with pytest.raises(ApprovalRequired) as info:
        env.write("ci/deploy.yml", "steps: [deploy]\n", base)
    assert info.value.data == {"plan_digest": plan.plan_digest}
    assert (env.root / "ci" / "deploy.yml").read_text() == "steps: []\n"
    approval_id, _ = env.registry.grant_approval(env.ws, plan.plan_digest, 60, "operator:0")
    applied = env.write("ci/deploy.yml", "steps: [deploy]\n", base)
    assert applied.applied
    rows = env.store.query("SELECT used FROM approvals WHERE id = ?", (approval_id,))
    assert rows[0]["used"] is not None
    assert env.write_entries()[-1].data["approval_id"] == approval_id
    # Used up: another change of that path needs another approval.
    with pytest.raises(ApprovalRequired):
        env.write("ci/deploy.yml", "steps: []\n", env.sha("ci/deploy.yml"))
    assert temp_files(env.root) == []


def test_approval_for_another_digest_does_not_count(env: Env) -> None:
    base = env.sha("ci/deploy.yml")
    other = env.write("ci/deploy.yml", "other\n", base, dry_run=True)
    env.registry.grant_approval(env.ws, other.plan_digest, 60, "operator:0")
    with pytest.raises(ApprovalRequired):
        env.write("ci/deploy.yml", "mine\n", base)


# --- create / replace / delete ------------------------------------------------------------------


def test_create(env: Env) -> None:
    plan = env.write("src/new.py", "NEW = True\n", None)
    assert (plan.op, plan.base_sha256, plan.applied, plan.mode) == ("create", None, True, 0o644)
    path = env.root / "src" / "new.py"
    assert path.read_text() == "NEW = True\n"
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert (st.st_uid, st.st_gid) == (1000, 1000)  # the workspace root's owner, not root


def test_create_with_mode_ignores_the_umask(env: Env) -> None:
    old = os.umask(0o077)
    try:
        env.write("script.sh", "#!/bin/sh\n", None, mode=0o750)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(env.root / "script.sh").st_mode) == 0o750


def test_create_in_a_dir_of_another_owner_gets_the_workspace_owner(env: Env) -> None:
    os.chown(env.root / "src", 1234, 1234)
    env.write("src/new.py", "x\n", None)
    st = os.lstat(env.root / "src" / "new.py")
    assert (st.st_uid, st.st_gid) == (1000, 1000)


def test_create_over_an_existing_file(env: Env) -> None:
    with pytest.raises(AlreadyExists):
        env.write("README.md", "x", None)
    assert (env.root / "README.md").read_text() == "# demo\n\nhello\n"


def test_create_parents(env: Env) -> None:
    with pytest.raises(NotFound):
        env.write("a/b/c.txt", "deep\n", None)
    assert not (env.root / "a").exists()
    env.write("a/b/c.txt", "deep\n", None, create_parents=True)
    assert (env.root / "a" / "b" / "c.txt").read_text() == "deep\n"
    for d in (env.root / "a", env.root / "a" / "b"):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755
        assert (st.st_uid, st.st_gid) == (1000, 1000)
    env.write("a/b2/c.txt", "x", None, create_parents=True)  # part of it exists already
    assert (env.root / "a" / "b2" / "c.txt").read_text() == "x"


def test_create_parents_never_through_a_symlink(env: Env, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (env.root / "out").symlink_to(outside)
    with pytest.raises(SymlinkRefused):
        env.write("out/x/y.txt", "x", None, create_parents=True)
    with pytest.raises(SymlinkRefused):
        env.write("out/y.txt", "x", None, create_parents=True)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("mode", [0o600, 0o755, 0o640])
def test_replace_keeps_mode(env: Env, mode: int) -> None:
    path = env.root / "src" / "util.py"
    os.chmod(path, mode)
    plan = env.write("src/util.py", "VALUE = 2\n", env.sha("src/util.py"))
    assert plan.mode == mode
    assert stat.S_IMODE(os.lstat(path).st_mode) == mode


@pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o6755])
def test_replace_drops_set_id_bits(env: Env, mode: int) -> None:
    # New bytes from an agent must never inherit a set-uid/set-gid bit (nor be given one).
    path = env.root / "src" / "util.py"
    os.chmod(path, mode)
    plan = env.write("src/util.py", "VALUE = 2\n", env.sha("src/util.py"))
    assert plan.mode == 0o755
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o755


@pytest.mark.parametrize("owner", [(1000, 1000), (1234, 4321)])
def test_replace_keeps_owner(env: Env, owner: tuple[int, int]) -> None:
    path = env.root / "src" / "util.py"
    os.chown(path, *owner)
    env.write("src/util.py", "VALUE = 2\n", env.sha("src/util.py"))
    st = os.lstat(path)
    assert (st.st_uid, st.st_gid) == owner


def test_replace_with_a_new_mode(env: Env) -> None:
    plan = env.write("src/util.py", "VALUE = 2\n", env.sha("src/util.py"), mode=0o700)
    assert plan.mode == 0o700
    assert stat.S_IMODE(os.lstat(env.root / "src" / "util.py").st_mode) == 0o700


def test_replace_is_a_new_inode_and_leaves_no_temp(env: Env) -> None:
    path = env.root / "src" / "util.py"
    before = os.lstat(path).st_ino
    env.write("src/util.py", "VALUE = 2\n", env.sha("src/util.py"))
    assert os.lstat(path).st_ino != before
    assert temp_files(env.root) == []


def test_stale_base(env: Env) -> None:
    with pytest.raises(StaleBase) as info:
        env.write("src/util.py", "x", "0" * 64)
    assert info.value.data == {"current_sha256": env.sha("src/util.py")}
    with pytest.raises(StaleBase) as info:
        env.write("absent.txt", "x", "0" * 64)
    assert info.value.data == {"current_sha256": None}


def test_content_b64(env: Env) -> None:
    data = bytes(range(256))
    b64 = base64.b64encode(data).decode()
    p = WriteParams(workspace=WS, path="blob.bin", base_sha256=None, content_b64=b64)
    plan = env.writer.write(env.ws, write_request(p), ACTOR)
    assert plan.new_sha256 == sha(data)
    assert (env.root / "blob.bin").read_bytes() == data


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({}, "$.content"),
        ({"content": "x", "content_b64": "eA=="}, "$.content"),
        ({"content_b64": "not base64!"}, "$.content_b64"),
    ],
)
def test_content_fields(env: Env, fields: dict[str, Any], path: str) -> None:
    p = WriteParams(workspace=WS, path="x.txt", base_sha256=None, **fields)
    with pytest.raises(InvalidParams) as info:
        env.writer.write(env.ws, write_request(p), ACTOR)
    assert info.value.data["path"] == path
    assert not (env.root / "x.txt").exists()


def test_delete(env: Env) -> None:
    base = env.sha("README.md")
    with pytest.raises(StaleBase):
        env.delete("README.md", "0" * 64)
    plan = env.delete("README.md", base)
    assert (plan.op, plan.new_sha256, plan.mode, plan.size) == ("delete", None, None, 0)
    assert plan.applied
    assert plan.plan_digest == writes.plan_digest("demo", "README.md", "delete", base, None, None)
    assert not (env.root / "README.md").exists()
    with pytest.raises(NotFound):
        env.delete("README.md", base)


def test_targets_that_are_not_files(env: Env, tmp_path: Path) -> None:
    outside = tmp_path / "target.txt"
    outside.write_text("outside\n")
    (env.root / "link").symlink_to(outside)
    os.mkfifo(env.root / "fifo")
    with pytest.raises(SymlinkRefused):
        env.write("link", "x", sha(b"outside\n"))
    with pytest.raises(SymlinkRefused):
        env.delete("link", sha(b"outside\n"))
    with pytest.raises(NotAFile):
        env.write("src", "x", None)
    with pytest.raises(NotAFile):
        env.write("fifo", "x", None)
    assert outside.read_text() == "outside\n"
    assert (env.root / "link").is_symlink()


@pytest.mark.parametrize(
    "policy", [Policy(write_deny=["*.lock"], write_allow=["src/**", "*.lock"])]
)
def test_policy_refusals(env: Env) -> None:
    with pytest.raises(PathDenied):
        env.write(".git/config", "[core]\n", env.sha(".git/config"))
    with pytest.raises(PathDenied):
        env.write("src/deps.lock", "x", None)
    with pytest.raises(PathDenied):
        env.write("README.md", "x", env.sha("README.md"))  # not in write_allow
    assert env.write("src/ok.py", "x", None).applied
    assert temp_files(env.root) == []


# --- git directories by content, and misleading names (docs/confinement.md) -------------------


def _pieces(root: Path, rel: str, *names: str) -> None:
    """The host makes git-dir pieces in `rel`: `HEAD` a file, the rest directories."""
    for name in names:
        if name == "HEAD":
            (root / rel).mkdir(parents=True, exist_ok=True)
            (root / rel / "HEAD").write_text("ref: refs/heads/main\n")
        else:
            (root / rel / name).mkdir(parents=True, exist_ok=True)


def test_a_write_that_completes_a_git_dir_is_refused(env: Env) -> None:
    _pieces(env.root, "tools", "objects", "refs")
    with pytest.raises(PathDenied) as caught:
        env.write("tools/HEAD", "ref: refs/heads/main\n", None)
    assert caught.value.data == {"reason": "git_dir", "git_dir": "tools"}
    assert not (env.root / "tools" / "HEAD").exists()
    # A missing parent the write would make counts too (`refs` made by create_parents).
    _pieces(env.root, "lib", "HEAD", "objects")
    with pytest.raises(PathDenied) as caught:
        env.write("lib/refs/heads/x", "0" * 40, None, create_parents=True)
    assert caught.value.data["reason"] == "git_dir"
    assert not (env.root / "lib" / "refs").exists()
    # An incomplete one is an ordinary directory: its config is only a file.
    assert env.write("lib/config", "[core]\n", None).applied
    assert temp_files(env.root) == []


def test_nothing_is_written_or_deleted_beneath_a_git_dir_by_content(env: Env) -> None:
    # `git init --separate-git-dir=gitstore`: the real git dir under another name.
    (env.root / ".git").rename(env.root / "gitstore")
    (env.root / ".git").write_text("gitdir: gitstore\n")
    (env.root / "gitstore" / "hooks").mkdir(exist_ok=True)
    (env.root / "gitstore" / "config").write_text("[core]\n")
    for path in ("gitstore/hooks/post-checkout", "gitstore/objects/ab/cd"):
        with pytest.raises(PathDenied) as caught:
            env.write(path, "#!/bin/sh\ntouch /tmp/owned\n", None, create_parents=True)
        assert caught.value.data["git_dir"] == "gitstore"
    config = env.sha("gitstore/config")
    with pytest.raises(PathDenied):
        env.write("gitstore/config", "[core]\n\tfsmonitor = touch x\n", config)
    with pytest.raises(PathDenied):
        env.patch("gitstore/config", config, edits=[Edit(old="[core]", new="[core]\n x=1")])
    with pytest.raises(PathDenied):
        env.delete("gitstore/HEAD", env.sha("gitstore/HEAD"))
    assert (env.root / "gitstore" / "config").read_text() == "[core]\n"
    assert not (env.root / "gitstore" / "hooks" / "post-checkout").exists()


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("a\nb.txt", "control_character"),
        ("tab\there", "control_character"),
        ("del\x7f", "control_character"),
        ("c1\x85", "control_character"),
        ("invoice\u202etxt.exe", "bidi_control"),
        ("mark\u200f", "bidi_control"),
        ("iso\u2067x", "bidi_control"),
        ("arabic\u061c", "bidi_control"),
    ],
)
def test_new_names_with_control_characters_are_refused(env: Env, name: str, reason: str) -> None:
    with pytest.raises(PathInvalid) as caught:
        env.write(name, "x", None)
    assert caught.value.data["reason"] == reason
    with pytest.raises(PathInvalid):  # a directory the write would make, too
        env.write(f"{name}/f", "x", None, create_parents=True)
    assert sorted(os.listdir(env.root)) == sorted(["README.md", "src", "ci", ".git"])


def test_a_file_that_already_has_such_a_name_stays_writable(env: Env) -> None:
    (env.root / "old\nname").write_text("host\n")
    plan = env.write("old\nname", "agent\n", env.sha("old\nname"))
    assert plan.applied and (env.root / "old\nname").read_text() == "agent\n"
    assert env.delete("old\nname", plan.new_sha256 or "").applied


# --- patch ------------------------------------------------------------------------------------


def test_patch_edits(env: Env) -> None:
    base = env.sha("src/main.py")
    edits = [Edit(old="hello", new="goodbye"), Edit(old="main", new="run")]
    plan = env.patch("src/main.py", base, edits=edits)
    assert plan.applied and plan.op == "replace"
    text = (env.root / "src" / "main.py").read_text()
    assert text == "def run() -> None:\n    print('goodbye')\n"
    assert plan.new_sha256 == sha(text.encode())
    assert env.write_entries()[-1].kind == "fs.patch"


def test_patch_unified_diff(env: Env) -> None:
    diff = (
        "--- a/src/main.py\n+++ b/src/main.py\n@@ -1,2 +1,3 @@\n"
        " def main() -> None:\n-    print('hello')\n+    print('hi')\n+    return None\n"
    )
    env.patch("src/main.py", env.sha("src/main.py"), unified_diff=diff)
    assert (env.root / "src" / "main.py").read_text() == (
        "def main() -> None:\n    print('hi')\n    return None\n"
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"edits": [Edit(old="absent", new="x")]},
        {"edits": [Edit(old="e", new="x")]},  # occurs more than once, count=1
        {"edits": [Edit(old="hello", new="x"), Edit(old="hello", new="y")]},
        {"unified_diff": "@@ -1,1 +1,1 @@\n-def other():\n+def x():\n"},
        {"unified_diff": "@@ -5,1 +5,1 @@\n-x\n+y\n"},
    ],
)
def test_patch_conflict_changes_nothing(
    env: Env, kw: dict[str, Any], snapshot_tree: Callable[[Path], dict[str, Any]]
) -> None:
    before = snapshot_tree(env.root)
    entries = env.write_entries()
    with pytest.raises(PatchConflict):
        env.patch("src/main.py", env.sha("src/main.py"), **kw)
    assert snapshot_tree(env.root) == before
    assert env.write_entries() == entries


def test_patch_needs_exactly_one_form_and_an_existing_file(env: Env) -> None:
    base = env.sha("src/main.py")
    with pytest.raises(InvalidParams):
        env.patch("src/main.py", base)
    with pytest.raises(InvalidParams):
        env.patch("src/main.py", base, edits=[Edit(old="a", new="b")], unified_diff="@@")
    with pytest.raises(NotFound):
        env.patch("nope.py", base, edits=[Edit(old="a", new="b")])


# --- atomicity and the journal ----------------------------------------------------------------


def test_base_changed_between_plan_and_commit(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit re-checks the base: a concurrent change wins, our temp file is removed."""
    real = writer.read_current_held
    calls = {"n": 0}

    def racing(parent_fd: int, name: str, where: str, limit: int) -> Any:
        calls["n"] += 1  # the re-check under the commit lock (the plan reads otherwise)
        (env.root / "src" / "util.py").write_text("CONCURRENT = 1\n")
        return real(parent_fd, name, where, limit)

    monkeypatch.setattr(writer, "read_current_held", racing)
    with pytest.raises(StaleBase) as info:
        env.write("src/util.py", "MINE = 1\n", env.sha("src/util.py"))
    assert calls["n"] == 1
    assert info.value.data == {"current_sha256": sha(b"CONCURRENT = 1\n")}
    assert (env.root / "src" / "util.py").read_text() == "CONCURRENT = 1\n"
    assert temp_files(env.root) == []
    assert env.write_entries() == []


def test_temp_file_removed_when_writing_it_fails(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    base = env.sha("src/util.py")
    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        env.write("src/util.py", "MINE = 1\n", base)
    monkeypatch.undo()
    assert (env.root / "src" / "util.py").read_text() == "VALUE = 1\n"
    assert temp_files(env.root) == []


def test_a_planted_temp_name_is_skipped_not_followed(
    env: Env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    names = itertools.chain(["planted"], (f"fresh{i}" for i in itertools.count()))
    (env.root / "src" / f"{TEMP_PREFIX}planted").symlink_to(victim)
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
    env.write("src/util.py", "MINE = 1\n", env.sha("src/util.py"))
    assert victim.read_text() == "untouched\n"
    assert (env.root / "src" / "util.py").read_text() == "MINE = 1\n"
    assert (env.root / "src" / f"{TEMP_PREFIX}planted").is_symlink()


def test_journal_entry_per_applied_write_without_bytes(env: Env) -> None:
    secret = "SECRET-CONTENT-7f3a9c"
    patched = "PATCHED-TEXT-51be0d"
    created = env.write("notes.txt", f"{secret}\n", None)
    edits = [Edit(old=secret, new=patched)]
    replaced = env.patch("notes.txt", created.new_sha256 or "", edits=edits)
    deleted = env.delete("notes.txt", replaced.new_sha256 or "")
    b64 = base64.b64encode(b"\x00\x01" + secret.encode()).decode()
    p = WriteParams(workspace=WS, path="b.bin", base_sha256=None, content_b64=b64)
    binary = env.writer.write(env.ws, write_request(p), ACTOR)
    entries = env.write_entries()
    assert [(e.kind, e.data["op"]) for e in entries] == [
        ("fs.write", "create"),
        ("fs.patch", "replace"),
        ("fs.delete", "delete"),
        ("fs.write", "create"),
    ]
    for entry, plan in zip(entries, [created, replaced, deleted, binary], strict=True):
        assert entry.workspace == env.ws.id and entry.actor == ACTOR
        assert entry.data == {
            "path": plan.path,
            "op": plan.op,
            "base_sha256": plan.base_sha256,
            "new_sha256": plan.new_sha256,
            "size": plan.size,
            "mode": plan.mode,
            "plan_digest": plan.plan_digest,
            "approval_id": None,
        }
    dump = "\n".join(str(tuple(row)) for row in env.store.query("SELECT * FROM journal"))
    for needle in (secret, patched, b64, "SECRET", "PATCHED"):
        assert needle not in dump
    assert env.journal.verify() is None


def test_refusals_journal_nothing(env: Env) -> None:
    before = env.journal.read(limit=1000)
    attempts: list[Callable[[], Plan]] = [
        lambda: env.write("README.md", "x", None),
        lambda: env.write("README.md", "x", "0" * 64),
        lambda: env.write(".git/config", "x", env.sha(".git/config")),
        lambda: env.patch("README.md", env.sha("README.md"), edits=[Edit(old="zz", new="y")]),
        lambda: env.delete("README.md", "1" * 64),
        lambda: env.write("ci/deploy.yml", "x", env.sha("ci/deploy.yml")),
    ]
    for attempt in attempts:
        with pytest.raises(Refusal):
            attempt()
    assert env.journal.read(limit=1000) == before
    assert temp_files(env.root) == []


# --- release while a write is in flight --------------------------------------------------------


def test_release_waits_for_a_write_in_flight_which_lands_and_is_journaled_first(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    written, go = threading.Event(), threading.Event()
    real_commit = Writer._commit

    def paused_commit(self: Writer, *args: Any) -> None:
        written.set()  # the temp file is written; the rename is next
        assert go.wait(30)
        real_commit(self, *args)

    monkeypatch.setattr(Writer, "_commit", paused_commit)
    base = env.sha("README.md")
    plans: list[Plan] = []
    writer = threading.Thread(target=lambda: plans.append(env.write("README.md", "new\n", base)))
    writer.start()
    assert written.wait(30)
    releaser = threading.Thread(target=env.registry.release, args=(env.ws.id, "operator:0"))
    releaser.start()
    while True:  # the release has begun once new operations are refused
        try:
            env.write("other.txt", "x", None, dry_run=True)
        except UnknownWorkspace:
            break
    assert releaser.is_alive()  # waiting for the write, the root fd still open
    go.set()
    writer.join(30)
    releaser.join(30)
    assert plans[0].applied and (env.root / "README.md").read_text() == "new\n"
    kinds = [e.kind for e in env.journal.read(limit=1000)]
    assert kinds[-2:] == ["fs.write", "workspace.released"]
    assert temp_files(env.root) == []


# --- drift report (journal replay) ------------------------------------------------------------


def test_drift_report(env: Env, tmp_path: Path) -> None:
    kept = env.write("kept.txt", "kept\n", None)
    env.write("drift.txt", "ours\n", None)
    env.write("gone.txt", "gone\n", None)
    env.write("linked.txt", "ours\n", None)
    d = env.write("deleted.txt", "x\n", None)
    env.delete("deleted.txt", d.new_sha256 or "")
    (env.root / "drift.txt").write_text("theirs\n")
    (env.root / "gone.txt").unlink()
    (env.root / "linked.txt").unlink()
    (env.root / "linked.txt").symlink_to(tmp_path)
    (env.root / "deleted.txt").write_text("back\n")
    report = {r[0]: r for r in writes.drift_report(env.ws, env.journal)}
    assert list(report) == sorted(report)
    assert report["demo:kept.txt"][2:] == (kept.new_sha256, kept.new_sha256, "match")
    assert report["demo:drift.txt"][3:] == (sha(b"theirs\n"), "drift")
    assert report["demo:gone.txt"][3:] == (None, "missing")
    assert report["demo:linked.txt"][4] == "unreadable"
    assert report["demo:deleted.txt"][2:] == (None, sha(b"back\n"), "drift")


def test_the_exactly_one_of_pairs_decode_to_tagged_unions() -> None:
    """The wire's optional pairs are checked once, at the edge, into one of two Structs."""
    text = write_request(WriteParams(workspace=WS, path="a", base_sha256=None, content="é"))
    assert text.content == TextContent("é")
    b64 = base64.b64encode(b"\xff\x00").decode()
    raw = write_request(WriteParams(workspace=WS, path="a", base_sha256=None, content_b64=b64))
    assert raw.content == BytesContent(b"\xff\x00")
    base = "0" * 64
    edits = [Edit(old="a", new="b")]
    by_edits = patch_request(PatchParams(workspace=WS, path="a", base_sha256=base, edits=edits))
    assert by_edits.change == Edits(edits)
    by_diff = patch_request(
        PatchParams(workspace=WS, path="a", base_sha256=base, unified_diff="@@ -1 +1 @@\n")
    )
    assert by_diff.change == UnifiedDiff("@@ -1 +1 @@\n")
    for neither_or_both in ({}, {"edits": edits, "unified_diff": "@@"}):
        with pytest.raises(InvalidParams) as info:
            patch_request(PatchParams(workspace=WS, path="a", base_sha256=base, **neither_or_both))
        assert info.value.data["path"] == "$.edits"
