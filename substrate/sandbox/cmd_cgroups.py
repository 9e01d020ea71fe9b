"""One cgroup per command beneath its container's: the membership the reaper trusts.

Theory of operation (docs/execution.md, "Kill and reap"). A command's processes are the
ones in its own cgroup, `<container's cgroup>/substrate-cmd-<proc>`, which the daemon
(root, on the host) makes before the command runs (`make`) and moves the command's first
process into (`enter`): on the fast path the held child, before it execs; on the engine
path the exec's process as soon as the engine names it, with whatever it forked by then
(`enclose`). Everything it forks afterwards is born in that cgroup, and nothing in the
sandbox can leave it: the container's cgroupfs is mounted read-only (or not at all: the
unified hierarchy of a hybrid host), its files are root's, and moving a process needs
write access to a common ancestor's `cgroup.procs` — no environment variable, process
name or parentage the sandbox controls has a say. At the end `kill` ends the whole tree
(v2 `cgroup.kill`: atomic, forks included; v1: SIGKILL to each member, in rounds) and
`remove` takes the empty cgroup away.

Where: the unified (v2) hierarchy whenever the host has one (pure v2, or the
`/sys/fs/cgroup/unified` of a hybrid host: no controllers are needed, so the "no
internal processes" rule never applies and the container's limits stay where they are,
above); else the container's v1 `pids` cgroup (the kill then goes in rounds). Under
gVisor the sandbox's processes are not host processes: no command cgroup is made
(`host_visible` is false) and nothing here runs.

Costs: a `mkdir` and an `rmdir` per command, one write per process moved, one small
read of `/proc/<pid>/cgroup` to check it is in the container before it is moved; all on
in-memory cgroupfs (microseconds).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import trio

from substrate.sandbox.reaper import (
    CGROUP_ROOT,
    CMD_PREFIX,
    CgroupDirs,
    commands_parent,
    read_small,
)

log = logging.getLogger("substrate.sandbox.cmd_cgroups")

#: What may follow the prefix: a process id (`p_…`) or a terminal session's (`t_…`).
_OWNER = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Rounds of `enclose` looking for children forked before the move.
ENCLOSE_ROUNDS = 8
#: Kill-and-remove tries of `close` (each waits a little longer: 2 ms doubling to 0.1 s).
CLOSE_ROUNDS = 20


@dataclass(frozen=True)
class CommandCgroup:
    """One command's cgroup (see the module doc)."""

    owner: str  # the command's id (the directory's name after `reaper.CMD_PREFIX`)
    path: Path
    parent: Path  # the container's own cgroup, in the same hierarchy
    v2: bool  # `cgroup.kill` exists


def make(dirs: CgroupDirs, owner: str) -> CommandCgroup | None:
    """The cgroup of command `owner` beneath the container's (made now; an existing one,
    left by an earlier try, is reused). None when the host cannot make it (no such
    hierarchy, not root): the reaper then knows the command by its main process only."""
    if not _OWNER.fullmatch(owner):
        raise ValueError(f"not a command id: {owner!r}")
    where = commands_parent(dirs)
    if where is None:
        return None
    parent, v2 = where
    path = parent / (CMD_PREFIX + owner)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("no command cgroup under %s: %s", parent, exc)
        return None
    return CommandCgroup(owner=owner, path=path, parent=parent, v2=v2)


def in_container(pid: int, cg: CommandCgroup, root: Path = CGROUP_ROOT) -> bool:
    """Is host process `pid` in the container's own cgroup (not in a command's, not
    elsewhere on the host)? One read of `/proc/<pid>/cgroup`."""
    try:
        dirs = CgroupDirs.of_pid(pid, root)
    except (OSError, ValueError):
        return False
    where = commands_parent(dirs)
    return where is not None and where[0] == cg.parent


def enter(cg: CommandCgroup, pid: int) -> bool:
    """Move host process `pid` into `cg`, if it is in the container's own cgroup right
    now (never a process of the host or of another command). False when it is not, or
    is gone. The caller confirms, by a pidfd it holds, that `pid` was still its process
    after the move (a pid is not reused while its process lives)."""
    if not in_container(pid, cg):
        return False
    try:
        (cg.path / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        if exc.errno not in (errno.ESRCH, errno.ENOENT):
            log.warning("moving a process into %s failed: %s", cg.path.name, exc)
        return False
    return True


def enclose(cg: CommandCgroup, pid: int, container_pids: Collection[int]) -> int:
    """Move `pid` and every descendant of it still in the container's own cgroup into
    `cg` (what an engine exec forked before the daemon learnt its pid), in rounds until
    none is left or `ENCLOSE_ROUNDS`. `container_pids`: every process of the container
    (`reaper.cgroup_pids`). Returns how many moved. A process re-parented to the init
    before it was seen is nobody's (docs/execution.md)."""
    moved = 0
    inside = set()
    if enter(cg, pid):
        moved += 1
    inside.add(pid)
    inside.update(pids(cg))
    for _ in range(ENCLOSE_ROUNDS):
        found = [p for p in container_pids if p not in inside and _ppid(p) in inside]
        if not found:
            break
        for child in found:
            if enter(cg, child):
                moved += 1
            inside.add(child)
    return moved


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # after the command name, which may hold ")"
    return int(fields[1]) if len(fields) > 1 else None


def pids(cg: CommandCgroup) -> list[int]:
    """The command's live processes (its `cgroup.procs`); [] once the cgroup is gone."""
    try:
        return [int(x) for x in read_small(f"{cg.path}/cgroup.procs").split()]
    except (OSError, ValueError):
        return []


def kill(cg: CommandCgroup) -> int:
    """SIGKILL every process of the command: v2 `cgroup.kill` (the kernel kills the
    whole cgroup, forks racing it included), v1 one signal per member (the caller
    repeats while any is left). Returns how many were members when it was called."""
    members = pids(cg)
    if not members:
        return 0
    if cg.v2:
        try:
            (cg.path / "cgroup.kill").write_text("1")
            return len(members)
        except OSError as exc:
            log.warning("cgroup.kill of %s failed: %s", cg.path.name, exc)
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(members)


def remove(cg: CommandCgroup) -> bool:
    """Remove the (empty) cgroup; False while a process is still in it (EBUSY: one
    that has not died yet). True when it is gone (or was already)."""
    try:
        os.rmdir(cg.path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            log.warning("removing %s failed: %s", cg.path.name, exc)
        return False
    return True


async def close(cg: CommandCgroup, *, limiter: trio.CapacityLimiter | None = None) -> bool:
    """The command is over: kill whatever is still in its cgroup and remove it, trying
    again while its last processes die (at most `CLOSE_ROUNDS`). False when it could not
    be removed (a process that does not die: it stays the command's, and the layer's
    sweep or the container's removal ends it). Cheap when the cgroup is empty already:
    one read and an `rmdir`, on the event loop."""
    delay = 0.002
    for _ in range(CLOSE_ROUNDS):
        if not pids(cg) and remove(cg):
            return True
        await trio.to_thread.run_sync(kill, cg, limiter=limiter)
        await trio.sleep(delay)
        delay = min(delay * 2, 0.1)
    if remove(cg):
        return True
    log.error("the cgroup of %s keeps a process that does not die", cg.owner)
    return False
