"""The state an in-process daemon opens first, for unit tests that wire services by hand:
a state dir (0700), its database, the journal, a `Config` and the workspace registry, in
the order `substrate.daemon` opens them. The `daemon_state` fixture (tests/conftest.py) is
one on `tmp_path / "state"` under `adopt_root`; `open_state` makes more (a second state
dir, a restart on the same database, config overrides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from substrate.config import Config
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.registry import WorkspaceRegistry


@dataclass
class DaemonState:
    """An open state dir; `close()` (or leaving its `with` block) closes the registry,
    then the database."""

    path: Path
    config: Config
    store: Store
    journal: Journal
    registry: WorkspaceRegistry

    def close(self) -> None:
        self.registry.close()
        self.store.close()

    def __enter__(self) -> DaemonState:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def open_state(path: Path, adopt_roots: Path | Sequence[Path], **config: Any) -> DaemonState:
    """Open the state dir `path` (made 0700 if missing) with `adopt_roots` and `config`
    (more `Config` fields); opening one that exists is a restart: same database, new epoch."""
    roots = [adopt_roots] if isinstance(adopt_roots, Path) else list(adopt_roots)
    path.mkdir(mode=0o700, exist_ok=True)
    made = Config(state_dir=str(path), adopt_roots=[str(root) for root in roots], **config)
    store = Store(path / "substrate.db")
    journal = Journal(store)
    return DaemonState(path, made, store, journal, WorkspaceRegistry(made, store, journal, path))
