"""Finding, signalling and reaping a sandboxed command's processes from the host.

Theory of operation: an engine exec has no kill API, so substrate finds the processes
itself. Every command it starts carries an environment marker `SUBSTRATE_PROC=<proc id>`,
inherited by everything it forks. The container's cgroup lists every process inside it
(host pids, `cgroup.procs`); each one's environment, read from the host (psutil), says
whose it is. A process whose marker is gone (it exec'd with a scrubbed environment) belongs to
its nearest marked ancestor; one with no marked ancestor (scrubbed *and* re-parented to
the container's init by a double fork) belongs to nobody, and is reaped only when no
other command runs in that container (`alone`). The container's init and its keep-alive
child are never touched.

Killing is TERM to every process found, a grace period, then KILL in rounds; each KILL
round freezes the cgroup first (v1 `freezer.state`, v2 `cgroup.freeze`) so a fork bomb
cannot outrun the scan, and thaws it after the signals are queued.

OOM kills are counted by the kernel per memory cgroup (`oom_kill` in v1
`memory.oom_control` or v2 `memory.events`); a command was OOM-killed (itself or a child)
when the counter grew while it ran.

Honest seams (docs/execution.md): a process that scrubs its environment and double-forks
while another command runs in the same container is reaped only when that container
next has nothing running; the OOM counter is per container, so two commands running at
once both see an OOM kill of either. Only runc-style runtimes put sandboxed processes on
the host: under gVisor (`runsc`) the cgroup holds the sandbox kernel itself, so nothing
here may signal it (callers check `host_visible`).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import trio

MARKER = "SUBSTRATE_PROC"
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

    @classmethod
    def of_pid(cls, pid: int, root: Path = CGROUP_ROOT) -> CgroupDirs:
        """Read `/proc/<pid>/cgroup`; raises OSError when the process is gone."""
        return cls.parse(Path(f"/proc/{pid}/cgroup").read_text(), root)

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
            )
        if unified is None:
            raise OSError(errno.ENOENT, "no cgroup found")
        base = root / unified.lstrip("/")
        return cls(procs=base, memory=base, freezer=base, v2=True, cpu=base)


def oom_kills(dirs: CgroupDirs) -> int:
    """The kernel's count of OOM kills in this cgroup (0 when the counter is unreadable)."""
    if dirs.memory is None:
        return 0
    name = "memory.events" if dirs.v2 else "memory.oom_control"
    try:
        text = (dirs.memory / name).read_bytes()  # every command's way: no text layer
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
    stack = [dirs.procs]
    while stack:
        here = stack.pop()
        try:
            found.extend(int(x) for x in (here / "cgroup.procs").read_bytes().split())
            with os.scandir(here) as entries:  # the type comes with the listing: no stats
                stack.extend(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
        except (OSError, ValueError):
            continue
    return found


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    #: Equal for one process only, whatever reused its pid: a `psutil.Process` (pid and
    #: start time since boot, immune to wall-clock steps); tests use any hashable.
    ident: Hashable
    marker: str | None


def read_proc(pid: int) -> ProcInfo | None:
    """ppid, identity and substrate marker of a host process; None if gone or a zombie
    (or unreadable). psutil: its stat, status and environ files (about 0.1 ms)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return None
            ppid = proc.ppid()
            environ = proc.environ()
    except psutil.Error:  # gone, a zombie, or not ours to read
        return None
    return ProcInfo(pid=pid, ppid=int(ppid), ident=proc, marker=environ.get(MARKER))


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
    """Owner marker of each process: its own, else its nearest marked ancestor's, else None.

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
            if info.marker is not None:
                found = info.marker
                break
            pid = info.ppid
        for pid in chain:
            owner[pid] = found
    return owner


def with_roots(
    procs: Iterable[ProcInfo], marker: str, roots: Collection[Hashable]
) -> list[ProcInfo]:
    """`procs` with each unmarked process whose identity is in `roots` given `marker`.

    Pure. A process that reused a root's pid has another identity: left alone.
    """
    return [
        replace(p, marker=marker) if p.marker is None and p.ident in roots else p for p in procs
    ]


def targets(
    dirs: CgroupDirs,
    marker: str,
    protected: frozenset[int],
    alone: bool,
    *,
    roots: Collection[Hashable] = (),
) -> list[int]:
    """Host pids belonging to the command with `marker` (plus ownerless ones when `alone`).

    `roots` (identities, `ProcInfo.ident`): processes known to be the command's (its main
    process, as the engine reported it) even without a marker; the identity guards
    against a reused pid. Their descendants follow them, as for a marked process.
    """
    found = (read_proc(pid) for pid in cgroup_pids(dirs) if pid not in protected)
    infos = with_roots([i for i in found if i is not None], marker, roots)
    owners = attribute(infos, protected)
    return [pid for pid, owner in owners.items() if owner == marker or (owner is None and alone)]


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


def kill_round(
    dirs: CgroupDirs,
    marker: str,
    protected: frozenset[int],
    alone: bool,
    *,
    roots: Collection[Hashable] = (),
) -> int:
    """One frozen KILL sweep (blocking, milliseconds). Returns how many were signalled."""
    frozen = _set_frozen(dirs, True)
    try:
        found = targets(dirs, marker, protected, alone, roots=roots)
        _signal_all(found, signal.SIGKILL)
    finally:
        if frozen:
            _set_frozen(dirs, False)
    return len(found)


async def terminate(
    dirs: CgroupDirs,
    marker: str,
    protected: frozenset[int],
    *,
    alone: bool,
    grace_s: float,
    limiter: trio.CapacityLimiter | None = None,
    roots: Collection[Hashable] = (),
) -> tuple[int, int]:
    """TERM every process of the command, wait up to `grace_s`, then KILL what is left.

    Returns (processes sent TERM, processes that needed KILL). Blocking work (procfs
    scans, cgroup writes) runs in worker threads; the waits are Trio sleeps. `roots`:
    as for `targets`.
    """

    def term() -> list[int]:
        found = targets(dirs, marker, protected, alone, roots=roots)
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
            functools.partial(kill_round, dirs, marker, protected, alone, roots=roots),
            limiter=limiter,
        )
        if n == 0:
            break
        killed = max(killed, n)
        await trio.sleep(POLL_S)
    return len(termed), killed


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
