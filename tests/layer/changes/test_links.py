"""Symlinks and hard links of a change set: scanned, screened by the profile's `symlinks`,
applied beneath held dir fds (symlinkat into a temp name, renamed over), never followed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.layer.changes import ApplyResult, ChangeSet, apply, links, scan
from substrate.sandbox.profiles import ProfileError, load_profile
from substrate.schema.profile import SymlinkMode
from substrate.schema.workspace import Policy
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer
from substrate.workspace.writes.temp_files import TEMP_PREFIX, remove_recorded
from tests.harness.state import DaemonState

ACTOR = "agent:0"
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
FILES: dict[str, str | bytes] = {
    "a.txt": "a\n",
    "d/x": "x\n",
    "d/sub/y": "y\n",
    "old": "old\n",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Env:
    root: Path
    upper: Path
    outside: Path
    ws: Workspace
    writer: Writer
    journal: Journal

    def scan(self, symlinks: SymlinkMode = "any") -> ChangeSet:
        ufd = os.open(self.upper, DIR)
        try:
            return scan(ufd, self.ws.root_fd, symlinks=symlinks)
        finally:
            os.close(ufd)

    def apply(self, cs: ChangeSet, *, dry_run: bool = False) -> ApplyResult:
        ufd = os.open(self.upper, DIR)
        try:
            return apply(self.writer, self.ws, ufd, cs, ACTOR, dry_run=dry_run)
        finally:
            os.close(ufd)

    def link(self, rel: str, target: str | bytes) -> None:
        path = self.upper / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)


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
    ws = daemon_state.registry.adopt(str(root), None, policy, ACTOR)
    upper = tmp_path / "upper"
    upper.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("outside\n")
    writer = Writer(daemon_state.store, daemon_state.journal)
    return Env(root, upper, outside, ws, writer, daemon_state.journal)


# -- pure ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "target", "out"),
    [
        ("x", "/etc/passwd", True),
        ("x", "y", False),
        ("x", "./y", False),
        ("x", "..", True),
        ("x", ".", False),
        ("node_modules/.bin/x", "../x/cli.js", False),
        ("node_modules/.bin/x", "../../x", False),
        ("node_modules/.bin/x", "../../../x", True),
        ("a/b", "c/../../..", True),
        ("a/b", "c/../..", False),
        ("a/b", "x//y/", False),
    ],
)
def test_escapes_is_lexical_from_the_links_directory(path: str, target: str, out: bool) -> None:
    assert links.escapes(path, target) is out


@pytest.mark.parametrize(
    ("mode", "target", "reason"),
    [
        ("any", b"/etc/passwd", None),
        ("inside", b"/etc/passwd", "symlink"),
        ("inside", b"y", None),
        ("none", b"y", "symlink"),
        ("any", b"a" * 1025, "target_too_long"),
        ("any", b"a" * 1024, None),
        ("any", b"\xff", "target_not_utf8"),
        ("any", b"a\nb", "target_control_character"),
        ("any", "a\u202eb".encode(), "target_control_character"),
    ],
)
def test_refusal_names_each_reason(mode: SymlinkMode, target: bytes, reason: str | None) -> None:
    assert links.refusal("d/x", target, mode) == reason


# -- scan ----------------------------------------------------------------------------


def test_scan_lists_links_with_target_and_escapes(env: Env) -> None:
    env.link("node_modules/.bin/x", "../x/cli.js")
    env.link("passwd", "/etc/passwd")
    env.link("loop", "loop")
    env.link("long", "a" * 4000)  # about PATH_MAX: blocked by name
    cs = env.scan()
    by = {c.path: c for c in cs.changes if c.kind == "symlink"}
    assert by["node_modules/.bin/x"].target == "../x/cli.js"
    assert by["node_modules/.bin/x"].escapes is False
    assert by["node_modules/.bin/x"].new_sha256 == sha(b"../x/cli.js")
    assert by["node_modules/.bin/x"].size == len("../x/cli.js")
    assert by["passwd"].target == "/etc/passwd" and by["passwd"].escapes is True
    assert by["loop"].target == "loop" and by["loop"].escapes is False
    assert [(b.path, b.kind, b.reason) for b in cs.blocked] == [
        ("long", "symlink", "target_too_long")
    ]


def test_inside_blocks_an_absolute_link_and_none_blocks_all(env: Env) -> None:
    env.link("rel", "a.txt")
    env.link("abs", "/etc/passwd")
    env.link("up", "../../x")
    inside = env.scan("inside")
    assert [c.path for c in inside.changes if c.kind == "symlink"] == ["rel"]
    assert sorted((b.path, b.reason) for b in inside.blocked) == [
        ("abs", "symlink"),
        ("up", "symlink"),
    ]
    none = env.scan("none")
    assert not [c for c in none.changes if c.kind == "symlink"]
    assert sorted((b.path, b.kind, b.reason) for b in none.blocked) == [
        ("abs", "symlink", "symlink"),
        ("rel", "symlink", "symlink"),
        ("up", "symlink", "symlink"),
    ]


def test_a_refused_link_leaves_what_it_would_replace(env: Env) -> None:
    env.link("old", "/etc/passwd")  # over a file of the checkout
    cs = env.scan("inside")
    assert cs.changes == ()
    assert [(b.path, b.reason) for b in cs.blocked] == [("old", "symlink")]
    env.apply(cs)
    assert (env.root / "old").read_text() == "old\n"


# -- apply ---------------------------------------------------------------------------


def test_links_are_made_beneath_the_checkout_verbatim_and_journaled(env: Env) -> None:
    env.link("node_modules/.bin/x", "../x/cli.js")
    (env.upper / "node_modules/x").mkdir(parents=True)
    (env.upper / "node_modules/x/cli.js").write_text("#!/bin/sh\necho hi\n")
    env.link("passwd", "/etc/passwd")
    env.link("outdir", str(env.outside))
    env.link("loop", "loop")
    env.link("a1", "a2")
    env.link("a2", "a1")
    result = env.apply(env.scan())
    assert not result.conflicts and not result.blocked
    applied = {o.path for o in result.applied if o.kind == "symlink"}
    assert applied == {"node_modules/.bin/x", "passwd", "outdir", "loop", "a1", "a2"}
    for rel, target in [
        ("node_modules/.bin/x", "../x/cli.js"),
        ("passwd", "/etc/passwd"),
        ("outdir", str(env.outside)),
        ("loop", "loop"),
    ]:
        assert os.readlink(env.root / rel) == target
        st = os.lstat(env.root / rel)
        assert (st.st_uid, st.st_gid) == (env.ws.owner_uid, env.ws.owner_gid)
    assert (env.root / "node_modules/.bin/x").read_text() == "#!/bin/sh\necho hi\n"
    assert not [n for n in os.listdir(env.root) if n.startswith(TEMP_PREFIX)]
    assert sorted(os.listdir(env.outside)) == ["secret"]
    entries = [e for e in env.journal.read(limit=1000) if e.kind == "changes.apply_link"]
    by = {str(e.data["path"]).split(":", 1)[1]: e.data for e in entries}
    assert set(by) == applied
    assert by["passwd"]["escapes"] is True and by["loop"]["escapes"] is False
    assert by["passwd"]["target_bytes"] == len("/etc/passwd")
    assert by["passwd"]["new_sha256"] == sha(b"/etc/passwd")
    # The target is agent-chosen text: never journaled, only its length and digest.
    assert all("target" not in d for d in by.values())
    assert str(env.outside) not in repr([e.data for e in entries])


def test_link_replacing_file_file_replacing_link_and_link_replacing_link(env: Env) -> None:
    os.symlink("a.txt", env.root / "ln")  # the checkout's own links
    os.symlink("a.txt", env.root / "ln2")
    os.symlink("a.txt", env.root / "gone")
    env.link("old", "a.txt")  # a link over a file
    (env.upper / "ln").write_text("now a file\n")  # a file over a link
    env.link("ln2", "d/x")  # another target
    os.mknod(env.upper / "gone", 0o20000, os.makedev(0, 0))  # a whiteout: deleted
    cs = env.scan()
    ops = sorted((c.path, c.op, c.kind) for c in cs.changes)
    assert ops == [
        ("gone", "delete", "symlink"),
        ("ln", "create", "file"),
        ("ln", "delete", "symlink"),
        ("ln2", "replace", "symlink"),
        ("old", "create", "symlink"),
        ("old", "delete", "file"),
    ]
    result = env.apply(cs)
    assert not result.conflicts and not result.blocked
    assert os.readlink(env.root / "old") == "a.txt"
    assert not (env.root / "ln").is_symlink()
    assert (env.root / "ln").read_text() == "now a file\n"
    assert os.readlink(env.root / "ln2") == "d/x"
    assert not os.path.lexists(env.root / "gone")
    again = env.apply(cs)  # nothing twice: what it made is unchanged
    assert not again.applied
    assert {("ln2", "replace"), ("old", "create"), ("ln", "create")} <= {
        (o.path, o.op) for o in again.unchanged
    }


def test_a_directory_replaced_by_a_link(env: Env) -> None:
    env.link("d", str(env.outside))
    cs = env.scan()
    assert ("d", "create", "symlink") in [(c.path, c.op, c.kind) for c in cs.changes]
    result = env.apply(cs)
    assert not result.conflicts
    assert os.readlink(env.root / "d") == str(env.outside)
    assert sorted(os.listdir(env.outside)) == ["secret"]


def test_a_host_edit_of_the_link_meanwhile_is_a_conflict(env: Env) -> None:
    os.symlink("a.txt", env.root / "ln")
    env.link("ln", "d/x")
    env.link("new", "a.txt")
    cs = env.scan()
    os.unlink(env.root / "ln")
    os.symlink("d/sub/y", env.root / "ln")  # the person's edit
    os.symlink("old", env.root / "new")  # made on the host since the scan
    result = env.apply(cs)
    reasons = {o.path: o.reason for o in result.conflicts}
    assert reasons == {"ln": "stale_base", "new": "already_exists"}
    by = {o.path: o for o in result.conflicts}
    assert by["ln"].current_sha256 == sha(b"d/sub/y") and by["ln"].kept is None
    assert os.readlink(env.root / "ln") == "d/sub/y"
    assert os.readlink(env.root / "new") == "old"


def test_a_directory_made_a_link_between_scan_and_apply_is_refused_by_name(env: Env) -> None:
    env.link("d/sub/new", "../x")
    (env.upper / "d/sub/file").write_text("f\n")
    cs = env.scan()
    os.rename(env.root / "d/sub", env.root / "moved")
    os.symlink(str(env.outside), env.root / "d/sub")
    result = env.apply(cs)
    assert sorted((o.path, o.reason) for o in result.conflicts) == [
        ("d/sub/file", "symlink_refused"),
        ("d/sub/new", "symlink_refused"),
    ]
    assert sorted(os.listdir(env.outside)) == ["secret"]


@pytest.mark.parametrize("policy", [Policy(write_deny=[".env"])])
def test_a_link_named_env_is_denied_like_a_file(env: Env) -> None:
    env.link(".env", "/etc/passwd")
    env.link(".git", str(env.outside))
    result = env.apply(env.scan())
    assert sorted((o.path, o.reason, o.rule) for o in result.blocked) == [
        (".env", "path_denied", ".env"),
        (".git", "path_denied", ".git/**"),
    ]
    assert not os.path.lexists(env.root / ".env")
    assert not os.path.lexists(env.root / ".git")


def test_link_pieces_count_toward_a_git_directory(env: Env) -> None:
    for piece in ("HEAD", "objects", "refs"):
        env.link(f"fake/{piece}", "/tmp")
    cs = env.scan()
    assert {b.reason for b in cs.blocked} == {"git_dir"}


def test_hard_links_are_applied_as_separate_files(env: Env) -> None:
    (env.upper / "h1").write_text("same\n")
    os.link(env.upper / "h1", env.upper / "h2")
    result = env.apply(env.scan())
    assert sorted(o.path for o in result.applied) == ["h1", "h2"]
    one, two = os.lstat(env.root / "h1"), os.lstat(env.root / "h2")
    assert one.st_ino != two.st_ino and one.st_nlink == two.st_nlink == 1
    assert (env.root / "h2").read_text() == "same\n"


def test_a_fifo_and_a_device_stay_blocked(env: Env) -> None:
    os.mkfifo(env.upper / "fifo")
    os.mknod(env.upper / "dev", 0o20000 | 0o600, os.makedev(1, 3))
    cs = env.scan()
    assert sorted((b.path, b.reason) for b in cs.blocked) == [
        ("dev", "device"),
        ("fifo", "fifo"),
    ]


def test_dry_run_makes_no_link(env: Env) -> None:
    env.link("ln", "a.txt")
    result = env.apply(env.scan(), dry_run=True)
    assert [o.path for o in result.applied] == ["ln"]
    assert not os.path.lexists(env.root / "ln")


def test_a_recorded_temp_link_is_removed_at_start_never_its_target(env: Env) -> None:
    name = TEMP_PREFIX + "0123456789abcdef"
    os.symlink(str(env.outside / "secret"), env.root / name)
    fd = os.open(env.root, DIR)
    try:
        assert remove_recorded(fd, (), name) is True
    finally:
        os.close(fd)
    assert not os.path.lexists(env.root / name)
    assert (env.outside / "secret").read_text() == "outside\n"


def test_rm_r_of_a_directory_holding_a_link_deletes_the_link_itself(env: Env) -> None:
    os.symlink(str(env.outside), env.root / "d/sub/out")
    os.mknod(env.upper / "d", 0o20000, os.makedev(0, 0))  # `rm -r d`: a whiteout
    cs = env.scan()
    assert ("d/sub/out", "delete", "symlink") in [(c.path, c.op, c.kind) for c in cs.changes]
    result = env.apply(cs)
    assert not result.conflicts and not result.blocked
    assert not os.path.lexists(env.root / "d")
    assert sorted(os.listdir(env.outside)) == ["secret"]


# -- the profile key -----------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
LAYER = 'description = "test"\nworkspace = "layer"\nseccomp = "strict"\n'


@pytest.mark.parametrize("mode", ["any", "inside", "none"])
def test_a_layer_profile_declares_symlinks(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text(LAYER + f'symlinks = "{mode}"\n')
    assert load_profile(path, ROOT / "seccomp").symlinks == mode


def test_symlinks_default_any_and_shipped_default_says_so() -> None:
    assert load_profile(ROOT / "profiles" / "default.toml", ROOT / "seccomp").symlinks == "any"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (LAYER + 'symlinks = "some"\n', "symlinks"),
        (LAYER.replace('"layer"', '"rw"') + 'symlinks = "none"\n', "symlinks"),
    ],
)
def test_bad_symlinks_is_refused(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=why):
        load_profile(path, ROOT / "seccomp")
