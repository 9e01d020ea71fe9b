"""Code a checkout configures never runs on the host (docs/protocol.md §2): a workspace
whose git config, hooks, filters and attributes would run a command is adopted, read,
written, replayed and re-adopted through a real daemon, and nothing runs it; `vcs.head`
is read from `.git/HEAD` and the refs as plain files (`substrate.workspace.vcs`).
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.harness import DaemonProcess


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


# --- code the workspace configures ---------------------------------------------------------

HOOKS = [
    "applypatch-msg",
    "commit-msg",
    "post-checkout",
    "post-commit",
    "post-index-change",
    "post-merge",
    "post-rewrite",
    "pre-auto-gc",
    "pre-commit",
    "pre-push",
    "pre-rebase",
    "prepare-commit-msg",
    "reference-transaction",
    "fsmonitor-watchman",
    "push-to-checkout",
]


def _booby_trapped_git(root: Path, marker_cmd: str, head_line: str) -> None:
    git = root / ".git"
    (git / "hooks").mkdir(parents=True)
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "objects").mkdir()
    (git / "HEAD").write_text(head_line)
    (git / "config").write_text(
        "[core]\n"
        f"\tfsmonitor = {marker_cmd}\n"
        f"\thooksPath = {git / 'hooks'}\n"
        f"\tpager = {marker_cmd}\n"
        f"\teditor = {marker_cmd}\n"
        f"\tsshCommand = {marker_cmd}\n"
        f"\taskPass = {marker_cmd}\n"
        '[filter "trap"]\n'
        f"\tclean = {marker_cmd}\n\tsmudge = {marker_cmd}\n\tprocess = {marker_cmd}\n"
        "\trequired = true\n"
        '[diff "trap"]\n'
        f"\ttextconv = {marker_cmd}\n\tcommand = {marker_cmd}\n"
        f"[diff]\n\texternal = {marker_cmd}\n"
        f"[gpg]\n\tprogram = {marker_cmd}\n"
        f"[credential]\n\thelper = !{marker_cmd}\n"
        f"[alias]\n\tstatus = !{marker_cmd}\n"
    )
    for hook in HOOKS:
        path = git / "hooks" / hook
        path.write_text(f"#!/bin/sh\n{marker_cmd}\n")
        path.chmod(0o755)
    (root / ".gitattributes").write_text("* filter=trap diff=trap\n")


@pytest.fixture
def marker(daemon: DaemonProcess) -> Iterator[tuple[str, Path]]:
    """A command that, if anything ever runs it, leaves a marker file."""
    flag = daemon.base / "MARKER"
    script = daemon.base / "marker.sh"
    script.write_text(f"#!/bin/sh\necho ran >> {flag}\n")
    script.chmod(0o755)
    # The trap is armed: running the command does leave the marker.
    subprocess.run([str(script)], check=True)
    assert flag.exists()
    flag.unlink()
    yield str(script), flag


def test_workspace_git_config_never_runs(
    daemon: DaemonProcess, marker: tuple[str, Path], chown_tree: Callable[[Path], None]
) -> None:
    marker_cmd, flag = marker
    root = daemon.make_workspace(files={"a.txt": "alpha\n", "src/m.py": "x = 1\n"})
    head = "1" * 40
    _booby_trapped_git(root, marker_cmd, "ref: refs/heads/main\n")
    (root / ".git" / "refs" / "heads" / "main").write_text(head + "\n")
    chown_tree(root)

    with daemon.client() as c:
        info = c.call("workspace.adopt", path=str(root))
        ws = info["workspace"]
        assert info["vcs"] == {"kind": "git", "head": head}
        c.call("workspace.info", workspace=ws)
        c.call("workspace.list")
        c.call("fs.read", workspace=ws, path="a.txt")
        c.call("fs.read", workspace=ws, path=".git/config")
        c.call("fs.stat", workspace=ws, path="src/m.py")
        c.call("fs.list", workspace=ws, path=".")
        c.call("fs.walk", workspace=ws, include_git=True)
        c.call("fs.search", workspace=ws, pattern="x")
        c.call("fs.write", workspace=ws, path="new.txt", content="n\n", base_sha256=None)
        c.call("fs.write", workspace=ws, path="a.txt", content="b\n", base_sha256=sha("alpha\n"))
        c.call(
            "fs.patch",
            workspace=ws,
            path="src/m.py",
            base_sha256=sha("x = 1\n"),
            edits=[{"old": "1", "new": "2"}],
        )
        c.call("fs.delete", workspace=ws, path="new.txt", base_sha256=sha("n\n"))
        c.call("journal.replay", workspace=ws)
        c.call("journal.verify")
    daemon.restart()  # re-adopts persisted workspaces at start
    with daemon.client() as c:
        assert c.call("workspace.info", workspace=ws)["vcs"]["head"] == head
        c.call("journal.replay", workspace=ws)
        c.call("workspace.release", workspace=ws)
        c.call("workspace.adopt", path=str(root))
    assert not flag.exists(), flag.read_text()


@pytest.mark.parametrize(
    "layout",
    ["branch", "packed", "detached", "unborn", "sha256-detached", "symlinked-ref", "bad-ref"],
)
def test_vcs_head_read_from_files(
    daemon: DaemonProcess,
    marker: tuple[str, Path],
    chown_tree: Callable[[Path], None],
    layout: str,
) -> None:
    marker_cmd, flag = marker
    root = daemon.make_workspace(files={"a.txt": "a\n"})
    sha1 = "a" * 40
    expected: str | None = sha1
    if layout == "branch":
        _booby_trapped_git(root, marker_cmd, "ref: refs/heads/feature/x\n")
        (root / ".git/refs/heads/feature").mkdir()
        (root / ".git/refs/heads/feature/x").write_text(sha1 + "\n")
    elif layout == "packed":
        _booby_trapped_git(root, marker_cmd, "ref: refs/heads/main\n")
        (root / ".git/packed-refs").write_text(
            f"# pack-refs with: peeled fully-peeled sorted\n{'b' * 40} refs/heads/other\n"
            f"{sha1} refs/heads/main\n^{'c' * 40}\n"
        )
    elif layout == "detached":
        _booby_trapped_git(root, marker_cmd, sha1 + "\n")
    elif layout == "sha256-detached":
        expected = "d" * 64
        _booby_trapped_git(root, marker_cmd, expected + "\n")
    elif layout == "unborn":
        _booby_trapped_git(root, marker_cmd, "ref: refs/heads/main\n")
        expected = None
    elif layout == "symlinked-ref":
        # A ref that is a symlink to a file outside: never followed.
        outside = daemon.base / "outside-ref"
        outside.write_text(sha1 + "\n")
        _booby_trapped_git(root, marker_cmd, "ref: refs/heads/main\n")
        (root / ".git/refs/heads/main").symlink_to(outside)
        expected = None
    elif layout == "bad-ref":
        _booby_trapped_git(root, marker_cmd, "ref: refs/heads/../../../../etc/passwd\n")
        expected = None
    chown_tree(root)
    with daemon.client() as c:
        info = c.call("workspace.adopt", path=str(root))
    assert info["vcs"] == {"kind": "git", "head": expected}
    assert not flag.exists()


def test_no_git_dir_means_no_vcs(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace()
    with daemon.client() as c:
        assert c.call("workspace.adopt", path=str(root))["vcs"] is None


def test_symlinked_git_dir_is_not_followed(
    daemon: DaemonProcess, chown_tree: Callable[[Path], None]
) -> None:
    real = daemon.base / "real-git"
    (real / "refs" / "heads").mkdir(parents=True)
    (real / "HEAD").write_text("e" * 40 + "\n")
    root = daemon.make_workspace()
    (root / ".git").symlink_to(real)
    chown_tree(root)
    with daemon.client() as c:
        info = c.call("workspace.adopt", path=str(root))
    assert info["vcs"] is None
