"""`fs.search` shared with a worker process (`substrate.workspace.search_pool`): the
worker really takes a batch whenever it has read all it was sent, the result is the serial path's (truncation and
the counts included), a file gone before the worker opens it is skipped as the serial
walk skips it, and every failure (killed, stopped, over its reply bound, busy) gives
the serial result; the worker is gone once the pool, or the daemon, closes."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from substrate.config import Config
from substrate.daemon import open_daemon
from substrate.schema.fs import SearchParams
from substrate.workspace import search, search_pool, search_split
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.search_pool import SearchPool

FILES = {
    f"d{i % 7}/f{i:03}.py": "".join(
        f"def x{i}_{k}_handler(a):\n    return 'Error{k}' + {i * k}\n" for k in range(i % 5)
    )
    for i in range(300)
}


@pytest.fixture
def tree(registry: WorkspaceRegistry, make_workspace: Callable[..., Path]) -> Workspace:
    return registry.adopt(str(make_workspace("many", FILES)), None, None, "agent:0")


@pytest.fixture
def pool() -> Iterator[SearchPool]:
    # Shared whatever else this machine runs (`spare_cpu` is asked in its own test).
    pool = SearchPool(wait_s=2.0, restart_pause_s=0, spare=lambda: True)
    assert pool.wait_ready(60)
    yield pool
    pool.close()


def _params(ws: Workspace, pattern: str = r"def \w+_handler\(", **kw: Any) -> SearchParams:
    return SearchParams(workspace=ws.id, pattern=pattern, **kw)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("max_matches", [1, 7, 200, 100000])
@pytest.mark.parametrize("pattern", [r"def \w+_handler\(", "Error[0-9]", r"[0-9]{3}", "x1"])
def test_the_worker_takes_files_and_the_result_is_the_serial_one(
    tree: Workspace, pool: SearchPool, pattern: str, max_matches: int
) -> None:
    p = _params(tree, pattern, max_matches=max_matches)
    serial = search.search(tree, p)
    assert serial.matches and serial.files_scanned > 0
    shared = pool.search(tree, p)
    assert shared == serial
    # Handed off past HAND_OFF_FILES: a search truncated before it is serial.
    assert pool.shared == (1 if serial.files_scanned > search_split.HAND_OFF_FILES else 0)
    assert pool.failed == 0 and pool.pid is not None


@pytest.mark.parametrize("answers", ["always", "never", "every third"])
def test_the_worker_is_fed_a_batch_whenever_it_is_idle(
    tree: Workspace, pool: SearchPool, monkeypatch: pytest.MonkeyPatch, answers: str
) -> None:
    """Past the hand-off, a batch of the next files goes to the worker each time it has
    read all it was sent (`_idle`, asked before each file the parent would search); the
    result is the serial one however the files fell."""
    rule: Callable[[int], bool] = {
        "always": lambda k: True,
        "never": lambda k: False,
        "every third": lambda k: k % 3 == 0,
    }[answers]
    asked = iter(range(10**6))
    monkeypatch.setattr(pool, "_idle", lambda: rule(next(asked)))
    given: list[int] = []
    send = pool._send

    def recording(batch: search_split.Batch, fds: list[int]) -> None:
        given.extend(batch.idx)
        send(batch, fds)

    monkeypatch.setattr(pool, "_send", recording)
    p = _params(tree, "Error[0-9]", max_matches=100000)
    serial = search.search(tree, p)
    assert pool.search(tree, p) == serial
    h, n, size = search_split.HAND_OFF_FILES, len(FILES), search_split.BATCH_FILES
    assert n > h + size
    expected = {
        # The file of the hand-off is the parent's.
        "always": list(range(h + 1, n)),
        "never": [],
        # One batch at the first file past the hand-off; the next at the third file the
        # parent would have searched after it.
        "every third": [*range(h + 1, h + 1 + size), *range(h + size + 3, n)],
    }[answers]
    assert given == expected
    assert pool.shared == (1 if expected else 0) and pool.failed == 0


def test_a_small_tree_never_reaches_the_worker(
    registry: WorkspaceRegistry, make_workspace: Callable[..., Path], pool: SearchPool
) -> None:
    small = {f"f{i}.txt": "foo\n" for i in range(10)}
    ws = registry.adopt(str(make_workspace("small", small)), None, None, "agent:0")
    assert pool.search(ws, _params(ws, "foo")) == search.search(ws, _params(ws, "foo"))
    assert pool.shared == 0


def test_a_worker_killed_mid_search_gives_the_serial_result_and_is_restarted(
    tree: Workspace, pool: SearchPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    send = SearchPool._send
    killed: list[int] = []

    def kill_then_send(self: SearchPool, *args: Any) -> None:
        if not killed:  # at the first batch: the walk is past the hand-off
            assert self.pid is not None
            killed.append(self.pid)
            os.kill(self.pid, signal.SIGKILL)
        send(self, *args)

    monkeypatch.setattr(SearchPool, "_send", kill_then_send)
    p = _params(tree, max_matches=100000)
    assert pool.search(tree, p) == search.search(tree, p)
    assert pool.failed == 1 and pool.shared == 0 and pool.pid is None
    assert _gone(killed[0])  # killed and reaped
    monkeypatch.setattr(SearchPool, "_send", send)
    assert pool.wait_ready(60) and pool.pid not in (None, killed[0])
    assert pool.search(tree, p) == search.search(tree, p)
    assert pool.shared == 1


def test_a_worker_that_does_not_answer_in_time_is_killed(
    tree: Workspace, pool: SearchPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    send = SearchPool._send
    stopped: list[int] = []

    def send_then_stop(self: SearchPool, *args: Any) -> None:
        if not stopped:
            assert self.pid is not None
            stopped.append(self.pid)
            os.kill(self.pid, signal.SIGSTOP)
        send(self, *args)

    monkeypatch.setattr(SearchPool, "_send", send_then_stop)
    monkeypatch.setattr(search_pool, "WAIT_FACTOR", 0.0)
    p = _params(tree, max_matches=100000)
    assert pool.search(tree, p) == search.search(tree, p)
    assert pool.failed == 1 and pool.pid is None and _gone(stopped[0])


def test_a_reply_over_its_bound_is_refused(
    tree: Workspace, pool: SearchPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search_pool, "max_reply_bytes", lambda p: 16)
    p = _params(tree, max_matches=100000)
    assert pool.search(tree, p) == search.search(tree, p)
    assert pool.failed == 1 and pool.shared == 0


def test_a_file_gone_before_the_worker_opens_it_is_skipped_as_the_serial_walk_skips_it(
    tree: Workspace, pool: SearchPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    send = SearchPool._send
    gone: list[str] = []

    def remove_then_send(self: SearchPool, batch: Any, fds: list[int]) -> None:
        if not gone:  # the first of the worker's files: the parent's walk met it
            gone.append(batch.rels[0].decode())
            (Path(tree.host_path) / gone[0]).unlink()
        send(self, batch, fds)

    monkeypatch.setattr(SearchPool, "_send", remove_then_send)
    p = _params(tree, "Error|return", max_matches=100000)
    got = pool.search(tree, p)
    assert pool.shared == 1 and pool.failed == 0
    assert got == search.search(tree, p)
    assert gone and not any(m.path == gone[0] for m in got.matches)


def test_no_fd_to_hand_a_file_off_gives_the_serial_result(
    tree: Workspace, pool: SearchPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    dup = os.dup
    calls: list[int] = []

    def dup_then_fail(fd: int) -> int:
        calls.append(fd)
        if len(calls) == 2:  # the second directory met after the hand-off
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return dup(fd)

    monkeypatch.setattr(search_split.os, "dup", dup_then_fail)
    p = _params(tree, max_matches=100000)
    assert pool.search(tree, p) == search.search(tree, p)
    assert len(calls) == 2 and pool.shared == 0 and pool.failed == 0
    monkeypatch.setattr(search_split.os, "dup", dup)
    assert pool.search(tree, p) == search.search(tree, p)
    assert pool.shared == 1  # the worker was kept: its half was ended and read away


def test_a_second_search_while_the_worker_is_busy_is_serial(
    tree: Workspace, pool: SearchPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner: list[Any] = []
    send = SearchPool._send

    def send_and_search_again(self: SearchPool, *args: Any) -> None:
        if not inner:  # the second search, on this thread, while the first holds the worker
            inner.append(self.search(tree, _params(tree, "Error")))
        send(self, *args)

    monkeypatch.setattr(SearchPool, "_send", send_and_search_again)
    p = _params(tree, max_matches=100000)
    assert pool.search(tree, p) == search.search(tree, p)
    assert inner == [search.search(tree, _params(tree, "Error"))]
    assert pool.shared == 1


def test_a_search_stays_serial_when_no_cpu_is_free(tree: Workspace) -> None:
    asked: list[bool] = []

    def busy() -> bool:
        asked.append(False)
        return False

    pool = SearchPool(spare=busy)
    try:
        assert pool.wait_ready(60)
        p = _params(tree, max_matches=100000)
        assert pool.search(tree, p) == search.search(tree, p)
        assert asked == [False] and pool.declined == 1 and pool.shared == 0
    finally:
        pool.close()
    assert isinstance(search_pool.spare_cpu(), bool)  # /proc/stat's procs_running, read


def test_a_search_declined_at_its_hand_off_is_shared_once_a_cpu_is_free(
    tree: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spare` is asked again every `HAND_OFF_FILES` files while it says no: the first
    "yes" hands the rest of the walk off, and the result is the serial one."""
    answers = iter([False, False, True])
    asked: list[int] = []

    def later() -> bool:
        asked.append(1)
        return next(answers)

    monkeypatch.setattr(search_split, "HAND_OFF_FILES", 64)
    pool = SearchPool(spare=later, restart_pause_s=0)
    try:
        assert pool.wait_ready(60)
        p = _params(tree, max_matches=100000)
        assert pool.search(tree, p) == search.search(tree, p)
        assert len(asked) == 3 and pool.shared == 1 and pool.declined == 0
    finally:
        pool.close()


def test_a_backtracking_pattern_is_searched_serially(tree: Workspace, pool: SearchPool) -> None:
    p = _params(tree, r"(\w+)_\1", max_matches=100000)
    assert pool.search(tree, p) == search.search(tree, p)
    assert pool.shared == 0


def test_the_worker_outlives_the_thread_that_started_it(tree: Workspace) -> None:
    """A search starts the worker from one of Trio's pooled threads, which ends when
    idle: the worker must not die with it (as PR_SET_PDEATHSIG would have it)."""
    pool = SearchPool(spare=lambda: True)
    try:
        ready: list[bool] = []
        starter = threading.Thread(target=lambda: ready.append(pool.wait_ready(60)))
        starter.start()
        starter.join()
        assert ready == [True]
        time.sleep(0.2)  # the thread's exit reaches the kernel after `join` returns
        p = _params(tree, max_matches=100000)
        assert pool.search(tree, p) == search.search(tree, p)
        assert pool.shared == 1 and pool.failed == 0
    finally:
        pool.close()


def test_the_worker_is_gone_after_close(pool: SearchPool) -> None:
    pid = pool.pid
    assert pid is not None and not _gone(pid)
    pool.close()
    assert pool.pid is None and _gone(pid)
    assert not pool.wait_ready(0)


async def test_the_worker_is_gone_after_the_daemon_closes(tmp_path: Path) -> None:
    config = Config(state_dir=str(tmp_path / "state"), listen="127.0.0.1:0")
    async with open_daemon(config) as daemon:
        assert daemon.search_pool is not None  # this machine has two CPUs or more
        assert daemon.search_pool.pid is None  # started by the first search only
        assert daemon.search_pool.wait_ready(60)
        pid = daemon.search_pool.pid
        assert pid is not None and not _gone(pid)
    assert _gone(pid)
