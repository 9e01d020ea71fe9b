"""The spare moved ahead into the next command's cgroup (docs/fast-exec.md "Held
children").

Moving a process between cgroups (its pid written to `cgroup.procs`) takes the kernel's
cgroup migration lock for writing, which waits for an RCU grace period when no migration
happened in the last tens of milliseconds: about 10 ms here for commands 50 ms apart,
which every command paid on its way to exec. So when a spare is kept (`Pending.settle`),
a command id is chosen for the command that will take it, that command's cgroup made,
and the spare moved into it in a worker thread without waiting (`enter_soon`); the
command that `claim`s the id waits only for what is left of the move (`moved`).
The same thread then reads the moved child from the host (`checks.read_process`): the
facts it is checked on cannot change while it is held (see `Link.check`), so the
command that takes it compares that reading instead of reading it again on its way.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from substrate.sandbox import cmd_cgroups
from substrate.sandbox.supervisor import checks
from substrate.sandbox.supervisor.link import REPLY_S, Spawned

if TYPE_CHECKING:
    import outcome  # trio's own: what a worker thread's result arrives as

log = logging.getLogger("substrate.sandbox.supervisor")

#: Empty command cgroups of spares let go, kept for removal once their child has exited
#: (beyond this many the rest are left to the container's removal).
MAX_ORPHANS = 16


@dataclass
class Reserve:
    """The command cgroup a spare is moved into while it is held (docs/fast-exec.md "Held
    children"): made for a command id chosen ahead (`cgroup.owner`), which the next
    command `claim`s. `done` is set once the move finished; `entered` says whether it
    succeeded (the spare in it, confirmed by its pidfd afterwards); `reading`: the spare
    as the host saw it once it was there (None: not read, it is read when taken)."""

    cgroup: cmd_cgroups.CommandCgroup
    done: trio.Event = field(default_factory=trio.Event)
    entered: bool = False
    claimed: bool = False
    reading: checks.Reading | None = None


async def moved(spawned: Spawned, reserve: Reserve) -> tuple[Spawned | None, str | None]:
    """A spare taken with its `Reserve`: once its move finished, the spare and the name of
    the command cgroup it is in (None: the move failed, the command moves it itself).
    (None, None) when the move does not finish within `REPLY_S` (the spare is not used).
    The reading taken after the move is then `reserve.reading`."""
    try:
        with trio.move_on_after(REPLY_S):  # the move, begun while the last command ran
            await reserve.done.wait()
    except BaseException:
        spawned.kill()  # held, never ran
        spawned.close()
        raise
    if not reserve.done.is_set():
        spawned.kill()
        spawned.close()
        return None, None
    if not reserve.entered:
        return spawned, None
    spawned.entered = reserve.cgroup.path
    return spawned, reserve.cgroup.path.name


def enter_soon(reserve: Reserve, spawned: Spawned) -> None:
    """Move the held `spawned` into `reserve.cgroup` in a worker thread, without waiting:
    the write can take a kernel grace period (milliseconds, cgroupfs's migration lock),
    which this way passes while the previous command ends rather than on the next one's
    way to exec. `reserve.done` is set on the event loop once it finished; a child that
    exited meanwhile (its pidfd) is not `entered` (the pid written may not have been its
    own). `cmd_cgroups.enter` moves it only while it is in the container's own cgroup."""
    token = trio.lowlevel.current_trio_token()
    pid = spawned.host_pid

    def move() -> tuple[bool, checks.Reading | None]:
        try:
            entered = cmd_cgroups.enter(reserve.cgroup, pid)
        except Exception:  # never lose the answer: the command then moves it itself
            log.exception("moving a held child ahead failed")
            return False, None
        if not entered:
            return False, None
        try:
            return True, checks.read_process(pid)
        except (ProcessLookupError, OSError):  # gone: its pidfd says so when it is taken
            return True, None

    def finish(result: tuple[bool, checks.Reading | None]) -> None:
        moved, reading = result
        reserve.entered = moved and not spawned.exited()
        # Read while it lived (its pidfd, after the read): the reading is its own.
        reserve.reading = reading if reserve.entered else None
        reserve.done.set()

    def deliver(result: outcome.Outcome[tuple[bool, checks.Reading | None]]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(finish, result.unwrap())

    trio.lowlevel.start_thread_soon(move, deliver)
