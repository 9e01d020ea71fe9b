"""Races against guarded writes (docs/protocol.md §4): tests, not hopes.

Through the socket of a real daemon, and in-process with `substrate.workspace.writes.Writer`
where the race has to be placed exactly (a hook between plan and commit, a chosen temp name):

1. a directory swapped for a symlink to outside while 500 writes run into it;
2. a file hard-linked to a file outside the workspace;
3. two clients writing the same file from the same base at once;
4. a symlink planted at the temp-file name; a parent renamed away mid-write; the
   start-up temp cleaner running while writes are in flight.

A checkout whose git config would run code is tests/workspace/test_vcs.py's.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.config import Config
from substrate.errors import Refusal
from substrate.fs import paths
from substrate.protocol.client import Client, RpcError
from substrate.schema.fs import WriteParams, write_request
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import writes
from substrate.workspace.registry import TEMP_PREFIX, Workspace, WorkspaceRegistry
from substrate.workspace.writes import TempFiles

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

PATIENCE_S = 30.0
Snapshot = Callable[[Path], dict[str, tuple[Any, ...]]]


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def temp_files(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            if name.startswith(TEMP_PREFIX):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return found


# --- swapping a directory for a symlink ---------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two names (renameat2 RENAME_EXCHANGE); False if unsupported."""
    rc = _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), str(a))


class Swapper(threading.Thread):
    """Keeps swapping `root/name` between the real directory and a symlink to `outside`.

    Alternates an atomic exchange with a plain rename dance (real dir moved away, symlink
    put in its place, then back), so the writes meet a real dir, a symlink and nothing.
    """

    def __init__(self, root: Path, name: str, outside: Path) -> None:
        super().__init__(daemon=True)
        self.real = root / name
        self.away = root / f"{name}.away"
        self.link = root / f"{name}.link"
        self.link.symlink_to(outside)
        self.stop_event = threading.Event()
        self.swaps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            can_exchange = True
            while not self.stop_event.is_set():
                if can_exchange:
                    can_exchange = exchange(self.real, self.link)  # now: a symlink
                    if can_exchange:
                        time.sleep(0.0005)  # kept: the race itself, each shape lasts a moment
                        exchange(self.real, self.link)  # the real dir again
                self.real.rename(self.away)
                self.link.rename(self.real)  # a symlink, by plain rename
                time.sleep(0.0005)  # kept: as above
                self.real.rename(self.link)
                self.away.rename(self.real)
                self.swaps += 1
                time.sleep(0.0005)  # kept: as above
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        self.stop_event.set()
        self.join(PATIENCE_S)
        assert self.error is None, self.error
        assert self.real.is_dir() and not self.real.is_symlink()
        self.link.unlink()


def _swap_fixture(root: Path, outside: Path, n: int) -> dict[int, tuple[str | None, str]]:
    """dir/file_i: the first half exists (identical bytes inside and outside), the rest not.

    Returns {i: (base_sha256, new content)}.
    """
    (root / "dir").mkdir()
    outside.mkdir(parents=True, exist_ok=True)
    plan: dict[int, tuple[str | None, str]] = {}
    for i in range(n):
        if i < n // 2:
            same = f"same bytes {i}\n"
            (root / "dir" / f"file_{i}").write_text(same)
            (outside / f"file_{i}").write_text(same)
            plan[i] = (sha(same), f"new {i}\n")
        else:
            plan[i] = (None, f"created {i}\n")
    os.chown(root / "dir", 1000, 1000)
    return plan


SWAP_REFUSALS = {"symlink_refused", "not_found"}


def _check_swap_outcome(
    root: Path,
    outside: Path,
    plan: dict[int, tuple[str | None, str]],
    outcomes: dict[int, str],
    outside_before: dict[str, Any],
    snapshot_tree: Snapshot,
    rounds_left: int = 0,
) -> bool:
    """Nothing escaped (always asserted); True when the race ran: some writes applied and
    some refused (asserted when `rounds_left` is 0)."""
    assert snapshot_tree(outside) == outside_before, "a byte changed outside the workspace"
    unexpected = {i: o for i, o in outcomes.items() if o not in SWAP_REFUSALS | {"applied"}}
    assert not unexpected, unexpected
    for i, (base, new) in plan.items():
        target = root / "dir" / f"file_{i}"
        if outcomes[i] == "applied":
            assert target.read_text() == new
        elif base is None:
            assert not target.exists()
        else:
            assert sha(target.read_bytes()) == base
    assert temp_files(root) == []
    applied = sum(o == "applied" for o in outcomes.values())
    refused = sum(o == "symlink_refused" for o in outcomes.values())
    # Both must have happened, or the race was never run (with rounds left: try again).
    if rounds_left and not (applied > 0 and refused > 0):
        return False
    assert applied > 0 and refused > 0, (applied, refused)
    return True


@pytest.mark.slow
def test_500_writes_while_a_directory_is_swapped_for_a_symlink(
    daemon: DaemonProcess, snapshot_tree: Snapshot
) -> None:
    n = 500
    root = daemon.make_workspace(files={})
    outside = daemon.base / "outside"
    plan = _swap_fixture(root, outside, n)
    ws = daemon.adopt(root)
    outside_before = snapshot_tree(outside)
    local = threading.local()
    clients: list[Client] = []

    def one(i: int) -> str:
        if not hasattr(local, "client"):
            local.client = daemon.client()
            clients.append(local.client)
        base, new = plan[i]
        try:
            local.client.call(
                "fs.write", workspace=ws, path=f"dir/file_{i}", content=new, base_sha256=base
            )
        except RpcError as exc:
            return exc.refusal or str(exc.code)
        return "applied"

    swapper = Swapper(root, "dir", outside)
    swapper.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            outcomes = dict(zip(range(n), pool.map(one, range(n)), strict=True))
    finally:
        swapper.finish()
    _check_swap_outcome(root, outside, plan, outcomes, outside_before, snapshot_tree)
    applied = sum(o == "applied" for o in outcomes.values())
    assert len(daemon.journal(kinds={"fs.write"}, workspace=ws)) == applied


# --- in-process harness -------------------------------------------------------------------


@dataclass
class Local:
    """The daemon's write path without the daemon: registry, writer, one workspace."""

    base: Path
    root: Path
    outside: Path
    registry: WorkspaceRegistry
    writer: writes.Writer
    ws: Workspace
    store: Store

    def write(self, path: str, content: str | bytes, base: str | None, **kw: Any) -> Any:
        if isinstance(content, bytes):
            import base64

            kw["content_b64"] = base64.b64encode(content).decode()
        else:
            kw["content"] = content
        params = WriteParams(workspace=self.ws.id, path=path, base_sha256=base, **kw)
        return self.writer.write(self.ws, write_request(params), "test")


@pytest.fixture(params=["openat2", "walk"])
def local(
    request: pytest.FixtureRequest, make_workspace: Callable[..., Path], adopt_root: Path
) -> Iterator[Local]:
    """An in-process writer over a fresh workspace, with openat2 and with the fallback walk."""
    paths.use_openat2(request.param == "openat2")
    base = adopt_root.parent
    root = make_workspace(files={"a.txt": "alpha\n"})
    outside = base / "outside"
    outside.mkdir()
    config = Config(state_dir=str(base / "state"), adopt_roots=[str(adopt_root)])
    (base / "state").mkdir(mode=0o700)
    store = Store(base / "state" / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(config, store, journal, base / "state")
    try:
        ws = registry.adopt(str(root), None, None, "test")
        yield Local(base, root, outside, registry, writes.Writer(store, journal), ws, store)
    finally:
        registry.close()
        store.close()
        paths.use_openat2(True)


@pytest.mark.slow
def test_500_writes_while_swapped_in_process(local: Local, snapshot_tree: Snapshot) -> None:
    """The same race on the write path itself, with openat2 and with the O_NOFOLLOW walk.

    Every round checks that nothing escaped; a round in which the scheduler never let a
    write meet both shapes (all applied, or all refused: seen once on a loaded machine)
    proves nothing about the race, so up to three rounds are run to see both."""
    n = 500
    for attempt in range(3):
        if attempt:
            shutil.rmtree(local.root / "dir")
            (local.root / "dir.link").unlink()
        plan = _swap_fixture(local.root, local.outside, n)
        outside_before = snapshot_tree(local.outside)

        def one(i: int, plan: dict[int, tuple[str | None, str]] = plan) -> str:
            base, new = plan[i]
            try:
                local.write(f"dir/file_{i}", new, base)
            except Refusal as refusal:
                return refusal.name
            return "applied"

        swapper = Swapper(local.root, "dir", local.outside)
        swapper.start()
        try:
            with ThreadPoolExecutor(8) as pool:
                outcomes = dict(zip(range(n), pool.map(one, range(n)), strict=True))
        finally:
            swapper.finish()
        raced = _check_swap_outcome(
            local.root, local.outside, plan, outcomes, outside_before, snapshot_tree, 2 - attempt
        )
        if raced:
            return


# --- hard links ---------------------------------------------------------------------------


def test_hardlink_to_outside_file_is_never_written_through(
    daemon: DaemonProcess, snapshot_tree: Snapshot
) -> None:
    root = daemon.make_workspace(files={"keep.txt": "k\n"})
    outside = daemon.base / "outside"
    outside.mkdir()
    victims = {}
    for name in ("replace", "patch", "delete"):
        victim = outside / f"{name}.conf"
        victim.write_text("outside bytes\nline two\n")
        os.link(victim, root / f"{name}.lnk")
        victims[name] = victim
    outside_before = snapshot_tree(outside)
    ws = daemon.adopt(root)
    base = sha("outside bytes\nline two\n")
    with daemon.client() as c:
        c.call("fs.write", workspace=ws, path="replace.lnk", content="inside\n", base_sha256=base)
        c.call(
            "fs.patch",
            workspace=ws,
            path="patch.lnk",
            base_sha256=base,
            edits=[{"old": "line two", "new": "patched"}],
        )
        c.call("fs.delete", workspace=ws, path="delete.lnk", base_sha256=base)

    # The outside files keep their bytes (and their inode: nothing was written through).
    after = snapshot_tree(outside)
    assert {k: v[:5] for k, v in after.items()} == {k: v[:5] for k, v in outside_before.items()}
    for victim in victims.values():
        assert victim.read_text() == "outside bytes\nline two\n"
        assert os.stat(victim).st_nlink == 1  # the link inside was replaced or removed
    # Inside: new files with new inodes.
    assert (root / "replace.lnk").read_text() == "inside\n"
    assert (root / "patch.lnk").read_text() == "outside bytes\npatched\n"
    assert not (root / "delete.lnk").exists()
    for name in ("replace", "patch"):
        assert os.stat(root / f"{name}.lnk").st_ino != os.stat(victims[name]).st_ino


# --- two writers, one base ---------------------------------------------------------------


@pytest.mark.slow
def test_two_clients_same_base_exactly_one_wins(daemon: DaemonProcess) -> None:
    rounds = 200
    root = daemon.make_workspace(files={"contended.txt": "round -1\n"})
    ws = daemon.adopt(root)
    clients = [daemon.client(), daemon.client()]
    barrier = threading.Barrier(2)
    current = sha("round -1\n")
    results: list[Any] = [None, None]

    def attempt(k: int, r: int, base: str) -> None:
        barrier.wait(PATIENCE_S)
        try:
            clients[k].call(
                "fs.write",
                workspace=ws,
                path="contended.txt",
                content=f"round {r} by {k}\n",
                base_sha256=base,
            )
            results[k] = ("applied", None)
        except RpcError as exc:
            results[k] = (exc.refusal, exc.data.get("current_sha256"))

    wins = [0, 0]
    for r in range(rounds):
        threads = [threading.Thread(target=attempt, args=(k, r, current)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE_S)
        outcomes = sorted(results, key=lambda x: x[0])
        assert [o[0] for o in outcomes] == ["applied", "stale_base"], (r, results)
        winner = next(k for k in (0, 1) if results[k][0] == "applied")
        loser_saw = outcomes[1][1]
        current = sha(f"round {r} by {winner}\n")
        assert loser_saw == current, (r, results)
        assert sha((root / "contended.txt").read_bytes()) == current
        wins[winner] += 1
    assert sum(wins) == rounds
    assert len(daemon.journal(kinds={"fs.write"}, workspace=ws)) == rounds


def test_delete_and_replace_from_the_same_base(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace(files={})
    ws = daemon.adopt(root)
    clients = [daemon.client(), daemon.client()]
    for r in range(40):
        body = f"v{r}\n"
        clients[0].call("fs.write", workspace=ws, path="f", content=body, base_sha256=None)
        barrier = threading.Barrier(2)
        results: list[Any] = [None, None]

        def go(
            k: int, body: str = body, barrier: threading.Barrier = barrier, results: Any = results
        ) -> None:
            barrier.wait(PATIENCE_S)
            try:
                if k == 0:
                    clients[0].call("fs.delete", workspace=ws, path="f", base_sha256=sha(body))
                else:
                    clients[1].call(
                        "fs.write",
                        workspace=ws,
                        path="f",
                        content="replaced\n",
                        base_sha256=sha(body),
                    )
                results[k] = "applied"
            except RpcError as exc:
                results[k] = exc.refusal

        threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE_S)
        assert sorted(results) == ["applied", "stale_base"], results
        if results[0] == "applied":
            assert not (root / "f").exists()
        else:
            assert (root / "f").read_text() == "replaced\n"
            clients[0].call("fs.delete", workspace=ws, path="f", base_sha256=sha("replaced\n"))


# --- temp names and parents moved mid-write -----------------------------------------------


def _fixed_names(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    it = itertools.chain(names, (f"{i:016x}" for i in itertools.count(1 << 60)))
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: next(it))


def test_symlink_planted_at_the_temp_name(
    local: Local, monkeypatch: pytest.MonkeyPatch, snapshot_tree: Snapshot
) -> None:
    (local.outside / "target").write_text("outside\n")
    planted = local.root / f"{TEMP_PREFIX}aaaaaaaaaaaaaaaa"
    planted.symlink_to(local.outside / "target")
    outside_before = snapshot_tree(local.outside)
    _fixed_names(monkeypatch, ["aaaaaaaaaaaaaaaa"])

    plan = local.write("a.txt", "new\n", sha("alpha\n"))

    assert plan.applied
    assert (local.root / "a.txt").read_text() == "new\n"
    assert snapshot_tree(local.outside) == outside_before
    # The planted link is not ours: left as it was, neither followed nor removed.
    assert os.readlink(planted) == str(local.outside / "target")


def test_every_temp_name_planted(
    local: Local, monkeypatch: pytest.MonkeyPatch, snapshot_tree: Snapshot
) -> None:
    """All names taken by traps: the write fails, and no trap is sprung."""
    (local.outside / "target").write_text("outside\n")
    names = [f"{i:016x}" for i in range(1, 9)]
    traps: list[Callable[[Path], None]] = [
        lambda p: p.symlink_to(local.outside / "target"),
        lambda p: p.symlink_to(local.outside / "not-there"),
        lambda p: os.mkfifo(p),
        lambda p: p.mkdir(),
        lambda p: os.link(local.outside / "target", p),
        lambda p: p.symlink_to(local.outside),
        lambda p: p.write_text("someone's file\n"),
        lambda p: p.symlink_to(local.root / "a.txt"),
    ]
    for name, trap in zip(names, traps, strict=True):
        trap(local.root / f"{TEMP_PREFIX}{name}")
    root_before, outside_before = snapshot_tree(local.root), snapshot_tree(local.outside)
    _fixed_names(monkeypatch, names)

    with pytest.raises(Refusal):
        local.write("a.txt", "new\n", sha("alpha\n"))

    assert snapshot_tree(local.root) == root_before
    assert snapshot_tree(local.outside) == outside_before
    assert not (local.outside / "not-there").exists()


class _MovingWriter(writes.Writer):
    """Runs `hook` right after the temp file is written, before the commit."""

    hook: Callable[[], None] = staticmethod(lambda: None)

    def _stage(self, ws: Workspace, parent_fd: int, prep: Any, staged: Any) -> None:
        super()._stage(ws, parent_fd, prep, staged)
        self.hook()


def _moving(local: Local, hook: Callable[[], None]) -> _MovingWriter:
    w = _MovingWriter(local.store, local.registry._journal)
    w.hook = hook  # type: ignore[method-assign]
    local.writer = w
    return w


@pytest.mark.parametrize("create", [False, True])
def test_parent_renamed_outside_mid_write(
    local: Local, snapshot_tree: Snapshot, create: bool
) -> None:
    """The parent moves out of the workspace and a symlink to a decoy takes its place."""
    (local.root / "dir").mkdir()
    (local.root / "dir" / "f.txt").write_text("old\n")
    decoy = local.outside / "decoy"
    decoy.mkdir()
    (decoy / "f.txt").write_text("old\n")
    moved = local.outside / "moved"

    def hook() -> None:
        (local.root / "dir").rename(moved)
        (local.root / "dir").symlink_to(decoy)

    _moving(local, hook)
    decoy_before = snapshot_tree(decoy)
    target = "dir/new.txt" if create else "dir/f.txt"
    try:
        local.write(target, "new\n", None if create else sha("old\n"))
        landed = True
    except Refusal:
        landed = False

    # Never through the symlink that now stands at dir/.
    assert snapshot_tree(decoy) == decoy_before
    assert os.readlink(local.root / "dir") == str(decoy)
    # Either it failed cleanly or it landed in the directory it held, wherever that is now.
    name = target.split("/")[1]
    if landed:
        assert (moved / name).read_text() == "new\n"
    elif create:
        assert not (moved / name).exists()
    else:
        assert (moved / name).read_text() == "old\n"
    assert temp_files(moved) == [] and temp_files(local.root) == []


def test_parent_replaced_by_a_real_directory_mid_write(
    local: Local, snapshot_tree: Snapshot
) -> None:
    (local.root / "dir").mkdir()
    (local.root / "dir" / "f.txt").write_text("old\n")

    def hook() -> None:
        (local.root / "dir").rename(local.root / "dir.old")
        (local.root / "dir").mkdir()
        (local.root / "dir" / "f.txt").write_text("old\n")  # same bytes, another file

    _moving(local, hook)
    try:
        local.write("dir/f.txt", "new\n", sha("old\n"))
    except Refusal:
        assert (local.root / "dir.old" / "f.txt").read_text() == "old\n"
    else:
        assert (local.root / "dir.old" / "f.txt").read_text() == "new\n"
    assert (local.root / "dir" / "f.txt").read_text() == "old\n"
    assert temp_files(local.root) == []


def test_startup_cleaner_never_removes_a_live_temp_file(local: Local) -> None:
    """The cleaner runs in a thread while the sockets already accept writes.

    It must remove only what a previous run left behind, never the temp file of a write
    in flight (that write would fail with an internal error, its rename finding nothing).
    """
    stale = local.root / f"{TEMP_PREFIX}0123456789abcdef"
    stale.write_text("left by a crash\n")
    # Recorded by the run that crashed (the epoch before this one).
    TempFiles(local.store, local.registry._journal.epoch - 1).record(local.ws.id, (), stale.name)
    stop = threading.Event()
    cleaned = [0]

    def clean() -> None:
        while not stop.is_set():
            cleaned[0] += local.registry.clean_stale_temp_files()

    cleaner = threading.Thread(target=clean)
    cleaner.start()
    failures: list[BaseException] = []
    try:
        current = sha("alpha\n")
        for i in range(300):
            body = f"version {i}\n"
            try:
                local.write("a.txt", body, current)
            except BaseException as exc:
                failures.append(exc)
                current = sha((local.root / "a.txt").read_bytes())
                continue
            current = sha(body)
    finally:
        stop.set()
        cleaner.join(PATIENCE_S)
    assert failures == []
    assert not stale.exists() and cleaned[0] >= 1
