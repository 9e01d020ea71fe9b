"""substrate.workspace.registry in-process: adoption, root ids, VCS heads, persistence, hygiene."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from substrate.config import Config
from substrate.errors import (
    AlreadyExists,
    InvalidParams,
    LimitExceeded,
    NotADirectory,
    NotFound,
    PathDenied,
    PathInvalid,
    PolicyLocked,
    SymlinkRefused,
    UnknownWorkspace,
)
from substrate.schema.workspace import MAX_GLOBS, Policy, Vcs
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import adopted
from substrate.workspace.registry import (
    WorkspaceRegistry,
    derive_root_id,
    read_vcs,
)
from tests.harness import create_workspace, reuse_inode
from tests.harness.state import open_state

HEAD = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"
ROOT_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


@dataclass
class Env:
    """An in-process registry over a private state dir; `reopen()` simulates a restart."""

    config: Config
    state_dir: Path
    store: Store
    journal: Journal
    registry: WorkspaceRegistry

    def reopen(self) -> None:
        self.registry.close()
        self.store.close()
        self.store = Store(self.state_dir / "substrate.db")
        self.journal = Journal(self.store)
        self.registry = WorkspaceRegistry(self.config, self.store, self.journal, self.state_dir)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.journal.read(limit=10000)]


def open_env(adopt_roots: list[Path], state_dir: Path, **config: Any) -> Env:
    made = open_state(state_dir, adopt_roots, **config)
    return Env(made.config, made.path, made.store, made.journal, made.registry)


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path) -> Iterator[Env]:
    e = open_env([adopt_root], tmp_path / "state")
    try:
        yield e
    finally:
        e.registry.close()
        e.store.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- adopt: where ------------------------------------------------------------------------------


def test_adopt_returns_a_handle_and_journals(env: Env, workspace_dir: Path) -> None:
    ws = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    assert ws.id.startswith("ws_")
    assert ws.root_id == derive_root_id(workspace_dir.name)
    assert (ws.owner_uid, ws.owner_gid) == (1000, 1000)
    assert env.registry.get(ws.id) is ws
    assert env.registry.all() == [ws]
    entry = env.journal.read()[-1]
    assert entry.kind == "workspace.adopted"
    assert entry.workspace == ws.id and entry.actor == "agent:0"
    assert entry.data == {"root_id": ws.root_id, "vcs_head": None}


def test_info_holds_no_host_path(env: Env, make_workspace: Callable[..., Path]) -> None:
    path = make_workspace("secret-location", git=True)
    ws = env.registry.adopt(str(path), None, None, "agent:0")
    encoded = msgspec.json.encode(ws.info()).decode()
    assert str(path) not in encoded
    assert str(path.parent) not in encoded
    assert ws.info().vcs == Vcs(kind="git", head=HEAD)
    assert ws.provenance("a/b") == "secret-location:a/b"


@pytest.mark.parametrize("path", ["/", "/etc", "/tmp", "relative/path", "", "/x\x00y"], ids=repr)
def test_adopt_outside_adopt_roots_or_malformed(env: Env, path: str) -> None:
    with pytest.raises((PathDenied, PathInvalid)) as info:
        env.registry.adopt(path, None, None, "agent:0")
    expected = PathDenied if path.startswith("/") and "\x00" not in path else PathInvalid
    assert type(info.value) is expected
    assert env.registry.all() == []


def test_adopt_sibling_with_the_same_prefix_is_outside(env: Env, adopt_root: Path) -> None:
    sibling = adopt_root.parent / (adopt_root.name + "2")
    (sibling / "ws").mkdir(parents=True)
    with pytest.raises(PathDenied):
        env.registry.adopt(str(sibling / "ws"), None, None, "agent:0")


def test_dotdot_out_of_the_adopt_root_is_outside(
    env: Env, adopt_root: Path, workspace_dir: Path
) -> None:
    (adopt_root.parent / "elsewhere").mkdir()
    with pytest.raises(PathDenied):
        env.registry.adopt(f"{workspace_dir}/../../elsewhere", None, None, "agent:0")


def test_symlink_inside_the_adopt_root_is_refused(
    env: Env, adopt_root: Path, workspace_dir: Path, tmp_path: Path
) -> None:
    (adopt_root / "link-in").symlink_to(workspace_dir)
    (adopt_root / "link-out").symlink_to(tmp_path)
    (adopt_root / "nest").mkdir()
    (adopt_root / "nest" / "hop").symlink_to(adopt_root)
    for path in [
        adopt_root / "link-in",
        adopt_root / "link-out",
        adopt_root / "link-in" / "src",
        adopt_root / "nest" / "hop" / workspace_dir.name,
    ]:
        with pytest.raises(SymlinkRefused):
            env.registry.adopt(str(path), None, None, "agent:0")
    assert env.registry.all() == []


def test_missing_and_file_paths(env: Env, adopt_root: Path, workspace_dir: Path) -> None:
    with pytest.raises(NotFound):
        env.registry.adopt(str(adopt_root / "absent"), None, None, "agent:0")
    with pytest.raises(NotADirectory):
        env.registry.adopt(str(workspace_dir / "README.md"), None, None, "agent:0")


def test_refusals_leak_no_fd(env: Env, adopt_root: Path, workspace_dir: Path) -> None:
    (adopt_root / "link").symlink_to(workspace_dir)
    taken = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    other = adopt_root / "other"
    other.mkdir()
    before = open_fds()
    for _ in range(20):
        with pytest.raises(SymlinkRefused):
            env.registry.adopt(str(adopt_root / "link"), None, None, "agent:0")
        with pytest.raises(AlreadyExists):
            env.registry.adopt(str(other), taken.root_id, None, "agent:0")
        with pytest.raises(InvalidParams):
            env.registry.adopt(str(other), None, Policy(read_deny=["!x"]), "agent:0")
        assert env.registry.adopt(str(workspace_dir), None, None, "agent:0") is taken
    assert open_fds() == before


def test_state_dir_inside_the_workspace_is_refused(
    adopt_root: Path, make_workspace: Callable[..., Path]
) -> None:
    path = make_workspace("holder")
    for state in [path / "state", path / "deep" / "er" / "state"]:
        state.parent.mkdir(parents=True, exist_ok=True)
        e = open_env([adopt_root], state)
        try:
            with pytest.raises(PathDenied):
                e.registry.adopt(str(path), None, None, "agent:0")
            assert e.registry.all() == []
        finally:
            e.registry.close()
            e.store.close()


def test_state_dir_beside_the_workspace_is_fine(env: Env, workspace_dir: Path) -> None:
    assert env.registry.adopt(str(workspace_dir), None, None, "agent:0")


# --- adopt: identity -----------------------------------------------------------------------------


def test_same_path_twice_is_the_same_workspace(env: Env, workspace_dir: Path) -> None:
    first = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    again = env.registry.adopt(str(workspace_dir) + "/", None, None, "agent:0")
    spelled = env.registry.adopt(
        str(workspace_dir.parent) + "//./" + workspace_dir.name, "other-id", None, "agent:0"
    )
    assert first is again is spelled
    assert len(env.registry.all()) == 1
    assert env.kinds().count("workspace.adopted") == 1


@pytest.mark.parametrize(
    ("name", "root_id"),
    [
        ("demo", "demo"),
        ("My Project_v2", "my-project-v2"),
        ("ws.1", "ws-1"),
        ("-x-", "x"),
        ("a--b", "a-b"),
        ("café", "caf"),
        ("___", "workspace"),
        ("9lives", "9lives"),
        ("a" * 100, "a" * 64),
        ("a" * 63 + "-b", "a" * 63),
    ],
)
def test_derive_root_id(name: str, root_id: str) -> None:
    assert derive_root_id(name) == root_id
    assert ROOT_ID_RE.match(root_id)


def test_root_id_collision_gets_a_suffix(env: Env, make_workspace: Callable[..., Path]) -> None:
    made = [make_workspace(f"{d}/proj") for d in ("a", "b", "c")]
    ids = [env.registry.adopt(str(p), None, None, "agent:0").root_id for p in made]
    assert ids == ["proj", "proj-2", "proj-3"]


def test_long_root_id_collision_stays_valid(env: Env, make_workspace: Callable[..., Path]) -> None:
    name = "n" * 80
    ids = [
        env.registry.adopt(str(make_workspace(f"{d}/{name}")), None, None, "agent:0").root_id
        for d in ("a", "b")
    ]
    assert ids == ["n" * 64, "n" * 60 + "-2"]
    assert all(ROOT_ID_RE.match(i) for i in ids)


def test_explicit_root_id(env: Env, make_workspace: Callable[..., Path]) -> None:
    one = env.registry.adopt(str(make_workspace("one")), "chosen", None, "agent:0")
    assert one.root_id == "chosen"
    with pytest.raises(AlreadyExists):
        env.registry.adopt(str(make_workspace("two")), "chosen", None, "agent:0")
    # A derived id that an explicit one already holds gets a suffix instead.
    three = env.registry.adopt(str(make_workspace("chosen")), None, None, "agent:0")
    assert three.root_id == "chosen-2"


def test_policy_is_compiled_with_git_denied(env: Env, workspace_dir: Path) -> None:
    ws = env.registry.adopt(
        str(workspace_dir), None, Policy(write_deny=["*.lock"], read_deny=["*.pem"]), "agent:0"
    )
    assert ws.policy.policy.write_deny == [".git/**", "*.lock"]
    assert not ws.policy.may_write(".git/config")
    assert not ws.policy.may_read("k.pem")


# --- VCS -------------------------------------------------------------------------------------


def git_dir(root: Path, head: str) -> Path:
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text(head)
    return git


def vcs_of(root: Path) -> Vcs | None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return read_vcs(fd)
    finally:
        os.close(fd)


def test_vcs_loose_branch_ref(tmp_path: Path) -> None:
    git = git_dir(tmp_path, "ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(HEAD + "\n")
    assert vcs_of(tmp_path) == Vcs(kind="git", head=HEAD)


def test_vcs_nested_branch_name(tmp_path: Path) -> None:
    git = git_dir(tmp_path, "ref: refs/heads/feature/x\n")
    (git / "refs" / "heads" / "feature").mkdir()
    (git / "refs" / "heads" / "feature" / "x").write_text(HEAD)
    assert vcs_of(tmp_path) == Vcs(kind="git", head=HEAD)


def test_vcs_packed_refs(tmp_path: Path) -> None:
    git = git_dir(tmp_path, "ref: refs/heads/main\n")
    (git / "packed-refs").write_text(
        "# pack-refs with: peeled fully-peeled sorted\n"
        f"{OTHER} refs/heads/develop\n"
        f"{HEAD} refs/heads/main\n"
        f"^{OTHER}\n"
        f"{OTHER} refs/tags/v1\n"
    )
    assert vcs_of(tmp_path) == Vcs(kind="git", head=HEAD)


def test_vcs_loose_ref_wins_over_packed(tmp_path: Path) -> None:
    git = git_dir(tmp_path, "ref: refs/heads/main\n")
    (git / "packed-refs").write_text(f"{OTHER} refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(HEAD + "\n")
    assert vcs_of(tmp_path) == Vcs(kind="git", head=HEAD)


def test_vcs_detached_head(tmp_path: Path) -> None:
    git_dir(tmp_path, HEAD + "\n")
    assert vcs_of(tmp_path) == Vcs(kind="git", head=HEAD)


def test_vcs_sha256_repository(tmp_path: Path) -> None:
    sha = "ab" * 32
    git_dir(tmp_path, sha + "\n")
    assert vcs_of(tmp_path) == Vcs(kind="git", head=sha)


def test_vcs_unborn_branch(tmp_path: Path) -> None:
    git_dir(tmp_path, "ref: refs/heads/main\n")
    assert vcs_of(tmp_path) == Vcs(kind="git", head=None)


@pytest.mark.parametrize(
    "head",
    ["ref: refs/heads/../../../etc/x\n", "ref: heads/main\n", "garbage\n", "ref: refs/heads/a b\n"],
)
def test_vcs_odd_heads_are_git_without_a_head(tmp_path: Path, head: str) -> None:
    git_dir(tmp_path, head)
    assert vcs_of(tmp_path) == Vcs(kind="git", head=None)


def test_vcs_bad_ref_content(tmp_path: Path) -> None:
    git = git_dir(tmp_path, "ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("not a sha\n")
    assert vcs_of(tmp_path) == Vcs(kind="git", head=None)


def test_no_vcs(tmp_path: Path) -> None:
    assert vcs_of(tmp_path) is None
    (tmp_path / ".git").write_text("gitdir: /elsewhere/.git/worktrees/x\n")
    assert vcs_of(tmp_path) is None


def test_vcs_never_follows_symlinks(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    git = git_dir(real, "ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(HEAD)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".git").symlink_to(git)
    assert vcs_of(linked) is None
    # A symlinked ref is not read (the packed value is used instead).
    (git / "refs" / "heads" / "main").unlink()
    (tmp_path / "elsewhere").write_text(OTHER)
    (git / "refs" / "heads" / "main").symlink_to(tmp_path / "elsewhere")
    (git / "packed-refs").write_text(f"{HEAD} refs/heads/main\n")
    assert vcs_of(real) == Vcs(kind="git", head=HEAD)
    (git / "HEAD").unlink()
    (git / "HEAD").symlink_to(tmp_path / "elsewhere")
    assert vcs_of(real) is None


def test_adopting_runs_nothing_the_checkout_configures(
    env: Env, make_workspace: Callable[..., Path], tmp_path: Path
) -> None:
    path = make_workspace("hooked", git=True)
    marker = tmp_path / "ran"
    script = tmp_path / "marker.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    (path / ".git" / "config").write_text(
        f"[core]\n\tfsmonitor = {script}\n\thooksPath = {tmp_path}\n"
        f'[filter "x"]\n\tclean = {script}\n\tsmudge = {script}\n'
    )
    (path / ".gitattributes").write_text("* filter=x diff=x\n")
    for hook in ("post-checkout", "pre-commit", "post-index-change", "reference-transaction"):
        (path / ".git" / "hooks" / hook).write_text(f"#!/bin/sh\ntouch {marker}\n")
        (path / ".git" / "hooks" / hook).chmod(0o755)
    ws = env.registry.adopt(str(path), None, None, "agent:0")
    assert ws.info().vcs == Vcs(kind="git", head=HEAD)
    assert not marker.exists()


# --- persistence and release --------------------------------------------------------------------


def test_reload_after_reopening(env: Env, make_workspace: Callable[..., Path]) -> None:
    policy = Policy(write_deny=["dist/"], read_deny=["*.pem"], require_approval=["ci/**"])
    one = env.registry.adopt(str(make_workspace("one")), None, policy, "agent:0")
    two = env.registry.adopt(str(make_workspace("two")), "second", None, "agent:0")
    env.reopen()
    reloaded = env.registry.all()
    assert [(w.id, w.root_id) for w in reloaded] == [(one.id, "one"), (two.id, "second")]
    again = env.registry.get(one.id)
    assert again.policy.policy == one.policy.policy
    assert not again.policy.may_read("x.pem")
    assert again.dev_ino == one.dev_ino
    assert (again.owner_uid, again.owner_gid) == (1000, 1000)
    # Adopting the same path after the restart returns the reloaded workspace.
    assert env.registry.adopt(one.host_path, None, None, "agent:0") is again


def test_root_ids_stay_taken_after_reopening(env: Env, make_workspace: Callable[..., Path]) -> None:
    env.registry.adopt(str(make_workspace("one")), "taken", None, "agent:0")
    env.reopen()
    with pytest.raises(AlreadyExists):
        env.registry.adopt(str(make_workspace("two")), "taken", None, "agent:0")


def test_reload_drops_a_vanished_or_swapped_workspace(
    env: Env, make_workspace: Callable[..., Path], tmp_path: Path
) -> None:
    gone = env.registry.adopt(str(make_workspace("gone")), None, None, "agent:0")
    swapped_path = make_workspace("swapped")
    swapped = env.registry.adopt(str(swapped_path), None, None, "agent:0")
    kept = env.registry.adopt(str(make_workspace("kept")), None, None, "agent:0")
    os.rename(gone.host_path, tmp_path / "moved-away")
    os.rename(swapped_path, tmp_path / "swapped-real")
    swapped_path.symlink_to(tmp_path / "swapped-real")
    env.reopen()
    assert [w.id for w in env.registry.all()] == [kept.id]
    with pytest.raises(UnknownWorkspace):
        env.registry.get(gone.id)
    dropped = {
        e.workspace: e.data["refusal"]
        for e in env.journal.read(limit=1000)
        if e.kind == "workspace.unavailable"
    }
    assert dropped == {gone.id: "not_found", swapped.id: "symlink_refused"}
    env.reopen()  # and it stays dropped, without a second journal entry
    assert env.kinds().count("workspace.unavailable") == 2


def test_release(env: Env, workspace_dir: Path) -> None:
    ws = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    fd = ws.root_fd
    env.registry.release(ws.id, "agent:0")
    with pytest.raises(UnknownWorkspace):
        env.registry.get(ws.id)
    with pytest.raises(UnknownWorkspace):
        env.registry.release(ws.id, "agent:0")
    assert env.journal.read()[-1].kind == "workspace.released"
    again = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    assert again.id != ws.id and again.root_id == ws.root_id
    if again.root_fd != fd:  # the old fd number may be reused by the new adoption
        with pytest.raises(OSError):
            os.fstat(fd)
    env.reopen()
    assert [w.id for w in env.registry.all()] == [again.id]


def test_info_holds_the_root_fd_while_a_release_races_it(
    env: Env, workspace_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release that stops waiting (drain 0) while `info` reads `.git`: the fd stays
    open until `info` is done with it, and later calls are refused."""
    ws = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    real = adopted.read_vcs
    seen: list[int] = []

    def released_meanwhile(root_fd: int) -> Vcs | None:
        env.registry.release(ws.id, "operator:0", drain_s=0)
        seen.append(os.fstat(root_fd).st_ino)  # EBADF had the release closed it
        return real(root_fd)

    monkeypatch.setattr(adopted, "read_vcs", released_meanwhile)
    assert ws.info().workspace == ws.id
    assert seen == [workspace_dir.stat().st_ino]
    with pytest.raises(UnknownWorkspace):
        ws.info()


def test_list_leaves_out_a_workspace_released_meanwhile(
    env: Env, workspace_dir: Path, adopt_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = adopt_root / "other"
    other.mkdir()
    gone = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    kept = env.registry.adopt(str(other), None, None, "agent:0")
    listed = env.registry.all()
    env.registry.release(gone.id, "agent:0")
    monkeypatch.setattr(env.registry, "all", lambda: listed)  # listed before the release
    assert [i.workspace for i in env.registry.infos()] == [kept.id]


def test_unknown_workspace(env: Env) -> None:
    with pytest.raises(UnknownWorkspace):
        env.registry.get("ws_nope")


# --- approvals and start-up hygiene --------------------------------------------------------------


def test_grant_approval_is_stored_and_journaled(env: Env, workspace_dir: Path) -> None:
    ws = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    approval_id, expires = env.registry.grant_approval(ws, "d" * 64, 60.0, "operator:0")
    assert approval_id.startswith("apr_")
    rows = env.store.query("SELECT * FROM approvals WHERE id = ?", (approval_id,))
    assert rows[0]["plan_digest"] == "d" * 64 and rows[0]["used"] is None
    assert rows[0]["expires"] == expires
    last = env.journal.read()[-1]
    assert last.kind == "approval.granted" and last.actor == "operator:0"
    assert last.data["approval_id"] == approval_id


LOCKED = Policy(write_deny=["dist/"], read_deny=["*.pem"], require_approval=["ci/**"])


def test_release_and_readopt_cannot_drop_the_policy(env: Env, workspace_dir: Path) -> None:
    """The attack: adopt with a policy, release, re-adopt with `{}`. It used to succeed."""
    ws = env.registry.adopt(str(workspace_dir), None, LOCKED, "agent:0")
    env.registry.release(ws.id, "agent:0")
    kinds = env.kinds()
    for loosened in [Policy(), Policy(write_deny=["dist/"], read_deny=["*.pem"])]:
        with pytest.raises(PolicyLocked) as info:
            env.registry.adopt(str(workspace_dir), None, loosened, "agent:0")
        assert (
            "read_deny" in info.value.data["dropped"]
            or "require_approval" in (info.value.data["dropped"])
        )
    assert env.registry.all() == []
    assert env.kinds() == kinds  # a refusal changes nothing
    again = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    assert not again.policy.may_read("k.pem")
    assert not again.policy.may_write("dist/x")
    assert again.policy.needs_approval("ci/run.sh")
    env.registry.release(again.id, "agent:0")
    env.reopen()  # and across a restart
    with pytest.raises(PolicyLocked):
        env.registry.adopt(str(workspace_dir), None, Policy(), "agent:0")
    restarted = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    assert restarted.policy.policy == again.policy.policy


def test_an_agent_policy_may_add(env: Env, workspace_dir: Path) -> None:
    ws = env.registry.adopt(str(workspace_dir), None, LOCKED, "agent:0")
    # Restating the policy in other spellings, plus more: accepted, on the live workspace.
    more = Policy(
        write_deny=["dist", "*.lock"],
        read_deny=["*.pem", ".env"],
        require_approval=["/ci/**"],
        write_allow=["src/**", "dist/**"],
    )
    assert env.registry.adopt(str(workspace_dir), None, more, "agent:0") is ws
    assert not ws.policy.may_write("x.lock") and not ws.policy.may_read(".env")
    assert not ws.policy.may_write("README.md")  # outside the new allow list
    assert env.kinds()[-1] == "workspace.policy_added"
    # Widening the allow list is loosening; narrowing it is not.
    widen = Policy(
        write_deny=["dist/", "*.lock"],
        read_deny=["*.pem", ".env"],
        require_approval=["ci/**"],
        write_allow=["src/**", "dist/**", "README.md"],
    )
    with pytest.raises(PolicyLocked) as info:
        env.registry.adopt(str(workspace_dir), None, widen, "agent:0")
    assert info.value.data["added"] == {"write_allow": ["README.md"]}
    narrow = msgspec.structs.replace(widen, write_allow=["src/**"])
    env.registry.adopt(str(workspace_dir), None, narrow, "agent:0")
    assert ws.policy.policy.write_allow == ["src/**"]
    assert not ws.policy.may_write("dist/a") and ws.policy.may_write("src/a.py")


def test_the_operator_default_applies_and_cannot_be_dropped(
    adopt_root: Path, make_workspace: Callable[..., Path], tmp_path: Path
) -> None:
    default = Policy(read_deny=["*.key"], write_deny=["vendor/**"])
    e = open_env([adopt_root], tmp_path / "state", policy=default)
    try:
        path = make_workspace("proj")
        ws = e.registry.adopt(str(path), None, None, "agent:0")
        assert not ws.policy.may_read("a/id.key") and not ws.policy.may_write("vendor/x")
        with pytest.raises(PolicyLocked) as info:
            e.registry.adopt(str(path), None, Policy(read_deny=["*.pem"]), "agent:0")
        assert info.value.data["dropped"] == {"write_deny": ["vendor/**"], "read_deny": ["*.key"]}
        # The operator may loosen what was set for the checkout, never the default.
        e.registry.adopt(
            str(path),
            None,
            Policy(read_deny=["*.key", "*.pem"], write_deny=["vendor/**"]),
            "agent:0",
        )
        assert not ws.policy.may_read("x.pem")
        e.registry.set_policy(ws.id, Policy(write_deny=[]), "operator:0")
        assert ws.policy.may_read("x.pem")
        assert not ws.policy.may_read("id.key")
        assert ws.policy.policy.write_deny == [".git/**", "vendor/**"]
        entry = e.journal.read()[-1]
        assert entry.kind == "workspace.policy_set" and entry.actor == "operator:0"
    finally:
        e.registry.close()
        e.store.close()


def test_default_globs_are_not_pinned_to_the_checkout(
    adopt_root: Path, make_workspace: Callable[..., Path], tmp_path: Path
) -> None:
    """An agent restates the default to add to it; the operator loosening the default later
    still loosens that checkout (only what the agent added stays)."""
    state = tmp_path / "state"
    e = open_env([adopt_root], state, policy=Policy(read_deny=["*.key"]))
    path = make_workspace("proj")
    e.registry.adopt(str(path), None, Policy(read_deny=["*.key", "*.pem"]), "agent:0")
    e.registry.close()
    e.store.close()
    e = open_env([adopt_root], state, policy=Policy())
    try:
        (ws,) = e.registry.all()
        assert ws.policy.may_read("id.key") and not ws.policy.may_read("id.pem")
    finally:
        e.registry.close()
        e.store.close()


def test_set_policy_may_loosen_and_is_remembered(env: Env, workspace_dir: Path) -> None:
    ws = env.registry.adopt(str(workspace_dir), None, LOCKED, "agent:0")
    env.registry.set_policy(ws.id, Policy(read_deny=["*.pem"]), "operator:0")
    assert ws.policy.may_write("dist/x") and not ws.policy.may_read("a.pem")
    env.registry.release(ws.id, "agent:0")
    env.reopen()
    again = env.registry.adopt(str(workspace_dir), None, Policy(read_deny=["*.pem"]), "agent:0")
    assert again.policy.policy.read_deny == ["*.pem"]
    with pytest.raises(UnknownWorkspace):
        env.registry.set_policy("ws_nope", Policy(), "operator:0")


def test_the_policy_follows_the_directory_not_its_name(
    env: Env, adopt_root: Path, workspace_dir: Path
) -> None:
    ws = env.registry.adopt(str(workspace_dir), None, LOCKED, "agent:0")
    env.registry.release(ws.id, "agent:0")
    moved = adopt_root / "renamed"
    workspace_dir.rename(moved)
    with pytest.raises(PolicyLocked):
        env.registry.adopt(str(moved), None, Policy(), "agent:0")
    assert not env.registry.adopt(str(moved), None, None, "agent:0").policy.may_read("a.pem")


@pytest.mark.parametrize("inside", [".git", ".git/hooks", ".git/modules/sub", "sub/.git"])
def test_a_git_dir_or_anything_inside_is_never_adopted(
    env: Env, make_workspace: Callable[..., Path], inside: str
) -> None:
    """Adopting `.git` made its hooks and config writable by guarded writes."""
    path = make_workspace("proj", git=True)
    (path / inside).mkdir(parents=True, exist_ok=True)
    with pytest.raises(PathDenied):
        env.registry.adopt(str(path / inside), None, None, "agent:0")
    assert env.registry.all() == []


@pytest.mark.parametrize("inside", ["", "hooks"])
def test_a_bare_repository_is_never_adopted(env: Env, adopt_root: Path, inside: str) -> None:
    bare = adopt_root / "repo.git"
    for sub in ("objects", "refs/heads", "hooks"):
        (bare / sub).mkdir(parents=True)
    (bare / "HEAD").write_text("ref: refs/heads/main\n")
    with pytest.raises(PathDenied):
        env.registry.adopt(str(bare / inside) if inside else str(bare), None, None, "agent:0")
    # A checkout that merely has a file named HEAD is a checkout.
    (adopt_root / "plain").mkdir()
    (adopt_root / "plain" / "HEAD").write_text("not a ref\n")
    assert env.registry.adopt(str(adopt_root / "plain"), None, None, "agent:0")


def test_adopting_a_denied_subdirectory_keeps_it_denied(
    env: Env, make_workspace: Callable[..., Path]
) -> None:
    """Adopting `secrets/` of a checkout that denies it used to read it freely."""
    path = make_workspace("proj", {"secrets/db.txt": "pw\n", "src/gen/x.py": "x\n", "a.py": ""})
    outer = env.registry.adopt(
        str(path),
        None,
        Policy(read_deny=["secrets/"], write_deny=["src/gen/**"], write_allow=["src/**"]),
        "agent:0",
    )
    secrets_ws = env.registry.adopt(str(path / "secrets"), None, None, "agent:0")
    assert not secrets_ws.policy.may_read("db.txt")
    src = env.registry.adopt(str(path / "src"), None, None, "agent:0")
    assert not src.policy.may_write("gen/x.py") and src.policy.may_write("main.py")
    # `src/**` allows all of src/: no allow list inside it.
    assert src.policy.policy.write_allow == [] and src.policy.may_write("any/where.py")
    # It holds with the enclosing checkout released, and after a restart.
    env.registry.release(outer.id, "agent:0")
    env.registry.release(secrets_ws.id, "agent:0")
    env.reopen()
    again = env.registry.adopt(str(path / "secrets"), None, None, "agent:0")
    assert not again.policy.may_read("db.txt")
    # Inherited rules are not the checkout's own: no agent policy can leave them out.
    env.registry.release(again.id, "agent:0")
    assert not env.registry.adopt(str(path / "secrets"), None, Policy(), "agent:0").policy.may_read(
        "db.txt"
    )


def test_inherited_rules_cannot_be_dropped_by_restating(
    env: Env, make_workspace: Callable[..., Path]
) -> None:
    path = make_workspace("proj", {"sub/k.pem": "k"})
    env.registry.adopt(str(path), None, Policy(read_deny=["*.pem"]), "agent:0")
    sub = env.registry.adopt(str(path / "sub"), None, None, "agent:0")
    assert sub.policy.policy.read_deny == ["*.pem"]
    env.registry.adopt(str(path / "sub"), None, Policy(read_deny=["*.pem"]), "agent:0")
    env.registry.set_policy(sub.id, Policy(write_deny=[]), "operator:0")
    # The operator loosened the nested checkout's own policy; the enclosing one still holds.
    assert not sub.policy.may_read("k.pem")


@pytest.mark.parametrize("parent", ["proj", "", "proj/a"], ids=["parent", "adopt-root", "middle"])
def test_adopting_a_parent_inherits_the_nested_checkouts_rules(
    env: Env, adopt_root: Path, make_workspace: Callable[..., Path], parent: str
) -> None:
    """Adopting the parent of a workspace (or the adopt root) used to read what it denied."""
    inner_path = make_workspace("proj/a/inner", {"k.pem": "k", "gen/x": "x", "ok.txt": "o"})
    inner = env.registry.adopt(
        str(inner_path), None, Policy(read_deny=["*.pem"], write_deny=["/gen/"]), "agent:0"
    )
    env.registry.release(inner.id, "agent:0")  # remembered, not live
    outer = env.registry.adopt(str(adopt_root / parent), None, None, "agent:0")
    rel = os.path.relpath(inner_path, adopt_root / parent)
    assert not outer.policy.may_read(f"{rel}/k.pem")
    assert not outer.policy.may_read(f"{rel}/deeper/k.pem")
    assert not outer.policy.may_write(f"{rel}/gen/x")
    assert not outer.policy.may_write(f"{rel}/.git/config")
    assert outer.policy.may_read(f"{rel}/ok.txt") and outer.policy.may_write(f"{rel}/ok.txt")
    assert outer.policy.may_read("k.pem")  # outside the nested checkout: not inherited
    assert outer.policy.may_write("gen/x")


def test_a_live_enclosing_workspace_learns_a_nested_checkouts_rules(
    env: Env, make_workspace: Callable[..., Path]
) -> None:
    path = make_workspace("proj", {"sub/k.pem": "k", "sub/x": "x"})
    outer = env.registry.adopt(str(path), None, None, "agent:0")
    assert outer.policy.may_read("sub/k.pem")
    inner = env.registry.adopt(str(path / "sub"), None, Policy(read_deny=["*.pem"]), "agent:0")
    assert not outer.policy.may_read("sub/k.pem")
    # An allow list of the nested checkout shuts it to writes through the enclosing one.
    env.registry.set_policy(inner.id, Policy(write_allow=["x"]), "operator:0")
    assert outer.policy.may_read("sub/k.pem")  # the operator dropped the read rule
    assert not outer.policy.may_write("sub/x") and inner.policy.may_write("x")
    assert outer.policy.may_write("other")


def test_a_policy_too_large_with_what_it_inherits_is_refused(
    env: Env, make_workspace: Callable[..., Path]
) -> None:
    path = make_workspace("proj", {"sub/x": "x"})
    many = Policy(read_deny=[f"f{i}" for i in range(MAX_GLOBS)])
    env.registry.adopt(str(path), None, many, "agent:0")
    kinds = env.kinds()
    with pytest.raises(LimitExceeded):
        env.registry.adopt(str(path / "sub"), None, Policy(read_deny=["g"]), "agent:0")
    assert env.kinds() == kinds
    assert len(env.registry.all()) == 1


def test_a_workspace_from_before_remembered_policies_keeps_its_policy(
    env: Env, workspace_dir: Path
) -> None:
    ws = env.registry.adopt(str(workspace_dir), None, LOCKED, "agent:0")
    with env.store.transaction() as db:
        db.execute("DELETE FROM checkout_policies")
    env.reopen()
    assert env.registry.get(ws.id).policy.policy == ws.policy.policy
    env.registry.release(ws.id, "agent:0")
    with pytest.raises(PolicyLocked):
        env.registry.adopt(str(workspace_dir), None, Policy(), "agent:0")


def test_a_reused_inode_is_a_new_checkout_with_none_of_the_old_policy(
    env: Env, quiet_root: Path
) -> None:
    """`rm -rf old/` frees its inode; the next directory made gets it (ext4). The new
    directory is another checkout: nothing remembered for the old one reaches it."""
    old_path = create_workspace(quiet_root, "old")
    old = env.registry.adopt(str(old_path), None, LOCKED, "agent:0")
    env.registry.set_policy(old.id, Policy(write_allow=["docs/**"]), "operator:0")
    env.registry.release(old.id, "agent:0")
    new_path = reuse_inode(old_path, quiet_root)
    new = env.registry.adopt(str(new_path), None, None, "agent:0")
    assert new.dev_ino == old.dev_ino  # the same (st_dev, st_ino): only that was reused
    assert new.policy.may_read("a.pem") and new.policy.may_write("src/x.py")
    assert new.policy.policy == env.config.policy
    assert new.checkout != old.checkout
    env.reopen()  # and after a restart
    again = env.registry.adopt(str(new_path), None, None, "agent:0")
    assert again.policy.may_read("a.pem") and again.policy.may_write("src/x.py")


def test_reload_drops_a_workspace_whose_directory_was_replaced(
    env: Env, quiet_root: Path, tmp_path: Path
) -> None:
    """The same path, another directory (here even with the old inode): the persisted
    workspace is not re-bound to it, so its journal history and handle stay the old
    checkout's; adopting the path again makes a new workspace."""
    path = create_workspace(quiet_root, "proj")
    old = env.registry.adopt(str(path), None, None, "agent:0")
    env.registry.close()
    new = reuse_inode(path, quiet_root, "fresh")
    new.rename(path)
    env.reopen()
    assert env.registry.all() == []
    (entry,) = [e for e in env.journal.read(limit=1000) if e.kind == "workspace.unavailable"]
    assert entry.workspace == old.id
    assert entry.data == {"root_id": "proj", "refusal": "not_found", "reason": "replaced"}
    again = env.registry.adopt(str(path), None, None, "agent:0")
    assert again.id != old.id


def make_legacy(env: Env, ws: adopted.Workspace) -> Path:
    """Rewrite what `ws` left in the store and homes as a release keeping (st_dev,
    st_ino) only would have: no identity in its row, its checkout and home by
    `st_dev:st_ino`. Returns the legacy home (with a note in it)."""
    legacy = f"{ws.dev_ino[0]}:{ws.dev_ino[1]}"
    with env.store.transaction() as db:
        db.execute("UPDATE workspaces SET checkout = NULL")
        db.execute("UPDATE checkout_policies SET checkout = ?", (legacy,))
    home = env.state_dir / "homes" / legacy.replace(":", "-") / "1000"
    home.mkdir(parents=True)
    (home / "note").write_text("an old session\n")
    return home


@pytest.mark.parametrize("released", [False, True])
def test_an_older_release_s_workspace_and_home_are_migrated_once_when_the_path_matches(
    env: Env, workspace_dir: Path, released: bool
) -> None:
    """At the restart (a persisted workspace) or at the next adoption (a released one)."""
    ws = env.registry.adopt(str(workspace_dir), None, LOCKED, "agent:0")
    if released:
        env.registry.release(ws.id, "agent:0")
    old_home = make_legacy(env, ws)
    env.reopen()
    if released:
        again = env.registry.adopt(str(workspace_dir), None, None, "agent:0")
    else:
        again = env.registry.get(ws.id)
    assert again.checkout == ws.checkout and not again.policy.may_read("a.pem")
    assert not old_home.parent.exists()
    moved = env.state_dir / "homes" / ws.checkout.replace(":", "-") / "1000" / "note"
    assert moved.read_text() == "an old session\n"
    (entry,) = [e for e in env.journal.read(limit=1000) if e.kind == "workspace.identity_migrated"]
    assert entry.workspace == again.id
    assert entry.data == {"root_id": ws.root_id, "home": "moved"}
    rows = env.store.query("SELECT checkout FROM checkout_policies")
    assert [r["checkout"] for r in rows] == [ws.checkout]
    env.reopen()  # once
    assert env.kinds().count("workspace.identity_migrated") == 1


def test_an_older_release_s_state_is_never_handed_over_by_inode_alone(
    env: Env, quiet_root: Path
) -> None:
    """Its row says st_dev:st_ino and a path; the inode is another directory's now, at
    another path: neither the policy nor the home go to it; the home stays, an orphan."""
    old_path = create_workspace(quiet_root, "old")
    old = env.registry.adopt(str(old_path), None, LOCKED, "agent:0")
    env.registry.release(old.id, "agent:0")
    old_home = make_legacy(env, old)
    env.reopen()
    new_path = reuse_inode(old_path, quiet_root)
    new = env.registry.adopt(str(new_path), None, None, "agent:0")
    assert new.dev_ino == old.dev_ino
    assert new.policy.may_read("a.pem")
    assert (old_home / "note").read_text() == "an old session\n"
    assert not (env.state_dir / "homes" / new.checkout.replace(":", "-")).exists()
    assert "workspace.identity_migrated" not in env.kinds()


def test_an_older_release_s_workspace_at_a_replaced_path_is_dropped(
    env: Env, adopt_root: Path, make_workspace: Callable[..., Path]
) -> None:
    path = make_workspace("proj")
    ws = env.registry.adopt(str(path), None, None, "agent:0")
    old_home = make_legacy(env, ws)
    env.registry.close()
    os.rename(path, adopt_root / "elsewhere")  # keeps the old inode busy: a new one at path
    path.mkdir()
    env.reopen()
    assert env.registry.all() == []
    (entry,) = [e for e in env.journal.read(limit=1000) if e.kind == "workspace.unavailable"]
    assert entry.data["reason"] == "replaced"
    assert (old_home / "note").exists()
