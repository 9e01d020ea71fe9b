"""substrate.layer.changes.apply: a change set lands through the guarded write path, or not at all."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.layer.changes import ApplyResult, ChangeSet, Outcomes, apply, scan
from substrate.schema.workspace import Policy
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.writes import Writer
from tests.harness.state import DaemonState

ACTOR = "agent:0"
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
FILES: dict[str, str | bytes] = {
    "a.txt": "a\n",
    "m.sh": "echo\n",
    "d/x": "x\n",
    "d/sub/y": "y\n",
    "src/main.py": "print(1)\n",
    "ci/deploy.yml": "steps: []\n",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Env:
    root: Path
    upper: Path
    ws: Workspace
    writer: Writer
    journal: Journal
    registry: WorkspaceRegistry

    def scan(self) -> ChangeSet:
        ufd = os.open(self.upper, DIR)
        try:
            return scan(ufd, self.ws.root_fd)
        finally:
            os.close(ufd)

    def apply(self, cs: ChangeSet) -> ApplyResult:
        ufd = os.open(self.upper, DIR)
        try:
            return apply(self.writer, self.ws, ufd, cs, ACTOR)
        finally:
            os.close(ufd)

    def entries(self) -> list[tuple[str, str]]:
        return [
            (e.kind, str(e.data["path"]))
            for e in self.journal.read(limit=10000)
            if e.kind.startswith("changes.")
        ]


@pytest.fixture
def policy() -> Policy | None:
    return None


@pytest.fixture
def env(
    daemon_state: DaemonState,
    tmp_path: Path,
    make_workspace: Callable[..., Path],
    policy: Policy | None,
) -> Env:
    root = make_workspace("demo", FILES)
    store, journal, registry = daemon_state.store, daemon_state.journal, daemon_state.registry
    ws = registry.adopt(str(root), None, policy, ACTOR)
    upper = tmp_path / "upper"
    upper.mkdir()
    return Env(root, upper, ws, Writer(store, journal), journal, registry)


def put(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)


def whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR, os.makedev(0, 0))


def paths_of(outcomes: tuple[Outcomes, ...]) -> list[tuple[str, str]]:
    return [(o.path, o.op) for o in outcomes]


def test_applies_bytes_modes_owners_and_order(env: Env) -> None:
    os.chown(env.root / "a.txt", 1001, 1001)  # a replace keeps the file's owner
    put(env.upper / "a.txt", b"A\n")
    put(env.upper / "m.sh", b"echo\n", 0o4755)  # only the mode; set-id never lands
    whiteout(env.upper / "d")
    (env.upper / "new").mkdir()
    os.chmod(env.upper / "new", 0o750)
    put(env.upper / "new" / "f", b"f\n", 0o600)
    put(env.upper / "top.txt", b"top\n")
    cs = env.scan()
    result = env.apply(cs)
    assert paths_of(result.applied) == [
        ("d/sub/y", "delete"),
        ("d/sub", "delete"),
        ("d/x", "delete"),
        ("d", "delete"),
        ("new", "mkdir"),
        ("a.txt", "replace"),
        ("m.sh", "chmod"),
        ("new/f", "create"),
        ("top.txt", "create"),
    ]
    assert result.blocked == result.conflicts == result.pending == result.unchanged == ()
    assert not (env.root / "d").exists()
    assert (env.root / "a.txt").read_bytes() == b"A\n"
    assert (env.root / "new" / "f").read_bytes() == b"f\n"
    assert (env.root / "top.txt").read_bytes() == b"top\n"
    facts = {
        rel: (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        for rel in ("a.txt", "m.sh", "new", "new/f", "top.txt")
        for st in [os.lstat(env.root / rel)]
    }
    uid, gid = env.ws.owner_uid, env.ws.owner_gid
    assert facts == {
        "a.txt": (0o644, 1001, 1001),
        "m.sh": (0o755, uid, gid),
        "new": (0o750, uid, gid),
        "new/f": (0o600, uid, gid),
        "top.txt": (0o644, uid, gid),
    }
    # Journaled phase by phase: file deletes, then the directories they emptied.
    assert env.entries() == [
        ("changes.apply", "demo:d/sub/y"),
        ("changes.apply", "demo:d/x"),
        ("changes.apply_dir", "demo:d/sub"),
        ("changes.apply_dir", "demo:d"),
        ("changes.apply_dir", "demo:new"),
        ("changes.apply", "demo:a.txt"),
        ("changes.apply", "demo:m.sh"),
        ("changes.apply", "demo:new/f"),
        ("changes.apply", "demo:top.txt"),
    ]
    # One entry per change, the chain intact; no temp file, record or intent left.
    assert env.journal.verify() is None
    for table in ("temp_files", "write_intents"):
        assert env.journal.store.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"] == 0
    assert [p.name for p in env.root.rglob(".substrate-tmp-*")] == []
    # A second apply of the same set applies nothing twice.
    again = env.apply(cs)
    assert again.applied == ()
    assert paths_of(again.unchanged) == paths_of(result.applied)
    assert len(env.entries()) == 9


def test_host_edit_between_scan_and_apply_is_kept_as_a_conflict(env: Env) -> None:
    put(env.upper / "a.txt", b"command\n")
    put(env.upper / "src" / "main.py", b"print(2)\n")
    whiteout(env.upper / "m.sh")
    cs = env.scan()
    (env.root / "a.txt").write_bytes(b"host\n")  # a person edits while the command runs
    (env.root / "m.sh").write_bytes(b"host too\n")
    result = env.apply(cs)
    assert paths_of(result.applied) == [("src/main.py", "replace")]
    assert [(c.path, c.reason, c.current_sha256, c.kept) for c in result.conflicts] == [
        ("m.sh", "stale_base", sha(b"host too\n"), None),
        ("a.txt", "stale_base", sha(b"host\n"), "a.txt"),
    ]
    assert (env.root / "a.txt").read_bytes() == b"host\n"
    assert (env.root / "m.sh").read_bytes() == b"host too\n"
    assert (env.upper / "a.txt").read_bytes() == b"command\n"  # the command's version stays


def test_host_creation_of_the_same_name_is_a_conflict(env: Env) -> None:
    put(env.upper / "poetry.lock", b"command\n")
    cs = env.scan()
    (env.root / "poetry.lock").write_bytes(b"person\n")
    result = env.apply(cs)
    assert [(c.path, c.reason) for c in result.conflicts] == [("poetry.lock", "already_exists")]
    assert (env.root / "poetry.lock").read_bytes() == b"person\n"


@pytest.mark.parametrize("policy", [Policy(write_deny=["*.lock", "secrets/**"])], ids=["deny"])
def test_write_deny_is_blocked_and_untouched(env: Env) -> None:
    put(env.upper / "poetry.lock", b"x\n")
    put(env.upper / "secrets" / "key.pem", b"k\n")
    put(env.upper / "ok.txt", b"ok\n")
    result = env.apply(env.scan())
    assert [(b.path, b.reason, b.rule) for b in result.blocked] == [
        ("secrets", "path_denied", "secrets/**"),
        ("poetry.lock", "path_denied", "*.lock"),
        ("secrets/key.pem", "path_denied", "secrets/**"),
    ]
    assert paths_of(result.applied) == [("ok.txt", "create")]
    assert not (env.root / "poetry.lock").exists()
    assert not (env.root / "secrets").exists()


@pytest.mark.parametrize("policy", [Policy(write_allow=["src/**"])], ids=["allow"])
def test_write_allow_outside_is_blocked(env: Env) -> None:
    put(env.upper / "src" / "new.py", b"ok\n")
    put(env.upper / "README.md", b"nope\n")
    whiteout(env.upper / "a.txt")
    result = env.apply(env.scan())
    assert [(b.path, b.op, b.rule) for b in result.blocked] == [
        ("a.txt", "delete", "write_allow"),
        ("README.md", "create", "write_allow"),
    ]
    assert paths_of(result.applied) == [("src/new.py", "create")]
    assert (env.root / "a.txt").read_bytes() == b"a\n"
    assert not (env.root / "README.md").exists()


@pytest.mark.parametrize("policy", [Policy(require_approval=["ci/**"])], ids=["approval"])
def test_require_approval_is_pending_until_granted(env: Env) -> None:
    put(env.upper / "ci" / "deploy.yml", b"steps: [deploy]\n")
    (env.upper / "ci" / "more").mkdir()
    cs = env.scan()
    result = env.apply(cs)
    assert [(p.path, p.reason) for p in result.pending] == [
        ("ci/more", "approval_required"),
        ("ci/deploy.yml", "approval_required"),
    ]
    assert all(p.plan_digest for p in result.pending)
    assert (env.root / "ci" / "deploy.yml").read_bytes() == b"steps: []\n"
    assert not (env.root / "ci" / "more").exists()
    for pending in result.pending:
        assert pending.plan_digest is not None
        env.registry.grant_approval(env.ws, pending.plan_digest, 60, "operator:0")
    again = env.apply(cs)
    assert paths_of(again.applied) == [("ci/more", "mkdir"), ("ci/deploy.yml", "replace")]
    assert (env.root / "ci" / "more").is_dir()
    assert (env.root / "ci" / "deploy.yml").read_bytes() == b"steps: [deploy]\n"


def test_a_layer_changed_after_the_scan_is_not_applied(env: Env) -> None:
    put(env.upper / "a.txt", b"scanned\n")
    cs = env.scan()
    put(env.upper / "a.txt", b"swapped\n")
    result = env.apply(cs)
    assert [(c.path, c.reason) for c in result.conflicts] == [("a.txt", "layer_changed")]
    assert (env.root / "a.txt").read_bytes() == b"a\n"


def test_directory_holding_a_host_file_is_not_removed(env: Env) -> None:
    whiteout(env.upper / "d")
    cs = env.scan()
    (env.root / "d" / "sub" / "host.txt").write_bytes(b"mine\n")
    result = env.apply(cs)
    assert [(c.path, c.reason) for c in result.conflicts] == [
        ("d/sub", "not_empty"),
        ("d", "not_empty"),
    ]
    assert (env.root / "d" / "sub" / "host.txt").read_bytes() == b"mine\n"


def test_a_git_dir_planted_by_content_never_lands(env: Env) -> None:
    # HEAD + objects/ + refs/ + config in `tools/`: a repository by content, whose config
    # host git would run. None of it lands; the command's ordinary files do.
    put(env.upper / "tools" / "HEAD", b"ref: refs/heads/main\n")
    put(env.upper / "tools" / "config", b"[core]\n\tfsmonitor = touch MARKER\n\tworktree = ..\n")
    put(env.upper / "tools" / "objects" / "ab" / "cdef", b"blob")
    put(env.upper / "tools" / "refs" / "heads" / "main", b"0" * 40 + b"\n")
    put(env.upper / "src" / "ok.py", b"ok\n")
    cs = env.scan()
    blocked = {(b.path, b.reason) for b in cs.blocked}
    assert blocked == {
        ("tools/HEAD", "git_dir"),
        ("tools/config", "git_dir"),
        ("tools/objects", "git_dir"),
        ("tools/objects/ab", "git_dir"),
        ("tools/objects/ab/cdef", "git_dir"),
        ("tools/refs", "git_dir"),
        ("tools/refs/heads", "git_dir"),
        ("tools/refs/heads/main", "git_dir"),
    }
    result = env.apply(cs)
    assert paths_of(result.applied) == [("tools", "mkdir"), ("src/ok.py", "create")]
    assert os.listdir(env.root / "tools") == []
    assert (env.root / "src" / "ok.py").read_bytes() == b"ok\n"


def test_the_pieces_already_in_the_checkout_count(env: Env) -> None:
    (env.root / "d" / "objects").mkdir()
    (env.root / "d" / "refs").mkdir()
    put(env.upper / "d" / "HEAD", b"ref: refs/heads/main\n")
    put(env.upper / "d" / "note", b"n\n")
    cs = env.scan()
    # Everything the set puts in a directory it would complete is blocked, as in `.git`.
    assert [(b.path, b.reason) for b in cs.blocked] == [
        ("d/HEAD", "git_dir"),
        ("d/note", "git_dir"),
    ]
    assert env.apply(cs).applied == ()
    # Scanned before the host completed it: the apply itself refuses, blocked.
    (env.root / "e" / "objects").mkdir(parents=True)
    put(env.upper / "e" / "HEAD", b"ref: refs/heads/main\n")
    cs = env.scan()
    (env.root / "e" / "refs").mkdir()
    result = env.apply(cs)
    assert [(o.path, o.reason) for o in result.blocked] == [("e/HEAD", "git_dir")]
    assert not (env.root / "e" / "HEAD").exists()


def test_misleading_new_names_are_blocked(env: Env) -> None:
    put(env.upper / "a\nb.txt", b"x\n")
    put(env.upper / "r\u202efdp.exe" / "inner", b"x\n")
    put(env.upper / "fine.txt", b"x\n")
    cs = env.scan()
    assert sorted((b.path, b.reason) for b in cs.blocked) == [
        ("a\nb.txt", "control_character"),
        ("r\u202efdp.exe", "bidi_control"),
        ("r\u202efdp.exe/inner", "bidi_control"),
    ]
    assert paths_of(env.apply(cs).applied) == [("fine.txt", "create")]
