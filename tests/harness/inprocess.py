"""An in-process daemon against the real engine, for tests/integration: a profiles dir,
a project owned by uid 1000, and the daemon serving its sockets until the test ends.
The state dir comes from the `engine_state` fixture (tests/integration/conftest.py),
which removes the daemon's containers and fails a test that left a mount behind.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

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


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[Daemon]:
    """The daemon of `config`, serving (agent and operator sockets in its state dir) for
    the block; cancelled and closed after it."""
    async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        yield daemon
        nursery.cancel_scope.cancel()
