"""An in-process daemon against the real engine, for tests/integration: a profiles dir,
a project owned by uid 1000, its `Config` (`in_process_config`), and the daemon serving
its sockets until the test ends (`serving`; `serving_until_stopped` when the test stops
it as a signal does and reads its state afterwards). The state dir comes from the
`engine_state` fixture (tests/integration/conftest.py), which removes the daemon's
containers and fails a test that left a mount behind.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from substrate.config import PROJECT_ROOT, Config
from substrate.daemon import Daemon, open_daemon
from tests.harness.workspaces import chown_tree, write_files


def profiles_dir(dest: Path, shipped: Sequence[str] = (), **written: str) -> Path:
    """Make `dest` holding the shipped profiles named in `shipped` and, for each
    `name=text` in `written`, `name.toml` with that text."""
    dest.mkdir()
    for name in shipped:
        shutil.copy(PROJECT_ROOT / "profiles" / f"{name}.toml", dest / f"{name}.toml")
    for name, text in written.items():
        (dest / f"{name}.toml").write_text(text)
    return dest


def as_layer(shipped: str = "tiny") -> str:
    """The shipped profile `shipped` (an "rw" one) with `workspace = "layer"`."""
    text = (PROJECT_ROOT / "profiles" / f"{shipped}.toml").read_text()
    if 'workspace = "rw"' not in text:
        raise ValueError(f"profile {shipped!r} is not an rw profile")
    return text.replace('workspace = "rw"', 'workspace = "layer"')


def owned_project(path: Path, files: Mapping[str, str | bytes]) -> Path:
    """Make the checkout `path` holding `files` (relative path: content), everything in it
    owned by uid 1000 as an agent's checkout is; returns `path`."""
    path.mkdir(parents=True)
    write_files(path, files)
    chown_tree(path)
    return path


def in_process_config(state: Path, adopt_root: Path, profiles: Path, **overrides: Any) -> Config:
    """The config of an in-process daemon on the state dir `state`, adopting beneath
    `adopt_root`, with the profiles of `profiles`; `overrides` are more `Config` fields."""
    return Config(
        state_dir=str(state), adopt_roots=[str(adopt_root)], profiles_dir=str(profiles), **overrides
    )


@dataclass
class Served:
    """A daemon serving in a `serving_until_stopped` block."""

    daemon: Daemon
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stopped: trio.Event = field(default_factory=trio.Event)

    async def stop(self) -> None:
        """Stop serving as a signal does (every service cancelled at once) and wait until
        it has; the daemon stays open (its store readable) until the block ends."""
        self.scope.cancel()
        await self.stopped.wait()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                await self.daemon.serve(task_status=task_status)
        finally:
            self.stopped.set()


@contextlib.asynccontextmanager
async def serving_until_stopped(
    config: Config, prepare: Callable[[Daemon], None] | None = None
) -> AsyncIterator[Served]:
    """The daemon of `config`, serving (agent and operator sockets in its state dir) for
    the block unless `stop()`ped; `prepare(daemon)` runs once it is open, before it
    serves. Stopped and closed after the block."""
    async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
        if prepare is not None:
            prepare(daemon)
        served = Served(daemon)
        await nursery.start(served.serve)
        try:
            yield served
        finally:
            served.scope.cancel()


@contextlib.asynccontextmanager
async def serving(
    config: Config, prepare: Callable[[Daemon], None] | None = None
) -> AsyncIterator[Daemon]:
    """The daemon of `config`, serving for the block (see `serving_until_stopped`)."""
    async with serving_until_stopped(config, prepare) as served:
        yield served.daemon
