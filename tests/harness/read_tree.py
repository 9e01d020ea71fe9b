"""The demo tree that the read and search tests share (a pytest plugin, loaded by
tests/conftest.py): files of every kind, symlinks in and out, a `read_deny` glob."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from substrate.schema.workspace import Policy
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from tests.harness.state import DaemonState

FILES: dict[str, str | bytes] = {
    "README.md": "# demo\n\nhello world\n",
    "src/main.py": "import os\n\ndef main() -> None:\n    print('hello')\n\n\ndef helper():\n    return 1\n",
    "src/util.py": "VALUE = 1\nHELLO = 'Hello'\n",
    "src/pkg/deep.py": "def deep():\n    pass  # hello from deep\n",
    "docs/a.txt": "alpha\nbeta\ngamma",  # no trailing newline
    "data/blob.bin": b"hello\x00binary" + bytes(range(256)),
    "data/latin1.txt": "café hello\n".encode("latin-1"),
    "keys/id.pem": "-----BEGIN hello-----\n",
    "empty": "",
}


@pytest.fixture
def registry(daemon_state: DaemonState) -> WorkspaceRegistry:
    return daemon_state.registry


@pytest.fixture
def root(make_workspace: Callable[..., Path], tmp_path: Path) -> Path:
    path = make_workspace("demo", FILES, git=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("hello from outside\n")
    (path / "link-out").symlink_to(outside)
    (path / "link-file").symlink_to(path / "README.md")
    (path / "src" / "link-dir").symlink_to("pkg")
    return path


@pytest.fixture
def ws(registry: WorkspaceRegistry, root: Path) -> Workspace:
    return registry.adopt(str(root), None, Policy(read_deny=["*.pem"]), "agent:0")
