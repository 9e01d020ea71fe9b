"""Bad paths and bad writes, end to end through the agent socket (docs/protocol.md §2, §3, §4).

Each test asserts the named refusal AND that nothing changed: the workspace and the
directory outside it are byte-for-byte, mode-for-mode the same, and the journal holds no
new write entry for the workspace. One daemon serves the whole module; every test gets
its own freshly adopted workspace:

    a.txt  dir/b.txt  dir/sub/c.txt  adir/  fifo (FIFO)
    link_out_file -> <outside>/secret.txt     link_in_file -> a.txt
    link_out_dir  -> <outside>                link_in_dir  -> dir
    dir/up -> ..                              (and <outside>/secret.txt, <outside>/sub/x)

Non-UTF-8 paths never reach path validation: JSON cannot carry them. A lone surrogate
escape (`"\\udc80"`) and raw invalid UTF-8 bytes in the request line are both parse
errors (-32700, id null), and the connection stays usable.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.protocol.client import Client, RpcError

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

MiB = 1 << 20
WRITE_KINDS = {"fs.write", "fs.patch", "fs.delete"}
_counter = itertools.count(1)

FILES: dict[str, str | bytes] = {
    "a.txt": "alpha\n",
    "dir/b.txt": "beta\nbeta\n",
    "dir/sub/c.txt": "gamma\n",
    "adir/keep": "",
}
SECRET = b"outside secret\n"


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@dataclass
class Env:
    daemon: DaemonProcess
    client: Client
    ws: str
    root: Path
    outside: Path
    snap: Callable[[Path], Any]

    def sha_of(self, rel: str) -> str:
        return sha((self.root / rel).read_bytes())

    def write_entries(self) -> int:
        return len(self.daemon.journal(kinds=WRITE_KINDS, workspace=self.ws))

    def state(self) -> tuple[Any, ...]:
        return (self.snap(self.root), self.snap(self.outside), self.write_entries())

    def refused(self, refusal: str, method: str, **params: Any) -> RpcError:
        """Call `method`, expect `refusal`, and check that nothing changed."""
        before = self.state()
        with pytest.raises(RpcError) as info:
            self.client.call(method, workspace=self.ws, **params)
        assert info.value.refusal == refusal, info.value
        assert self.state() == before
        return info.value

    def ok(self, method: str, **params: Any) -> Any:
        return self.client.call(method, workspace=self.ws, **params)


@pytest.fixture
def env(
    module_daemon: DaemonProcess,
    snapshot_tree: Callable[[Path], Any],
    chown_tree: Callable[[Path], None],
) -> Iterator[Env]:
    n = next(_counter)
    outside = module_daemon.base / f"outside-{n}"
    (outside / "sub").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "sub" / "x").write_bytes(b"x\n")
    root = module_daemon.make_workspace(f"ws-{n}", FILES)
    os.symlink(outside / "secret.txt", root / "link_out_file")
    os.symlink("a.txt", root / "link_in_file")
    os.symlink(outside, root / "link_out_dir")
    os.symlink("dir", root / "link_in_dir")
    os.symlink("..", root / "dir" / "up")
    os.mkfifo(root / "fifo")
    chown_tree(root)
    # A short timeout: a read that blocked on the FIFO would fail the test, not hang it.
    client = Client(module_daemon.agent_path, timeout=20)
    try:
        ws = str(client.call("workspace.adopt", path=str(root))["workspace"])
        yield Env(module_daemon, client, ws, root, outside, snapshot_tree)
    finally:
        client.close()


# --- paths -------------------------------------------------------------------------------

INVALID_PATHS = [
    pytest.param("../x", id="dotdot"),
    pytest.param("a/../../x", id="inner-dotdot"),
    pytest.param("dir/..", id="trailing-dotdot"),
    pytest.param("/etc/passwd", id="absolute"),
    pytest.param("", id="empty"),
    pytest.param("a\\b", id="backslash"),
    pytest.param("a.txt\x00.png", id="nul"),
    pytest.param("./a.txt", id="dot-component"),
    pytest.param("dir//b.txt", id="empty-component"),
    pytest.param("dir/b.txt/", id="trailing-slash"),
    pytest.param("x" * 5000, id="over-4096-bytes"),
    # 2,049 characters but 4,098 bytes: the bound is on bytes.
    pytest.param("\u00e9" * 2049, id="over-4096-utf8-bytes"),
    pytest.param("d/" + "n" * 256, id="name-over-255-bytes"),
]


@pytest.mark.parametrize("path", INVALID_PATHS)
def test_read_invalid_path(env: Env, path: str) -> None:
    env.refused("path_invalid", "fs.read", path=path)


@pytest.mark.parametrize("path", INVALID_PATHS)
def test_stat_invalid_path(env: Env, path: str) -> None:
    env.refused("path_invalid", "fs.stat", path=path)


@pytest.mark.parametrize("path", INVALID_PATHS)
def test_write_invalid_path(env: Env, path: str) -> None:
    env.refused("path_invalid", "fs.write", path=path, content="pwned", base_sha256=None)


@pytest.mark.parametrize("path", INVALID_PATHS)
def test_delete_and_patch_invalid_path(env: Env, path: str) -> None:
    base = env.sha_of("a.txt")
    env.refused("path_invalid", "fs.delete", path=path, base_sha256=base)
    env.refused(
        "path_invalid", "fs.patch", path=path, base_sha256=base, edits=[{"old": "a", "new": "b"}]
    )


def test_dot_is_not_a_file(env: Env) -> None:
    """`.` names the workspace root: valid for fs.stat, invalid for a file operation."""
    env.refused("path_invalid", "fs.read", path=".")
    env.refused("path_invalid", "fs.write", path=".", content="x", base_sha256=None)
    assert env.ok("fs.stat", path=".")["kind"] == "dir"


def test_path_over_schema_bound_is_invalid_params(env: Env) -> None:
    """Past 8,192 characters the schema refuses before path validation, naming the field."""
    before = env.state()
    with pytest.raises(RpcError) as info:
        env.ok("fs.read", path="x" * 9000)
    assert info.value.code == -32602
    assert info.value.refusal == "invalid_params"
    assert info.value.data["path"] == "$.path"
    assert env.state() == before


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(
            b'{"jsonrpc":"2.0","id":1,"method":"fs.read","params":'
            b'{"workspace":"WS","path":"a\\udc80"}}\n',
            id="lone-surrogate-escape",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":1,"method":"fs.read","params":'
            b'{"workspace":"WS","path":"a\xff\xfe.txt"}}\n',
            id="raw-invalid-utf8",
        ),
        pytest.param(
            b'{"jsonrpc":"2.0","id":1,"method":"fs.write","params":{"workspace":"WS",'
            b'"path":"\xc3(.txt","content":"x","base_sha256":null}}\n',
            id="raw-invalid-utf8-write",
        ),
    ],
)
def test_non_utf8_path_is_a_parse_error(env: Env, line: bytes) -> None:
    before = env.state()
    env.client.send_raw(line.replace(b"WS", env.ws.encode()))
    reply = env.client.read_message()
    assert reply["id"] is None
    assert reply["error"]["code"] == -32700
    assert env.state() == before
    # The connection survives a parse error.
    assert env.ok("fs.stat", path="a.txt")["kind"] == "file"


SYMLINK_PATHS = [
    pytest.param("link_out_file", id="target-to-outside"),
    pytest.param("link_in_file", id="target-to-inside"),
    pytest.param("link_out_dir/secret.txt", id="parent-to-outside"),
    pytest.param("link_out_dir/sub/x", id="grandparent-to-outside"),
    pytest.param("link_in_dir/b.txt", id="parent-to-inside"),
    pytest.param("link_in_dir/sub/c.txt", id="grandparent-to-inside"),
    pytest.param("dir/up/a.txt", id="nested-parent-to-inside"),
]


@pytest.mark.parametrize("path", SYMLINK_PATHS)
def test_read_through_symlink_refused(env: Env, path: str) -> None:
    env.refused("symlink_refused", "fs.read", path=path)


@pytest.mark.parametrize("path", [p for p in SYMLINK_PATHS if "/" in p.values[0]])  # type: ignore[operator]
def test_stat_through_symlink_refused(env: Env, path: str) -> None:
    env.refused("symlink_refused", "fs.stat", path=path)


@pytest.mark.parametrize("path", ["link_out_file", "link_in_file"])
def test_stat_of_symlink_reports_it_unfollowed(env: Env, path: str) -> None:
    """fs.stat of a symlink itself is not a refusal: it says `symlink` and reads nothing."""
    before = env.state()
    result = env.ok("fs.stat", path=path)
    assert result["kind"] == "symlink"
    assert result.get("sha256") is None
    assert env.state() == before


@pytest.mark.parametrize("path", SYMLINK_PATHS)
def test_write_through_symlink_refused(env: Env, path: str) -> None:
    """A replace bound to the very bytes behind the link is still refused."""
    target = env.root / path
    base = sha(target.read_bytes())  # resolving here is the test's business, not the daemon's
    env.refused("symlink_refused", "fs.write", path=path, content="pwned\n", base_sha256=base)
    env.refused("symlink_refused", "fs.delete", path=path, base_sha256=base)
    env.refused(
        "symlink_refused",
        "fs.patch",
        path=path,
        base_sha256=base,
        edits=[{"old": target.read_text()[:3], "new": "pwn"}],
    )


@pytest.mark.parametrize(
    "path",
    ["link_out_dir/new.txt", "link_in_dir/new.txt", "link_out_dir/sub/new.txt"],
)
def test_create_through_symlinked_parent_refused(env: Env, path: str) -> None:
    env.refused("symlink_refused", "fs.write", path=path, content="pwned\n", base_sha256=None)
    env.refused(
        "symlink_refused",
        "fs.write",
        path=path,
        content="pwned\n",
        base_sha256=None,
        create_parents=True,
    )


def test_create_parents_through_symlink_refused(env: Env) -> None:
    env.refused(
        "symlink_refused",
        "fs.write",
        path="link_out_dir/newdir/deeper/new.txt",
        content="pwned\n",
        base_sha256=None,
        create_parents=True,
    )


def test_fifo_read_does_not_block(env: Env) -> None:
    env.refused("not_a_file", "fs.read", path="fifo")
    assert env.ok("fs.stat", path="fifo")["kind"] == "other"


def test_fifo_write_refused(env: Env) -> None:
    env.refused("not_a_file", "fs.write", path="fifo", content="x", base_sha256=None)
    env.refused("not_a_file", "fs.write", path="fifo", content="x", base_sha256=sha(b""))


TEMP = ".substrate-tmp-"


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(f"{TEMP}0123456789abcdef", id="top"),
        pytest.param(f"dir/{TEMP}foo", id="nested"),
        pytest.param(f"{TEMP}d/new.txt", id="directory"),
    ],
)
def test_temp_file_names_are_reserved(env: Env, path: str) -> None:
    """A file named like substrate's temp files could later be taken for one: never made."""
    err = env.refused(
        "path_denied", "fs.write", path=path, content="x", base_sha256=None, create_parents=True
    )
    assert err.data["reserved_prefix"] == TEMP


def test_a_users_temp_named_file_is_neither_patched_nor_deleted(
    env: Env, chown_tree: Callable[[Path], None]
) -> None:
    (env.root / f"{TEMP}foo").write_text("beta\n")
    chown_tree(env.root)
    base = sha("beta\n")
    env.refused("path_denied", "fs.delete", path=f"{TEMP}foo", base_sha256=base)
    env.refused(
        "path_denied",
        "fs.patch",
        path=f"{TEMP}foo",
        base_sha256=base,
        edits=[{"old": "beta", "new": "x"}],
    )
    env.refused("path_denied", "fs.write", path=f"{TEMP}foo", content="x", base_sha256=base)
    assert (env.root / f"{TEMP}foo").read_text() == "beta\n"


def test_directory_as_a_file(env: Env) -> None:
    env.refused("not_a_file", "fs.read", path="adir")
    env.refused("not_a_file", "fs.write", path="adir", content="x", base_sha256=None)
    env.refused("not_a_file", "fs.delete", path="adir", base_sha256=sha(b""))


def test_file_as_a_directory(env: Env) -> None:
    env.refused("not_a_directory", "fs.read", path="a.txt/x")
    env.refused("not_a_directory", "fs.write", path="a.txt/x", content="x", base_sha256=None)


def test_missing_file(env: Env) -> None:
    env.refused("not_found", "fs.read", path="nope.txt")
    env.refused("not_found", "fs.read", path="nodir/nope.txt")
    env.refused("not_found", "fs.write", path="nodir/new.txt", content="x", base_sha256=None)
    env.refused("not_found", "fs.delete", path="nope.txt", base_sha256=sha(b""))


def test_read_length_over_bound(env: Env) -> None:
    err = env.refused("too_large", "fs.read", path="a.txt", length=4 * MiB + 1)
    assert err.data.get("limit") == 4 * MiB
    assert env.ok("fs.read", path="a.txt", length=4 * MiB)["data"] == "alpha\n"


def test_unknown_workspace(env: Env) -> None:
    before = env.state()
    with pytest.raises(RpcError) as info:
        env.client.call("fs.read", workspace="ws_doesnotexist", path="a.txt")
    assert info.value.refusal == "unknown_workspace"
    assert env.state() == before


# --- writes ------------------------------------------------------------------------------


def test_stale_base(env: Env) -> None:
    current = env.sha_of("a.txt")
    err = env.refused(
        "stale_base", "fs.write", path="a.txt", content="new\n", base_sha256=sha("other")
    )
    assert err.data["current_sha256"] == current
    err = env.refused(
        "stale_base",
        "fs.patch",
        path="a.txt",
        base_sha256=sha("other"),
        edits=[{"old": "alpha", "new": "omega"}],
    )
    assert err.data["current_sha256"] == current


def test_stale_base_on_missing_file_reports_null(env: Env) -> None:
    err = env.refused("stale_base", "fs.write", path="new.txt", content="x", base_sha256=sha("x"))
    assert err.data["current_sha256"] is None


def test_create_over_existing_file(env: Env) -> None:
    env.refused("already_exists", "fs.write", path="a.txt", content="new\n", base_sha256=None)
    env.refused("already_exists", "fs.write", path="dir/b.txt", content="new\n", base_sha256=None)


def test_delete_with_wrong_base(env: Env) -> None:
    err = env.refused("stale_base", "fs.delete", path="a.txt", base_sha256=sha("not it"))
    assert err.data["current_sha256"] == env.sha_of("a.txt")


@pytest.mark.parametrize(
    ("edits", "occurrences"),
    [
        pytest.param([{"old": "absent", "new": "x"}], 0, id="zero"),
        pytest.param([{"old": "beta", "new": "x"}], 2, id="two"),
        pytest.param([{"old": "beta", "new": "x", "count": 3}], 2, id="two-of-three"),
        pytest.param(
            [{"old": "beta\nbeta", "new": "x"}, {"old": "beta", "new": "y"}], 0, id="second-edit"
        ),
    ],
)
def test_patch_conflict(env: Env, edits: list[dict[str, Any]], occurrences: int) -> None:
    err = env.refused(
        "patch_conflict",
        "fs.patch",
        path="dir/b.txt",
        base_sha256=env.sha_of("dir/b.txt"),
        edits=edits,
    )
    assert err.data.get("occurrences") == occurrences


def test_patch_unified_diff_conflict(env: Env) -> None:
    diff = "--- a/dir/b.txt\n+++ b/dir/b.txt\n@@ -1,2 +1,2 @@\n-gamma\n+delta\n beta\n"
    env.refused(
        "patch_conflict",
        "fs.patch",
        path="dir/b.txt",
        base_sha256=env.sha_of("dir/b.txt"),
        unified_diff=diff,
    )


def test_patch_amplification_is_too_large(env: Env) -> None:
    """A 100 kB file, then edits asking for 100 MB: refused before it is built, file as it was."""
    body = "ab" * 50_000
    env.ok("fs.write", path="amp.txt", content=body, base_sha256=None)
    edits = [
        {"old": "b", "new": "bb", "count": 50_000},  # many matches for the next edit...
        {"old": "b", "new": "b" * 1000, "count": 100_000},  # ...each made 1000 times bigger
    ]
    err = env.refused("too_large", "fs.patch", path="amp.txt", base_sha256=sha(body), edits=edits)
    assert err.data["limit"] == 64 * MiB
    assert (env.root / "amp.txt").read_text() == body


def test_unified_diff_past_the_size_bound_is_too_large(env: Env) -> None:
    body = b"x" * (64 * MiB - 4) + b"\n"
    (env.root / "big.txt").write_bytes(body)
    grow = "@@ -1,0 +2,2 @@\n+0123456789\n+0123456789\n"  # 22 bytes after the last line
    err = env.refused(
        "too_large", "fs.patch", path="big.txt", base_sha256=sha(body), unified_diff=grow
    )
    assert err.data["limit"] == 64 * MiB


def test_plan_digest_mismatch(env: Env) -> None:
    base = env.sha_of("a.txt")
    plan = env.ok("fs.write", path="a.txt", content="one\n", base_sha256=base, dry_run=True)
    assert plan["applied"] is False
    # The digest of one plan does not authorize another content...
    err = env.refused(
        "plan_mismatch",
        "fs.write",
        path="a.txt",
        content="two\n",
        base_sha256=base,
        plan_digest=plan["plan_digest"],
    )
    assert err.data["plan_digest"] != plan["plan_digest"]
    # ...nor another mode, nor a made-up digest.
    env.refused(
        "plan_mismatch",
        "fs.write",
        path="a.txt",
        content="one\n",
        base_sha256=base,
        mode=0o600,
        plan_digest=plan["plan_digest"],
    )
    env.refused(
        "plan_mismatch",
        "fs.delete",
        path="a.txt",
        base_sha256=base,
        plan_digest=plan["plan_digest"],
    )
    env.refused(
        "plan_mismatch",
        "fs.write",
        path="a.txt",
        content="one\n",
        base_sha256=base,
        plan_digest="0" * 64,
    )
    # The matching digest applies.
    applied = env.ok(
        "fs.write", path="a.txt", content="one\n", base_sha256=base, plan_digest=plan["plan_digest"]
    )
    assert applied["applied"] is True
    assert (env.root / "a.txt").read_bytes() == b"one\n"


def test_dry_run_changes_nothing(env: Env) -> None:
    before = env.state()
    base = env.sha_of("a.txt")
    env.ok("fs.write", path="a.txt", content="x\n", base_sha256=base, dry_run=True)
    env.ok(
        "fs.write",
        path="new/n.txt",
        content="x\n",
        base_sha256=None,
        dry_run=True,
        create_parents=True,
    )
    env.ok("fs.delete", path="a.txt", base_sha256=base, dry_run=True)
    env.ok(
        "fs.patch",
        path="a.txt",
        base_sha256=base,
        edits=[{"old": "alpha", "new": "b"}],
        dry_run=True,
    )
    assert env.state() == before


@pytest.fixture
def approval_env(
    module_daemon: DaemonProcess, snapshot_tree: Callable[[Path], Any]
) -> Iterator[tuple[Env, Client]]:
    n = next(_counter)
    outside = module_daemon.base / f"outside-{n}"
    outside.mkdir()
    root = module_daemon.make_workspace(
        f"ws-approve-{n}", {"secure/conf.txt": "v1\n", "open.txt": "open\n"}
    )
    client = Client(module_daemon.agent_path, timeout=20)
    operator = Client(module_daemon.operator_path, timeout=20)
    try:
        ws = client.call(
            "workspace.adopt", path=str(root), policy={"require_approval": ["secure/**"]}
        )["workspace"]
        yield Env(module_daemon, client, ws, root, outside, snapshot_tree), operator
    finally:
        client.close()
        operator.close()


def test_approval_required_then_granted_once(approval_env: tuple[Env, Client]) -> None:
    env, operator = approval_env
    v1, v2 = "v1\n", "v2\n"
    # Without approval: refused, with the digest an operator would approve.
    err = env.refused(
        "approval_required", "fs.write", path="secure/conf.txt", content=v2, base_sha256=sha(v1)
    )
    digest = err.data["plan_digest"]
    dry = env.ok("fs.write", path="secure/conf.txt", content=v2, base_sha256=sha(v1), dry_run=True)
    assert dry["plan_digest"] == digest and dry["applied"] is False
    # An agent cannot approve its own plan.
    with pytest.raises(RpcError) as info:
        env.client.call("approval.grant", workspace=env.ws, plan_digest=digest)
    assert info.value.refusal == "unauthorized"
    env.refused(
        "approval_required", "fs.write", path="secure/conf.txt", content=v2, base_sha256=sha(v1)
    )

    # An approval of this digest does not authorize a different plan.
    operator.call("approval.grant", workspace=env.ws, plan_digest=digest)
    env.refused(
        "approval_required", "fs.write", path="secure/conf.txt", content="v3\n", base_sha256=sha(v1)
    )
    # It authorizes exactly this one, once.
    plan = env.ok("fs.write", path="secure/conf.txt", content=v2, base_sha256=sha(v1))
    assert plan["applied"] is True and plan["plan_digest"] == digest
    assert (env.root / "secure/conf.txt").read_text() == v2
    entries = env.daemon.journal(kinds={"fs.write"}, workspace=env.ws)
    assert entries[-1]["data"]["plan_digest"] == digest
    assert entries[-1]["data"]["approval_id"]

    # Back to v1 (its own approval), then the very same plan again: the first approval
    # is spent, so it needs a new one.
    back = env.refused(
        "approval_required", "fs.write", path="secure/conf.txt", content=v1, base_sha256=sha(v2)
    )
    operator.call("approval.grant", workspace=env.ws, plan_digest=back.data["plan_digest"])
    env.ok("fs.write", path="secure/conf.txt", content=v1, base_sha256=sha(v2))
    again = env.refused(
        "approval_required", "fs.write", path="secure/conf.txt", content=v2, base_sha256=sha(v1)
    )
    assert again.data["plan_digest"] == digest
    operator.call("approval.grant", workspace=env.ws, plan_digest=digest)
    assert env.ok("fs.write", path="secure/conf.txt", content=v2, base_sha256=sha(v1))["applied"]

    # Paths outside require_approval need none.
    assert env.ok("fs.write", path="open.txt", content="x\n", base_sha256=sha("open\n"))["applied"]


def test_approval_required_for_create_and_delete(approval_env: tuple[Env, Client]) -> None:
    env, operator = approval_env
    env.refused(
        "approval_required", "fs.write", path="secure/new.txt", content="n\n", base_sha256=None
    )
    err = env.refused(
        "approval_required", "fs.delete", path="secure/conf.txt", base_sha256=sha("v1\n")
    )
    operator.call("approval.grant", workspace=env.ws, plan_digest=err.data["plan_digest"])
    assert env.ok("fs.delete", path="secure/conf.txt", base_sha256=sha("v1\n"))["applied"]
    assert not (env.root / "secure/conf.txt").exists()


def test_approval_is_per_workspace(
    approval_env: tuple[Env, Client], module_daemon: DaemonProcess
) -> None:
    env, operator = approval_env
    other = module_daemon.make_workspace(f"ws-other-{next(_counter)}", {"x": "x"})
    other_ws = env.client.call("workspace.adopt", path=str(other))["workspace"]
    err = env.refused(
        "approval_required",
        "fs.write",
        path="secure/conf.txt",
        content="v2\n",
        base_sha256=sha("v1\n"),
    )
    operator.call("approval.grant", workspace=other_ws, plan_digest=err.data["plan_digest"])
    env.refused(
        "approval_required",
        "fs.write",
        path="secure/conf.txt",
        content="v2\n",
        base_sha256=sha("v1\n"),
    )


@pytest.fixture
def git_env(module_daemon: DaemonProcess, snapshot_tree: Callable[[Path], Any]) -> Iterator[Env]:
    n = next(_counter)
    outside = module_daemon.base / f"outside-{n}"
    outside.mkdir()
    root = module_daemon.make_workspace(
        f"ws-git-{n}", {"src/x.secret": "s\n", "README.md": "r\n", "x.secret": "t\n"}, git=True
    )
    client = Client(module_daemon.agent_path, timeout=20)
    try:
        ws = client.call(
            "workspace.adopt",
            path=str(root),
            policy={"write_deny": ["*.secret"]},
        )["workspace"]
        yield Env(module_daemon, client, ws, root, outside, snapshot_tree)
    finally:
        client.close()


def test_write_deny_git_config(git_env: Env) -> None:
    env = git_env
    base = env.sha_of(".git/config")
    hook = "#!/bin/sh\ntouch /tmp/pwned\n"
    env.refused("path_denied", "fs.write", path=".git/config", content="[core]\n", base_sha256=base)
    env.refused(
        "path_denied",
        "fs.patch",
        path=".git/config",
        base_sha256=base,
        edits=[{"old": "[core]", "new": "[core]\n\tfsmonitor = /tmp/x"}],
    )
    env.refused("path_denied", "fs.delete", path=".git/HEAD", base_sha256=env.sha_of(".git/HEAD"))
    env.refused(
        "path_denied",
        "fs.write",
        path=".git/hooks/pre-commit",
        content=hook,
        base_sha256=None,
        mode=0o755,
    )
    # `.git` itself cannot be replaced by a file either.
    env.refused("path_denied", "fs.write", path=".git", content="gitdir: /tmp\n", base_sha256=None)
    # Reading is allowed (only writes are denied by default).
    assert env.ok("fs.read", path=".git/HEAD")["data"].startswith("ref: ")


def test_write_deny_custom_globs(git_env: Env) -> None:
    env = git_env
    env.refused("path_denied", "fs.write", path="x.secret", content="y", base_sha256=sha("t\n"))
    env.refused("path_denied", "fs.write", path="src/x.secret", content="y", base_sha256=sha("s\n"))
    env.refused(
        "path_denied",
        "fs.write",
        path="new/deep/z.secret",
        content="y",
        base_sha256=None,
        create_parents=True,
    )
    # The default `.git/**` is still there although the caller gave its own deny list.
    env.refused(
        "path_denied",
        "fs.write",
        path=".git/config",
        content="x",
        base_sha256=env.sha_of(".git/config"),
    )


def test_write_allow_list(
    module_daemon: DaemonProcess, snapshot_tree: Callable[[Path], Any]
) -> None:
    n = next(_counter)
    outside = module_daemon.base / f"outside-{n}"
    outside.mkdir()
    root = module_daemon.make_workspace(f"ws-allow-{n}", {"src/a.py": "a\n", "README.md": "r\n"})
    with Client(module_daemon.agent_path, timeout=20) as client:
        ws = client.call("workspace.adopt", path=str(root), policy={"write_allow": ["src/**"]})[
            "workspace"
        ]
        env = Env(module_daemon, client, ws, root, outside, snapshot_tree)
        env.refused(
            "path_denied", "fs.write", path="README.md", content="x", base_sha256=sha("r\n")
        )
        env.refused(
            "path_denied",
            "fs.write",
            path="other/new.py",
            content="x",
            base_sha256=None,
            create_parents=True,
        )
        assert env.ok("fs.write", path="src/a.py", content="b\n", base_sha256=sha("a\n"))["applied"]


def test_read_deny(module_daemon: DaemonProcess, snapshot_tree: Callable[[Path], Any]) -> None:
    n = next(_counter)
    outside = module_daemon.base / f"outside-{n}"
    outside.mkdir()
    root = module_daemon.make_workspace(
        f"ws-rdeny-{n}", {".env": "TOKEN=hunter2\n", "keys/id": "k\n", "a.txt": "TOKEN? no\n"}
    )
    with Client(module_daemon.agent_path, timeout=20) as client:
        ws = client.call(
            "workspace.adopt", path=str(root), policy={"read_deny": [".env", "keys/"]}
        )["workspace"]
        env = Env(module_daemon, client, ws, root, outside, snapshot_tree)
        env.refused("path_denied", "fs.read", path=".env")
        env.refused("path_denied", "fs.read", path="keys/id")
        found = env.ok("fs.search", pattern="TOKEN")
        assert [m["path"] for m in found["matches"]] == ["a.txt"]


def test_refusals_never_journal_content(env: Env) -> None:
    marker = "CONTENT-MARKER-7f3a9c"
    env.refused("already_exists", "fs.write", path="a.txt", content=marker, base_sha256=None)
    env.refused(
        "symlink_refused", "fs.write", path="link_out_file", content=marker, base_sha256=sha(SECRET)
    )
    env.refused("path_invalid", "fs.write", path="../" + marker, content=marker, base_sha256=None)
    entries = env.daemon.journal(workspace=env.ws)
    assert [e for e in entries if e["kind"] == "refusal"], "refused writes are journaled"
    assert marker not in json.dumps(entries).replace("../" + marker, "")


def test_writes_never_make_set_id_files(module_daemon: DaemonProcess) -> None:
    """The daemon writes as root with the agent's bytes: no setuid/setgid bit may result.

    Neither asked for (`mode`), nor kept from the file replaced (a root-owned set-id
    binary whose content an agent could otherwise swap for its own).
    """
    root = module_daemon.make_workspace(
        f"ws-setid-{next(_counter)}", {"tool": "old\n", "plain": "p\n"}
    )
    os.chown(root / "tool", 0, 0)
    os.chmod(root / "tool", 0o6755)
    ws = module_daemon.adopt(root)
    elf_ish = "\x7fELF pretend\n"
    with Client(module_daemon.agent_path, timeout=20) as c:
        created = c.call(
            "fs.write", workspace=ws, path="new", content=elf_ish, base_sha256=None, mode=0o4755
        )
        replaced = c.call(
            "fs.write", workspace=ws, path="tool", content=elf_ish, base_sha256=sha("old\n")
        )
        chmodded = c.call(
            "fs.write",
            workspace=ws,
            path="plain",
            content="p\n",
            base_sha256=sha("p\n"),
            mode=0o2777,
        )
    for plan, name in ((created, "new"), (replaced, "tool"), (chmodded, "plain")):
        st = os.lstat(root / name)
        assert st.st_mode & (stat.S_ISUID | stat.S_ISGID) == 0, (name, oct(st.st_mode))
        assert plan["mode"] == stat.S_IMODE(st.st_mode)
    assert stat.S_IMODE(os.lstat(root / "new").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(root / "tool").st_mode) == 0o755
    assert os.lstat(root / "tool").st_uid == 0  # owner kept, privileges not
