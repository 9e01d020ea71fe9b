"""Shared fixtures: real daemons run as subprocesses, workspaces owned by uid 1000.

The code is in `tests.harness`; this file only declares fixtures and hooks.

- `make_workspace(name=None, files=None, git=False)` makes a directory under the
  function's adopt root, fills it, chowns it to uid/gid 1000 and returns its path;
  `workspace_dir` is one made with the defaults.
- `daemon` is a real daemon (`substrate serve`) in its own process on a private state
  dir, ready when both sockets accept; `daemon_factory(**config)` starts more, with
  `substrate.toml` keys (`line_timeout_s`, `max_connections`, ...); `module_daemon` is
  one per test module, for the many cheap tests that only need *a* daemon (make your own
  workspace with `module_daemon.make_workspace`). See `tests.harness.DaemonProcess`.
- `daemon_state` is the state an in-process daemon opens first (state dir, database,
  journal, config, workspace registry) on `tmp_path / "state"` under `adopt_root`, for
  unit tests that wire services by hand; `tests.harness.state.open_state` makes more.
- `snapshot_tree(path)` / `chown_tree(path)`: every name, kind, mode, owner and content
  digest under a path (never following a symlink), to prove that nothing changed; and a
  recursive lchown to uid 1000 for entries a test adds.

Every daemon is killed at teardown; when a test fails, the log (stdout+stderr) of every
daemon still alive is attached to its report. Test modules import what they need from
`tests.harness`, never from a conftest (pytest swaps the module of that name between
tests/ and tests/integration/ while collecting).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests import harness
from tests.harness import DaemonProcess
from tests.harness.daemon import LIVE
from tests.harness.state import DaemonState, open_state

__all__ = ["DaemonProcess"]  # still named by `from conftest import` under TYPE_CHECKING


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness.close_shared_launcher()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for i, d in enumerate(LIVE):
            report.sections.append((f"daemon {i} log ({d.base})", d.stderr()))


#: Fixtures of the demo tree shared by the read and search tests.
pytest_plugins = ["tests.harness.read_tree"]


@pytest.fixture(name="snapshot_tree")
def snapshot_tree_fixture() -> Callable[[Path], dict[str, tuple[Any, ...]]]:
    """`snapshot_tree(path)`: see `tests.harness.snapshot_tree`."""
    return harness.snapshot_tree


@pytest.fixture(name="chown_tree")
def chown_tree_fixture() -> Callable[..., None]:
    """`chown_tree(path, uid=1000, gid=1000)`: lchown a tree a test added entries to."""
    return harness.chown_tree


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., DaemonProcess]]:
    """`daemon_factory(start=True, prewarmed=True, **substrate_toml_keys)` → a `DaemonProcess`."""
    with harness.daemons(harness.short_tempdir) as factory:
        yield factory


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    """A started daemon with the default configuration; its adopt root is `adopt_root`."""
    return daemon_factory()


@pytest.fixture
def adopt_root(request: pytest.FixtureRequest) -> Iterator[Path]:
    """The adopt root of `daemon` when the test uses it, else a fresh temp dir."""
    if "daemon" in request.fixturenames:
        d: DaemonProcess = request.getfixturevalue("daemon")
        yield d.adopt_root
        return
    base = harness.short_tempdir()
    root = base / "roots"
    root.mkdir()
    try:
        yield root
    finally:
        harness.remove_tree(base)


@pytest.fixture
def daemon_state(adopt_root: Path, tmp_path: Path) -> Iterator[DaemonState]:
    """State dir, database, journal, config and registry on `tmp_path / "state"`."""
    with open_state(tmp_path / "state", adopt_root) as state:
        yield state


@pytest.fixture
def make_workspace(adopt_root: Path) -> Callable[..., Path]:
    """`make_workspace(name=None, files=None, git=False)` → a uid-1000 dir under `adopt_root`.

    That is `daemon`'s adopt root; for a daemon from `daemon_factory`, use its own
    `d.make_workspace(...)` instead.
    """

    def make(
        name: str | None = None,
        files: Mapping[str, str | bytes] | None = None,
        *,
        git: bool = False,
    ) -> Path:
        return harness.create_workspace(adopt_root, name, files, git=git)

    return make


@pytest.fixture
def quiet_root(adopt_root: Path) -> Iterator[Path]:
    """A directory under `adopt_root` on an ext4 filesystem of its own, where nothing but
    the test makes files: a freed inode goes to the next directory made there
    (`harness.reuse_inode`), whatever else the daemon or the machine is doing."""
    with harness.quiet_ext4(adopt_root / "quiet") as root:
        yield root


@pytest.fixture
def workspace_dir(make_workspace: Callable[..., Path]) -> Path:
    """A workspace with the default small tree (not adopted)."""
    return make_workspace()


@pytest.fixture(scope="module")
def module_daemon() -> Iterator[DaemonProcess]:
    """One started daemon per test module (defaults); make workspaces with its `make_workspace`."""
    with harness.daemons(harness.short_tempdir) as factory:
        yield factory()
