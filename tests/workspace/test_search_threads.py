"""A search whose pattern needs the budgeted backtracking engine runs on threads of its
own (`Daemon.backtrack_limiter`), never on the file operations' (`fs_limiter`): a few
slow patterns cannot starve every client's reads and writes (`substrate.api.fs`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from substrate.api import fs as fs_api
from substrate.errors import InvalidParams
from substrate.protocol.caller import Caller
from substrate.schema.fs import SearchParams
from substrate.workspace import search
from substrate.workspace.registry import WorkspaceRegistry


@pytest.fixture
def daemon(registry: WorkspaceRegistry, make_workspace: Callable[..., Path]) -> Any:
    root = make_workspace("demo", {"a.txt": "alpha!\n"})
    return SimpleNamespace(
        workspaces=registry,
        fs_limiter=trio.CapacityLimiter(1),
        backtrack_limiter=trio.CapacityLimiter(1),
        search_pool=None,
        ws=registry.adopt(str(root), None, None, "agent:0"),
    )


async def _no_notify(method: str, params: Any) -> None:
    raise AssertionError("fs.search sends no notification")


CALLER = Caller(actor="agent", uid=1000, connection=1, notify=_no_notify)


def test_which_patterns_backtrack() -> None:
    def backtracks(pattern: str, **kw: Any) -> bool:
        return search.matcher(SearchParams(workspace="w", pattern=pattern, **kw)).exact is None

    assert not backtracks("alpha") and not backtracks(r"(a|aa)+$")
    assert not backtracks("(?<=a)!", fixed=True)  # a literal string
    assert backtracks("(?<=a)!") and backtracks(r"(a)\1")
    with pytest.raises(InvalidParams):
        backtracks("(unclosed")


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
