"""Finding, signalling and reaping a sandboxed command's processes from the host.

Theory of operation: an engine exec has no kill API, so substrate finds the processes
itself, and trusts nothing the sandbox can set for it. Every command runs in a cgroup of
its own beneath the container's (`substrate-cmd-<proc>`: `substrate.sandbox.cmd_cgroups`
makes it and moves the command in; nothing in the sandbox can leave it). The container's
cgroup lists every process inside it (host pids, `cgroup.procs`, nested ones included);
the command cgroup that holds one says whose it is. A process outside every command's
cgroup (an engine exec's child forked before the daemon moved the exec) belongs to its
nearest ancestor that is in one, or to the command whose main process it is (`roots`:
the pid and start time the engine or a pidfd reported); one with no such ancestor
(re-parented to the container's init by a double fork) belongs to nobody, and is reaped
only when no other command runs in that container (`alone`). The `SUBSTRATE_PROC`
variable each command gets is for the command itself: its value, its absence, a copy of
another command's — none of it decides anything here. The container's init and its
keep-alive child are never touched.

Killing is TERM to every process found, a grace period, then KILL in rounds; each KILL
round freezes the cgroup first (v1 `freezer.state`, v2 `cgroup.freeze`) so a fork bomb
cannot outrun the scan, writes the command cgroup's v2 `cgroup.kill`, and thaws it after
the signals are queued.

OOM kills are counted by the kernel per memory cgroup (`oom_kill` in v1
`memory.oom_control` or v2 `memory.events`); a command was OOM-killed (itself or a child)
when the counter grew while it ran.

Honest seams (docs/execution.md): on the engine path, a process that double-forks before
the daemon moved the exec into its cgroup, while another command runs in the same
container, is reaped only when that container next has nothing running; the OOM counter
is per container, so two commands running at once both see an OOM kill of either. Only
runc-style runtimes put sandboxed processes on the host: under gVisor (`runsc`) the
cgroup holds the sandbox kernel itself, so nothing here may signal it (callers check
`host_visible`).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import trio

#: The variable every command gets with its own id (`argv.exec_env`): for the command's
#: own use. The reaper never reads it (a process can set it to anything).
MARKER = "SUBSTRATE_PROC"
#: A command's cgroup is `<container's cgroup>/<CMD_PREFIX><proc>` (`cmd_cgroups`).
CMD_PREFIX = "substrate-cmd-"
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: KILL rounds before giving up on a process that will not die (a D-state task).
KILL_ROUNDS = 20
POLL_S = 0.05


@dataclass(frozen=True)
class CgroupDirs:
    """The cgroup directories of one container, found from its init's `/proc/<pid>/cgroup`."""

    procs: Path  # whose cgroup.procs lists every process (v1 pids, or the v2 unified dir)
    memory: Path | None  # whose counters hold `oom_kill`
    freezer: Path | None
    v2: bool
    #: whose counters hold CPU time (v1 `cpuacct.usage`, v2 `cpu.stat`; `process.usage`)
    cpu: Path | None = None
    #: the container's directory in the unified (v2) hierarchy, where command cgroups
    #: go: the v2 one itself, or `<root>/unified/...` on a hybrid host (may not exist)
    unified: Path | None = None

    @classmethod
    def of_pid(cls, pid: int, root: Path = CGROUP_ROOT) -> CgroupDirs:
        """Read `/proc/<pid>/cgroup`; raises OSError when the process is gone."""
        return cls.parse(read_small(f"/proc/{pid}/cgroup").decode("utf-8", "surrogateescape"), root)

    @classmethod
    def parse(cls, text: str, root: Path = CGROUP_ROOT) -> CgroupDirs:
        """The directories named by a `/proc/<pid>/cgroup` text (pure). v1 controllers
        win over the v2 unified entry of a hybrid hierarchy. Raises OSError if none."""
        v1: dict[str, str] = {}
        unified: str | None = None
        for line in text.splitlines():
            num, controllers, path = line.split(":", 2)
            if num == "0" and controllers == "":
                unified = path
            for name in controllers.split(","):
                if name:
                    v1[name] = path

        def under(controller: str) -> Path | None:
            return root / controller / v1[controller].lstrip("/") if controller in v1 else None

        if "pids" in v1 or "memory" in v1:
            procs = under("pids") or under("memory")
            assert procs is not None
            return cls(
                procs=procs,
                memory=under("memory"),
                freezer=under("freezer"),
                v2=False,
                cpu=under("cpuacct"),
                unified=None if unified is None else root / "unified" / unified.lstrip("/"),
            )
        if unified is None:
            raise OSError(errno.ENOENT, "no cgroup found")
        base = root / unified.lstrip("/")
        return cls(procs=base, memory=base, freezer=base, v2=True, cpu=base, unified=base)


def commands_parent(dirs: CgroupDirs) -> tuple[Path, bool] | None:
    """Where a container's command cgroups are: its unified (v2) directory when the host
    has one (then True: `cgroup.kill` and `cgroup.freeze` exist), else its v1 `procs`
    directory (False); None when neither is usable. One `stat`."""
    if dirs.unified is not None and (dirs.unified / "cgroup.procs").exists():
        return dirs.unified, True
    if not dirs.v2:
        return dirs.procs, False
    return None


def command_members(dirs: CgroupDirs) -> dict[int, str]:
    """Host pid → the command (its id) whose cgroup holds it, for every command cgroup
    of the container. Cost: a listing and one read per command cgroup."""
    where = commands_parent(dirs)
    found: dict[int, str] = {}
    if where is None:
        return found
    try:
        with os.scandir(where[0]) as entries:
            names = [
                e.name
                for e in entries
                if e.name.startswith(CMD_PREFIX) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return found
    for name in names:
        try:
            listed = read_small(f"{where[0]}/{name}/cgroup.procs").split()
        except OSError:
            continue
        owner = name[len(CMD_PREFIX) :]
        for pid in listed:
            found[int(pid)] = owner
    return found


def oom_kills(dirs: CgroupDirs) -> int:
    """The kernel's count of OOM kills in this cgroup (0 when the counter is unreadable)."""
    if dirs.memory is None:
        return 0
    name = "memory.events" if dirs.v2 else "memory.oom_control"
    try:
        text = read_small(f"{dirs.memory}/{name}")  # every command's way: no text layer
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(b" ")
        if key == b"oom_kill":
            return int(value)
    return 0


def cgroup_pids(dirs: CgroupDirs) -> list[int]:
    """Every process in the container's cgroup (and any nested one), as host pids.
    Cost: one read and one directory listing per cgroup (tens of microseconds)."""
    found: list[int] = []
    stack = [str(dirs.procs)]
    while stack:
        here = stack.pop()
        try:
            found.extend(map(int, read_small(f"{here}/cgroup.procs").split()))
            with os.scandir(here) as entries:  # the type comes with the listing: no stats
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except (OSError, ValueError):
            continue
    return found


def read_small(path: str) -> bytes:
    """A procfs or cgroupfs file in one system call each for open, reads and close (no
    buffered file object: these are on every command's way). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 1 << 16)]
        while len(chunks[-1]) == 1 << 16:  # a long cgroup.procs: read to its end
            chunks.append(os.read(fd, 1 << 16))
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    #: Equal for one process only, whatever reused its pid: a `psutil.Process` (pid and
    #: start time since boot, immune to wall-clock steps); tests use any hashable.
    ident: Hashable
    #: The command whose cgroup holds it (`command_members`); None outside every one.
    owner: str | None


def read_proc(pid: int, owner: str | None = None) -> ProcInfo | None:
    """ppid and identity of a host process, with `owner` (the command whose cgroup
    holds it); None if gone or a zombie (or unreadable). psutil: its stat and status
    files (tens of microseconds). Nothing the process can write is read."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return None
            ppid = proc.ppid()
    except psutil.Error:  # gone, a zombie, or not ours to read
        return None
    return ProcInfo(pid=pid, ppid=int(ppid), ident=proc, owner=owner)


def identity(pid: int) -> Hashable | None:
    """The identity of host process `pid` (see `ProcInfo.ident`); None if it is gone or a
    zombie. Its stat file only (tens of microseconds)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return None
    except psutil.Error:
        return None
    found: Hashable = proc
    return found


def attribute(procs: Iterable[ProcInfo], protected: frozenset[int]) -> dict[int, str | None]:
    """The command of each process: its own `owner` (its cgroup's), else its nearest
    owned ancestor's, else None.

    Pure. `protected` pids (init, keep-alive) are left out and end every ancestor walk.
    """
    by_pid = {p.pid: p for p in procs if p.pid not in protected}
    owner: dict[int, str | None] = {}
    for start in by_pid:
        chain: list[int] = []
        pid = start
        found: str | None = None
        while True:
            if pid in owner:
                found = owner[pid]
                break
            info = by_pid.get(pid)
            if info is None or len(chain) > len(by_pid):  # outside, or a (racy) ppid cycle
                break
            chain.append(pid)
            if info.owner is not None:
                found = info.owner
                break
            pid = info.ppid
        for pid in chain:
            owner[pid] = found
    return owner


def with_roots(
    procs: Iterable[ProcInfo], owner: str, roots: Collection[Hashable]
) -> list[ProcInfo]:
    """`procs` with each process outside every command cgroup whose identity is in
    `roots` given `owner`.

    Pure. A process that reused a root's pid has another identity: left alone.
    """
    return [replace(p, owner=owner) if p.owner is None and p.ident in roots else p for p in procs]


def owners(
    dirs: CgroupDirs,
    protected: frozenset[int],
    *,
    owner: str | None = None,
    roots: Collection[Hashable] = (),
) -> dict[int, str | None]:
    """The command of every unprotected process in the container (`attribute`), its
    membership read from the command cgroups; `roots` are `owner`'s even outside them.
    Blocking: a scan of the container's cgroup and a stat read per process."""
    members = command_members(dirs)
    found = (read_proc(pid, members.get(pid)) for pid in cgroup_pids(dirs) if pid not in protected)
    infos = [i for i in found if i is not None]
    if owner is not None and roots:
        infos = with_roots(infos, owner, roots)
    return attribute(infos, protected)


def targets(
    dirs: CgroupDirs,
    owner: str,
    protected: frozenset[int],
    alone: bool,
    *,
    roots: Collection[Hashable] = (),
) -> list[int]:
    """Host pids belonging to command `owner` (plus ownerless ones when `alone`).

    `roots` (identities, `ProcInfo.ident`): processes known to be the command's (its main
    process, as the engine or its pidfd reported it) even outside its cgroup; the
    identity guards against a reused pid. Their descendants follow them.
    """
    found = owners(dirs, protected, owner=owner, roots=roots)
    return [pid for pid, whose in found.items() if whose == owner or (whose is None and alone)]


def everything(dirs: CgroupDirs, protected: frozenset[int]) -> list[int]:
    """Every unprotected process of the container, whoever it belongs to (the sweep of a
    working layer whose users all ended). Blocking: one scan, no per-process read."""
    return [pid for pid in cgroup_pids(dirs) if pid not in protected]


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


def _set_frozen(dirs: CgroupDirs, frozen: bool) -> bool:
    """Freeze or thaw the container's cgroup; False when there is no freezer."""
    if dirs.freezer is None:
        return False
    try:
        if dirs.v2:
            (dirs.freezer / "cgroup.freeze").write_text("1" if frozen else "0")
        else:
            (dirs.freezer / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
    except OSError:
        return False
    if not frozen:
        return True
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            if dirs.v2:
                done = "frozen 1" in (dirs.freezer / "cgroup.events").read_text()
            else:
                done = (dirs.freezer / "freezer.state").read_text().strip() == "FROZEN"
        except OSError:
            return False
        if done:
            return True
        time.sleep(0.002)
    return True  # best effort: signals queued to a freezing task still land at thaw


def _cgroup_kill(dirs: CgroupDirs, owner: str) -> bool:
    """Write the v2 `cgroup.kill` of command `owner`'s cgroup; False when it has none."""
    where = commands_parent(dirs)
    if where is None or not where[1]:
        return False
    try:
        (where[0] / (CMD_PREFIX + owner) / "cgroup.kill").write_bytes(b"1")
    except OSError:
        return False  # no such cgroup (never made, removed already)
    return True


#: Whether no other command runs in the container: a bool, or a callable asked at the
#: moment of each scan. Asked late on purpose: an engine exec's process is nobody's until
#: it is moved into its command's cgroup, so a sweep that decided "alone" before another
#: command started would take that command's new process for its own straggler.
Alone = bool | Callable[[], bool]


def is_alone(alone: Alone) -> bool:
    """`alone` as it is now."""
    return alone() if callable(alone) else alone


def kill_round(
    dirs: CgroupDirs,
    owner: str | None,
    protected: frozenset[int],
    alone: Alone,
    *,
    roots: Collection[Hashable] = (),
) -> int:
    """One KILL sweep (blocking, milliseconds). Returns how many were signalled.
    `owner` None: every unprotected process (`everything`).

    A command with a cgroup of its own is killed by its `cgroup.kill` (the kernel takes
    what it forks meanwhile too) and its processes outside it by pid, the container left
    running: freezing the whole container would also make the engine refuse an exec that
    another command is starting at that moment ("paused container"). Without one, the
    sweep freezes the container so that a forking command cannot outrun it."""
    if owner is not None:
        found = targets(dirs, owner, protected, is_alone(alone), roots=roots)
        if _cgroup_kill(dirs, owner):
            _signal_all(found, signal.SIGKILL)
            return len(found)
    frozen = _set_frozen(dirs, True)
    try:
        if owner is None:
            found = everything(dirs, protected)
            for whose in set(command_members(dirs).values()) if found else ():
                _cgroup_kill(dirs, whose)
        else:
            found = targets(dirs, owner, protected, is_alone(alone), roots=roots)
            if found:
                _cgroup_kill(dirs, owner)
        _signal_all(found, signal.SIGKILL)
    finally:
        if frozen:
            _set_frozen(dirs, False)
    return len(found)


async def terminate(
    dirs: CgroupDirs,
    owner: str,
    protected: frozenset[int],
    *,
    alone: Alone,
    grace_s: float,
    limiter: trio.CapacityLimiter | None = None,
    roots: Collection[Hashable] = (),
) -> tuple[int, int]:
    """TERM every process of command `owner`, wait up to `grace_s`, then KILL what is left.

    Returns (processes sent TERM, processes that needed KILL). Blocking work (procfs
    scans, cgroup writes) runs in worker threads; the waits are Trio sleeps. `roots`:
    as for `targets`.
    """

    def term() -> list[int]:
        found = targets(dirs, owner, protected, is_alone(alone), roots=roots)
        _signal_all(found, signal.SIGTERM)
        return found

    termed: set[int] = set()
    deadline = trio.current_time() + grace_s
    while True:
        found: list[int] = await trio.to_thread.run_sync(term, limiter=limiter)
        termed.update(found)
        if not found:
            return len(termed), 0
        if trio.current_time() >= deadline:
            break
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                for pid in found:
                    nursery.start_soon(wait_exit, pid)
    killed = 0
    for _ in range(KILL_ROUNDS):
        n = await trio.to_thread.run_sync(
            functools.partial(kill_round, dirs, owner, protected, alone, roots=roots),
            limiter=limiter,
        )
        if n == 0:
            break
        killed = max(killed, n)
        await trio.sleep(POLL_S)
    return len(termed), killed


async def kill_all(
    dirs: CgroupDirs, protected: frozenset[int], *, limiter: trio.CapacityLimiter | None = None
) -> int:
    """KILL every unprotected process of the container, in frozen rounds until none is
    left (at most `KILL_ROUNDS`): what is left once no command uses it. Returns the most
    found in a round (0: there was nothing). Blocking work in worker threads."""
    killed = 0
    for _ in range(KILL_ROUNDS):
        n = await trio.to_thread.run_sync(
            functools.partial(kill_round, dirs, None, protected, True), limiter=limiter
        )
        if n == 0:
            break
        killed = max(killed, n)
        await trio.sleep(POLL_S)
    return killed


async def wait_exit(pid: int, ident: Hashable | None = None) -> None:
    """Return when host process `pid` has exited (pidfd; no polling). Immediately if gone.

    With `ident` (from `identity`), a different process that reused the pid counts as gone.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if ident is not None and identity(pid) != ident:
            return
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
