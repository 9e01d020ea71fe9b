"""One sandbox's supervisor slot: its directory, socket, supervisor and spare.

A slot holds the directory, listening socket and bind mount, the supervisor running
now, and the spare held child forked ahead (docs/fast-exec.md "Held children").
`Supervisors` (`supervisors.py`) owns the slots and their life; a slot's own
methods let go of what it holds.

Threading: every method runs on the event loop's thread, except `discard`'s directory
removal (a handful of syscalls).
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from substrate.sandbox import cmd_cgroups
from substrate.sandbox.facts import Fact
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import RunAs
from substrate.sandbox.supervisor import ahead
from substrate.sandbox.supervisor.link import Link, Spawned


class SandboxView(Protocol):
    """What the supervisors use of a `containers.Sandbox` (which satisfies it)."""

    id: str
    workspace: str
    profile: Profile
    who: RunAs
    init_pid: int
    facts: list[Fact]
    protected: frozenset[int]


@dataclass
class Slot:
    """One sandbox's supervisor directory and its current supervisor (`link`)."""

    path: Path
    listener: socket.socket
    mount: dict[str, Any]
    sandbox: SandboxView | None = None
    link: Link | None = None
    generation: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)
    no_python: bool = False
    retry_at: float = 0.0  # trio clock: no start before this
    losses: list[float] = field(default_factory=list)  # trio clock of recent losses
    accepting: trio.socket.SocketType | None = None
    #: A held child forked ahead for the next command (its host pid is protected).
    spare: Spawned | None = None
    #: The command cgroup the spare is (being) moved into, if any.
    reserve: ahead.Reserve | None = None
    asked: bool = False  # a spare was asked for and is not settled yet
    #: Command cgroups of spares let go, removed once empty (`remove_orphans`).
    orphans: list[cmd_cgroups.CommandCgroup] = field(default_factory=list)
    #: A supervisor started while its sandbox waited in the warm pool (`warm.prestart`): how
    #: long its start took, journalled once a workspace's sandbox takes it over.
    warm_ms: float | None = None

    def drop_spare(self) -> None:
        """Let go of the spare (it exits without exec) and unprotect its pid."""
        spare, self.spare = self.spare, None
        reserve, self.reserve = self.reserve, None
        if spare is None:
            return
        if self.sandbox is not None:
            self.sandbox.protected = self.sandbox.protected - {spare.host_pid}
        if reserve is not None:
            spare.kill()  # held, never ran (its pidfd): its cgroup empties at once
            # A claimed one is its command's: that command removes it as it ends.
            if not reserve.claimed and len(self.orphans) < ahead.MAX_ORPHANS:
                self.orphans.append(reserve.cgroup)
        spare.close()

    def remove_orphans(self) -> None:
        """Remove the empty cgroups of spares let go (an `rmdir` each; one still busy, its
        child not yet reaped, is tried again next time)."""
        if self.orphans:
            self.orphans = [cg for cg in self.orphans if not cmd_cgroups.remove(cg)]

    def discard(self) -> None:
        """Its sandbox never came up, or went: `close`, and remove the directory (a
        handful of syscalls: the sandbox cannot write there)."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def close(self) -> None:
        """Kill its supervisor, close the sockets (on the event loop's thread)."""
        self.drop_spare()
        if self.link is not None:
            self.link.kill()
            self.link.close()
            self.link = None
        if self.accepting is not None:
            self.accepting.close()
        self.listener.close()
