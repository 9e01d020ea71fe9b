"""A search whose pattern needs the budgeted backtracking engine runs on threads of its
own (`Daemon.backtrack_limiter`), never on the file operations' (`fs_limiter`): a few
slow patterns cannot starve every client's reads and writes (`substrate.api.fs`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from substrate.api import fs as fs_api
from substrate.config import Config
from substrate.protocol.caller import Caller
from substrate.schema.fs import SearchParams
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import search
from substrate.workspace.registry import WorkspaceRegistry


@pytest.fixture
def daemon(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Any]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    store = Store(state / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(config, store, journal, state)
    root = make_workspace("demo", {"a.txt": "alpha!\n"})
    fake = SimpleNamespace(
        workspaces=registry,
        fs_limiter=trio.CapacityLimiter(1),
        backtrack_limiter=trio.CapacityLimiter(1),
        ws=registry.adopt(str(root), None, None, "agent:0"),
    )
    try:
        yield fake
    finally:
        registry.close()
        store.close()


async def _no_notify(method: str, params: Any) -> None:
    raise AssertionError("fs.search sends no notification")


CALLER = Caller(actor="agent", uid=1000, connection=1, notify=_no_notify)


def test_which_patterns_backtrack() -> None:
    def p(pattern: str, **kw: Any) -> SearchParams:
        return SearchParams(workspace="w", pattern=pattern, **kw)

    assert not search.backtracks(p("alpha")) and not search.backtracks(p(r"(a|aa)+$"))
    assert not search.backtracks(p("(?<=a)!", fixed=True))  # a literal string
    assert search.backtracks(p("(?<=a)!")) and search.backtracks(p(r"(a)\1"))
    assert not search.backtracks(p("(unclosed"))  # refused by the search itself


async def test_a_backtracking_search_never_takes_a_file_thread(daemon: Any) -> None:
    done: dict[str, Any] = {}

    async def linear() -> None:
        done["linear"] = await fs_api.search_(
            daemon, CALLER, SearchParams(workspace=daemon.ws.id, pattern="alpha")
        )

    async with trio.open_nursery() as nursery:
        await daemon.fs_limiter.acquire()  # every file thread busy
        with trio.fail_after(10):
            slow = await fs_api.search_(
                daemon, CALLER, SearchParams(workspace=daemon.ws.id, pattern="(?<=a)!")
            )
        assert [(m.path, m.column) for m in slow.matches] == [("a.txt", 6)]
        nursery.start_soon(linear)
        await trio.testing.wait_all_tasks_blocked()
        assert "linear" not in done  # a plain search waits for a file thread
        daemon.fs_limiter.release()
    assert [m.path for m in done["linear"].matches] == ["a.txt"]
