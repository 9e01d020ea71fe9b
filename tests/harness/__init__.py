"""The test harness: real daemons in their own processes, workspaces, snapshots, polling.

Importable code behind the fixtures of tests/conftest.py and tests/integration/conftest.py,
and for test modules to import directly (`from tests.harness import DaemonProcess,
wait_until`). The names below are the core; these modules are imported by name, as they
need more than the core does:

- `tests.harness.engine`: the Docker engine (connect, remove a session's containers);
- `tests.harness.ws_frames`: client side of the JSON WebSocket terminal protocol;
- `tests.harness.cdp_browser`: headless Chromium over the DevTools protocol;
- `tests.harness.launcher`, `.pty_fake_server`, `.attach_and_report`: programs, run as
  `python -m tests.harness.<name>`.

pytest puts the worktree root on `sys.path` (`pythonpath` in pyproject.toml): `tests` is
then a namespace package, and `substrate` the worktree's own, as in every daemon started.
"""

from tests.harness.daemon import (
    PACKAGE_ROOT,
    WRITE_KINDS,
    DaemonFailed,
    DaemonProcess,
    daemon_env,
    daemons,
)
from tests.harness.prewarmed import close_shared_launcher
from tests.harness.snapshots import snapshot_tree
from tests.harness.waiting import WaitTimeout, wait_until, wait_until_async
from tests.harness.workspaces import (
    DEFAULT_FILES,
    FAKE_HEAD,
    WORKSPACE_GID,
    WORKSPACE_UID,
    chown_tree,
    create_workspace,
    quiet_ext4,
    remove_tree,
    reuse_inode,
    short_tempdir,
    write_fake_git,
    write_files,
)

__all__ = [
    "DEFAULT_FILES",
    "FAKE_HEAD",
    "PACKAGE_ROOT",
    "WORKSPACE_GID",
    "WORKSPACE_UID",
    "WRITE_KINDS",
    "DaemonFailed",
    "DaemonProcess",
    "WaitTimeout",
    "chown_tree",
    "close_shared_launcher",
    "create_workspace",
    "daemon_env",
    "daemons",
    "quiet_ext4",
    "remove_tree",
    "reuse_inode",
    "short_tempdir",
    "snapshot_tree",
    "wait_until",
    "wait_until_async",
    "write_fake_git",
    "write_files",
]
