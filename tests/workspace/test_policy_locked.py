"""The policy belongs to the operator (docs/protocol.md §2), end to end through the real sockets.

An agent used to loosen any policy: release and re-adopt with `policy: {}`; adopt a
checkout's `.git` as a workspace and write its hooks; adopt a `read_deny` subdirectory
(or a parent, or the adopt root) and read what was denied. And a nested repository's
`.git` was writable by guarded writes. Each test here failed on that code.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import substrate
from substrate.config import ConfigError, load_config
from substrate.errors import all_refusals
from substrate.protocol.client import Client, RpcError

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

LOCKED = {"read_deny": ["*.pem"], "write_deny": ["dist/"], "require_approval": ["ci/**"]}


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def refusal(client: Client, method: str, **params: Any) -> RpcError:
    with pytest.raises(RpcError) as info:
        client.call(method, **params)
    return info.value


def test_policy_locked_is_a_named_refusal() -> None:
    assert all_refusals()["policy_locked"].name == "policy_locked"


def test_release_and_readopt_with_an_empty_policy_is_locked(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("proj", {"id.pem": "key\n", "a.txt": "a\n"})
    with daemon.client() as c:
        ws = c.call("workspace.adopt", path=str(root), policy=LOCKED)["workspace"]
        c.call("workspace.release", workspace=ws)
        err = refusal(c, "workspace.adopt", path=str(root), policy={})
        assert err.code == -32001 and err.refusal == "policy_locked"
        assert err.data["dropped"] == {
            "write_deny": ["dist/"],
            "read_deny": ["*.pem"],
            "require_approval": ["ci/**"],
        }
        assert c.call("workspace.list")["workspaces"] == []  # nothing changed
        again = c.call("workspace.adopt", path=str(root))
        assert again["policy"]["read_deny"] == ["*.pem"]
        assert refusal(c, "fs.read", workspace=again["workspace"], path="id.pem").refusal == (
            "path_denied"
        )
    daemon.restart()
    with daemon.client() as c:
        (info,) = c.call("workspace.list")["workspaces"]
        c.call("workspace.release", workspace=info["workspace"])
        assert refusal(c, "workspace.adopt", path=str(root), policy={}).refusal == "policy_locked"
        ws = c.call("workspace.adopt", path=str(root))["workspace"]
        assert refusal(c, "fs.read", workspace=ws, path="id.pem").refusal == "path_denied"


def test_set_policy_is_operator_only_journaled_and_may_loosen(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("proj", {"id.pem": "key\n"})
    with daemon.client() as agent, daemon.operator() as operator:
        ws = agent.call("workspace.adopt", path=str(root), policy=LOCKED)["workspace"]
        err = refusal(agent, "workspace.set_policy", workspace=ws, policy={})
        assert err.refusal == "unauthorized"
        assert agent.call("workspace.info", workspace=ws)["policy"]["read_deny"] == ["*.pem"]
        info = operator.call("workspace.set_policy", workspace=ws, policy={"read_deny": ["*.key"]})
        assert info["policy"]["read_deny"] == ["*.key"]
        assert info["policy"]["write_deny"] == [".git/**"]
        assert agent.call("fs.read", workspace=ws, path="id.pem")["data"] == "key\n"
        bad = refusal(operator, "workspace.set_policy", workspace=ws, policy={"read_deny": ["!x"]})
        assert bad.refusal == "invalid_params"
    (entry,) = daemon.journal(kinds={"workspace.policy_set"})
    assert entry["actor"].startswith("operator:") and entry["workspace"] == ws
    assert entry["data"]["globs"]["read_deny"] == 1


def test_the_operator_default_policy_applies(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(start=False)
    with d.config_path.open("a") as f:
        f.write('[policy]\nread_deny = ["*.key"]\nwrite_deny = ["vendor/**"]\n')
    d.start()
    root = d.make_workspace("proj", {"id.key": "k\n", "vendor/x": "x\n"})
    with d.client() as c, d.operator() as operator:
        info = c.call("workspace.adopt", path=str(root))
        ws = info["workspace"]
        assert info["policy"]["read_deny"] == ["*.key"]
        assert refusal(c, "fs.read", workspace=ws, path="id.key").refusal == "path_denied"
        err = refusal(
            c, "fs.write", workspace=ws, path="vendor/x", content="y", base_sha256=sha("x\n")
        )
        assert err.refusal == "path_denied"
        dropped = refusal(c, "workspace.adopt", path=str(root), policy={"read_deny": ["*.pem"]})
        assert dropped.refusal == "policy_locked"
        # The operator's per-checkout policy adds to the default; it cannot go below it.
        operator.call("workspace.set_policy", workspace=ws, policy={})
        assert refusal(c, "fs.read", workspace=ws, path="id.key").refusal == "path_denied"


def test_the_git_dir_of_a_checkout_is_never_a_workspace(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("proj", git=True)
    with daemon.client() as c:
        for path in [root / ".git", root / ".git" / "hooks"]:
            err = refusal(c, "workspace.adopt", path=str(path))
            assert err.refusal == "path_denied"
        assert c.call("workspace.list")["workspaces"] == []
    assert not (root / ".git" / "hooks" / "pre-commit").exists()


@pytest.mark.parametrize(
    "target", ["secrets", "proj", "", "proj/nested"], ids=["denied-dir", "parent", "root", "deep"]
)
def test_adopting_around_a_workspace_reads_nothing_it_denied(
    daemon: DaemonProcess, target: str
) -> None:
    """Adopt a checkout that denies `secrets/`, then adopt a directory that contains
    those files in another place relative to its root: they stay denied."""
    inner = daemon.make_workspace(
        "proj/nested", {"secrets/db.txt": "pw\n", "ok.txt": "ok\n", "dist/out": "o\n"}
    )
    with daemon.client() as c:
        ws = c.call("workspace.adopt", path=str(inner), policy={"read_deny": ["secrets/"]})
        c.call("workspace.release", workspace=ws["workspace"])
        path = inner / "secrets" if target == "secrets" else daemon.adopt_root / target
        other = c.call("workspace.adopt", path=str(path))["workspace"]
        rel = str((inner / "secrets" / "db.txt").relative_to(path))
        assert refusal(c, "fs.read", workspace=other, path=rel).refusal == "path_denied"
        hits = c.call("fs.search", workspace=other, pattern="pw")["matches"]
        assert hits == []
        if target != "secrets":
            ok = str((inner / "ok.txt").relative_to(path))
            assert c.call("fs.read", workspace=other, path=ok)["data"] == "ok\n"


@pytest.mark.parametrize("git", ["vendor/lib/.git/config", "vendor/lib/.git", "a/b/.git/hooks/x"])
def test_every_nested_git_is_write_denied(
    daemon: DaemonProcess, chown_tree: Callable[[Path], None], git: str
) -> None:
    """Nested repositories, submodules (`.git` files) and worktrees: like the top one."""
    root = daemon.make_workspace("proj", {git: "gitdir: ../../.git/modules/lib\n"})
    before = (root / git).read_bytes()
    with daemon.client() as c:
        ws = c.call("workspace.adopt", path=str(root))["workspace"]
        base = sha(before)
        for method, params in [
            ("fs.write", {"content": "evil", "base_sha256": base}),
            ("fs.patch", {"base_sha256": base, "edits": [{"old": "gitdir", "new": "evil"}]}),
            ("fs.delete", {"base_sha256": base}),
        ]:
            err = refusal(c, method, workspace=ws, path=git, **params)
            assert err.refusal == "path_denied", method
        created = git.split(".git")[0] + ".git/new-hook"
        err = refusal(c, "fs.write", workspace=ws, path=created, content="x", base_sha256=None)
        assert err.refusal == "path_denied"
        # Reads of a nested `.git` are allowed, as of the top-level one.
        assert c.call("fs.read", workspace=ws, path=git)["sha256"] == base
    assert (root / git).read_bytes() == before
    assert not (root / created).exists()


def test_config_policy_section(tmp_path: Path) -> None:
    path = tmp_path / "substrate.toml"
    path.write_text('adopt_roots = []\n[policy]\nread_deny = ["*.key"]\n')
    config = load_config(path, {})
    assert config.policy.read_deny == ["*.key"]
    assert config.policy.write_deny == [".git/**"]
    path.write_text('[policy]\nread_deny = ["!x"]\n')
    with pytest.raises(ConfigError, match=r"\[policy\]"):
        load_config(path, {})
    path.write_text('[policy]\nread_only = ["x"]\n')
    with pytest.raises(ConfigError, match="read_only"):
        load_config(path, {})


def test_cli_policy_set(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("proj", {"id.key": "k\n"})
    ws = daemon.adopt(root, policy=LOCKED)
    argv = [sys.executable, "-m", "substrate", "--state-dir", str(daemon.state_dir), "policy"]
    env = {**os.environ, "PYTHONPATH": str(Path(substrate.__file__).resolve().parent.parent)}
    done = subprocess.run(
        [*argv, "set", "--workspace", ws, "--read-deny", "*.key"],
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"]["read_deny"] == ["*.key"]
    with daemon.client() as c:
        assert c.call("workspace.info", workspace=ws)["policy"]["write_deny"] == [".git/**"]
        assert refusal(c, "fs.read", workspace=ws, path="id.key").refusal == "path_denied"
