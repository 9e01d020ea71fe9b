"""`substrate.integrations.inspect.commands`: Inspect's calls as argv, pure."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from inspect_ai.util import SandboxUserUnsupportedError

from substrate.integrations.inspect.calls import MAX_ARGV_ITEMS, Daemon
from substrate.integrations.inspect.commands import (
    CD_SCRIPT,
    EXEC_SCRIPT,
    EXEC_STAGED_SCRIPT,
    MAX_STAGED_ARGV_BYTES,
    Identity,
    exec_argv,
    exec_parts,
    exec_permission_error,
    file_error,
    parse_id,
    run_staged_argv,
    stage_argv,
    staged_argv,
    staged_path,
    workspace_path,
)

OWNER = Identity(uid=1000, gid=1000, name="agent", owner_uid=1000, owner_gid=1000)
ROOT = Identity(uid=0, gid=0, name="root", owner_uid=1000, owner_gid=1000)


@pytest.mark.parametrize(
    ("file", "expected"),
    [
        ("a.txt", "a.txt"),
        ("dir/./b", "dir/b"),
        ("/workspace", "."),
        ("/workspace/src/x.py", "src/x.py"),
        ("/workspace/../etc/passwd", None),
        ("/workspacex/y", None),
        ("/tmp/z", None),
        ("https:/en.wikipedia.org/wiki/X", "https:/en.wikipedia.org/wiki/X"),
    ],
)
def test_workspace_path(file: str, expected: str | None) -> None:
    assert workspace_path(file) == expected


def test_parse_id() -> None:
    found = parse_id("uid=1000(agent) gid=1000(agent) groups=1000(agent)\n", (1000, 1000))
    assert found == OWNER
    assert parse_id("uid=0(root) gid=0(root) groups=0(root)", (1000, 1000)).root
    with pytest.raises(ValueError, match="not the output of id"):
        parse_id("sh: id: not found", (1000, 1000))


def test_exec_as_the_profiles_own_user_adds_nothing() -> None:
    assert exec_argv(["ls"], cwd=None, env=None, user=None, identity=OWNER) == (["ls"], ".")
    assert exec_argv(["ls"], cwd="src", env=None, user="agent", identity=OWNER) == (["ls"], "src")
    with pytest.raises(SandboxUserUnsupportedError, match="runs commands as agent"):
        exec_argv(["ls"], cwd=None, env=None, user="root", identity=OWNER)


def test_on_a_root_profile_the_default_user_is_the_owner() -> None:
    argv, _ = exec_argv(["id"], cwd=None, env=None, user=None, identity=ROOT)
    assert argv == [
        "/usr/bin/setpriv",
        "--reuid=1000",
        "--regid=1000",
        "--clear-groups",
        "--",
        "id",
    ]
    assert exec_argv(["id"], cwd=None, env=None, user="root", identity=ROOT)[0] == ["id"]
    argv, _ = exec_argv(["id"], cwd=None, env=None, user="bob", identity=ROOT)
    assert argv == ["/usr/sbin/runuser", "-u", "bob", "--", "id"]


def test_env_and_an_absolute_cwd_are_wrappers_fed_arguments() -> None:
    argv, cwd = exec_argv(
        ["ls", "$HOME"], cwd="/usr/bin", env={"A": "1 2", "B": "`x`"}, user=None, identity=OWNER
    )
    assert argv == [
        "/usr/bin/env",
        "A=1 2",
        "B=`x`",
        "/bin/sh",
        "-c",
        CD_SCRIPT,
        "sh",
        "/usr/bin",
        "ls",
        "$HOME",
    ]
    assert cwd == "."
    assert exec_argv(["ls"], cwd="/workspace/sub", env=None, user=None, identity=OWNER)[1] == "sub"
    with pytest.raises(ValueError, match="cannot be set"):
        exec_argv(["ls"], cwd=None, env={"A=B": "x"}, user=None, identity=OWNER)
    with pytest.raises(ValueError, match="needs a command"):
        exec_argv([], cwd=None, env=None, user=None, identity=OWNER)


def test_file_script_exit_codes_are_inspects_exceptions() -> None:
    assert file_error(0, "f", "") is None
    assert isinstance(file_error(21, "/etc", ""), IsADirectoryError)
    missing = file_error(2, "nope", "")
    assert isinstance(missing, FileNotFoundError) and "nope" in str(missing)
    assert isinstance(file_error(13, "f", ""), PermissionError)
    assert isinstance(file_error(1, "f", "sh: f: Permission denied"), PermissionError)
    other = file_error(1, "f", "disk full")
    assert type(other) is OSError and other.errno == errno.EIO


def test_exit_126_permission_denied_is_a_permission_error() -> None:
    assert isinstance(
        exec_permission_error(126, "exec: Permission denied", ["/etc/passwd"]), PermissionError
    )
    assert exec_permission_error(126, "other", ["x"]) is None
    assert exec_permission_error(1, "Permission denied", ["x"]) is None


def test_exec_parts_keep_the_user_wrapper_apart() -> None:
    parts = exec_parts(["ls"], cwd="/etc", env={"A": "1"}, user=None, identity=ROOT)
    assert parts.user == [
        "/usr/bin/setpriv",
        "--reuid=1000",
        "--regid=1000",
        "--clear-groups",
        "--",
    ]
    assert parts.rest == ["/usr/bin/env", "A=1", "/bin/sh", "-c", CD_SCRIPT, "sh", "/etc", "ls"]
    assert parts.argv == exec_argv(["ls"], cwd="/etc", env={"A": "1"}, user=None, identity=ROOT)[0]
    assert run_staged_argv(parts.user, "/tmp/substrate-argv.Ab12")[-4:] == [
        "-c",
        EXEC_STAGED_SCRIPT,
        "bash",
        "/tmp/substrate-argv.Ab12",
    ]
    assert stage_argv([])[:2] == ["/bin/sh", "-c"]


def test_a_staged_argv_is_nul_terminated_and_capped() -> None:
    assert staged_argv(["printf", "%s", "", "a b"]) == b"printf\0%s\0\0a b\0"
    # A first word holding "=" is not taken by `env -i` for an assignment.
    assert staged_argv(["a=b"]) == b"/bin/sh\0-c\0" + EXEC_SCRIPT.encode() + b"\0sh\0a=b\0"
    assert len(staged_argv(["x" * (MAX_STAGED_ARGV_BYTES - 1)])) == MAX_STAGED_ARGV_BYTES
    with pytest.raises(OSError) as over:
        staged_argv(["x" * MAX_STAGED_ARGV_BYTES])
    assert over.value.errno == errno.E2BIG
    with pytest.raises(ValueError, match="NUL"):
        staged_argv(["echo", "a\0b"])
    with pytest.raises(ValueError, match="needs a command"):
        staged_argv([])


def test_staged_path_is_only_the_stage_scripts_output() -> None:
    assert staged_path("/tmp/substrate-argv.Ab12XyZ") == "/tmp/substrate-argv.Ab12XyZ"
    for other in ("", "/tmp/substrate-argv.", "/etc/passwd", "/tmp/substrate-argv.a/../b"):
        with pytest.raises(ValueError, match="not a staged"):
            staged_path(other)


def test_one_request_carries_an_argv_within_the_daemons_caps() -> None:
    daemon = Daemon(socket=Path("/nonexistent"), max_request_bytes=1 << 20, adopt_roots=())
    ok = ["printf", "%s", *(["x" * (64 << 10)] * 15)]
    assert daemon.carries("w", "eval", ok, cwd=".", timeout=None)
    assert not daemon.carries("w", "eval", [*ok, "x" * (64 << 10)], cwd=".", timeout=None)
    assert not daemon.carries("w", "eval", ["y"] * (MAX_ARGV_ITEMS + 1), cwd=".", timeout=None)
    small = Daemon(socket=Path("/nonexistent"), max_request_bytes=4096, adopt_roots=())
    assert not small.carries("w", "eval", ["echo", "z" * 4096], cwd=".", timeout=None)
    assert small.carries("w", "eval", ["echo", "z"], cwd=".", timeout=5)
