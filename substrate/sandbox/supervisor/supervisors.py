"""The supervisors of a daemon's sandboxes: directory, start, checks, loss, replacement.

Theory of operation (docs/fast-exec.md):
- `prepare(who)`, before a sandbox's container is created: a directory
  `<state>/supervisor/<token>/` (root, 0755) holding a copy of `agent.py` (0444) and the
  daemon's listening socket `daemon.sock` (owned by the sandbox's uid, 0600); it is bound
  read-only at `/run/substrate` (`Slot.mount`). The sandbox cannot write there: no
  socket of its own, no file, no disk use. `attach(slot, sandbox)` once it is verified.
- `spawn(sandbox)` (the fast path of one command): the sandbox's supervisor is checked
  (`Link.problem`: same process, not traced, non-dumpable, same confinement) or
  started; the slot's *spare* (a held child forked ahead) is taken, or one is forked
  now; and the held child is checked from the host. A mismatch aborts it, kills the
  supervisor (`supervisor.tampered`) and refuses the command `confinement_unmet`. None
  means "use the engine's exec": no python3 in the image, a start that failed, too many
  restarts lately, or a supervisor lost right now.
- `prefork(sandbox)`, once a command started: ask for the next spare (`Pending`),
  forked while the command runs. The command's run `settle`s it before it looks for its own processes
  (its stragglers, a kill): the spare's host pid then joins the sandbox's `protected`
  pids, so no scan ever finds it unprotected (docs/fast-exec.md "Held children").
- Start (`_start`, with the sandbox's first command; `startup.start_program`): one engine
  exec of `agent.COMMAND` as the sandbox's uid:gid with the profile's environment (no
  process marker: it belongs to no command), checked from the host once it is
  non-dumpable, then given the start's secret (32 random bytes, held by the daemon and
  the supervisor only); the one connection whose peer credentials name that process and
  whose `hello` carries the secret's MAC is its control connection. Its host pid joins
  the sandbox's `protected` pids (the reaper never signals it).
- A warm pool member's supervisor is started while the member waits, and checked again
  once the member is verified for a workspace (`warm`).
- A supervisor that exited, stopped answering or broke the wire is `supervisor.lost`; one
  that is traced, dumpable, or shows other confinement is `supervisor.tampered` (it is
  killed). Either way the next command starts a new one (`supervisor.started` with the
  next generation), at most `MAX_RESTARTS` per `RESTART_WINDOW_S`; beyond that, or after
  a failed start (`supervisor.unavailable`), commands take the engine's exec until the
  window passes.
Journal entries name the container (12 characters), the generation and a reason word;
never an argv, a pid or a path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from substrate.errors import ConfinementUnmet, Refusal
from substrate.metrics import METRICS
from substrate.sandbox import cmd_cgroups
from substrate.sandbox.engine import ContainerGone, Engine, EngineError
from substrate.sandbox.facts import mismatch_report
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import HOST_VISIBLE_RUNTIMES, RunAs
from substrate.sandbox.supervisor import agent, ahead, checks
from substrate.sandbox.supervisor.link import Link, LinkBroken, Spawned
from substrate.sandbox.supervisor.slot import SandboxView, Slot
from substrate.sandbox.supervisor.startup import StartFailed, reason_of, start_program
from substrate.sandbox.supervisor.stream_supervisors import Streams
from substrate.store.journal import Journal

log = logging.getLogger("substrate.sandbox.supervisor")

#: A start (exec, ready, checks, secret, hello) takes at most this long.
START_S = 15.0
#: Restarts allowed per window before commands stay on the engine's exec.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
#: After a failed start, the engine's exec is used for this long before trying again.
RETRY_S = 60.0
#: A channel closed without a report: how long a dying supervisor may take to read as
#: exited (it closes its descriptors before it is a zombie), seconds.
CLOSED_WAIT_S = 1.0
#: What ends a start that did not complete (journalled as `reason_of` names it).
START_ERRORS = (
    StartFailed,
    trio.TooSlowError,
    trio.ClosedResourceError,
    Refusal,
    ContainerGone,
    EngineError,
    OSError,
)
#: Problems that mean the supervisor cannot be trusted (the others: it is just gone).
TAMPERED = frozenset({"traced", "dumpable", "confinement", "cgroup", "namespaces", "protocol"})


def supervised(profile: Profile) -> bool:
    """Does a sandbox of `profile` get a supervisor? Its processes must be host processes
    (runc: the host checks each command's own process) and its root filesystem read-only
    (else a command could change the interpreter a later supervisor start runs)."""
    return profile.runtime in HOST_VISIBLE_RUNTIMES and profile.read_only_rootfs


class Supervisors:
    """Every sandbox's supervisor slot of one daemon, keyed by container id."""

    def __init__(
        self,
        engine: Engine,
        journal: Journal,
        root: Path,
        *,
        fs_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._engine = engine
        self._journal = journal
        self.root = root
        self._fs_limiter = fs_limiter
        self._slots: dict[str, Slot] = {}
        self._program = Path(agent.__file__).read_bytes()
        #: gVisor sandboxes' stream supervisors (docs/fast-exec.md "Under gVisor").
        self.streams = Streams(engine, self._journal_async)

    # -- directories (blocking) ------------------------------------------------------------

    def sweep(self) -> int:
        """At start, before any sandbox: remove what earlier runs left under the root (their
        containers are removed by `Containers.reap_previous`). Returns how many went."""
        if not self.root.is_dir():
            return 0
        gone = 0
        for entry in os.scandir(self.root):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                gone += 1
        return gone

    def prepare(self, who: RunAs) -> Slot:
        """A new supervisor directory for a sandbox about to be created (blocking).
        Raises OSError when the state dir cannot hold it."""
        self.root.mkdir(mode=0o700, exist_ok=True)
        path = self.root / secrets.token_hex(8)
        path.mkdir(mode=0o755)
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.chmod(dir_fd, 0o755)
            fd = os.open(
                agent.PROGRAM_NAME,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                0o444,
                dir_fd=dir_fd,
            )
            with os.fdopen(fd, "wb") as f:
                f.write(self._program)
            # Through the directory fd: a state dir path can exceed a socket path's 108 bytes.
            listener.bind(f"/proc/self/fd/{dir_fd}/{agent.SOCKET_NAME}")
            os.chown(agent.SOCKET_NAME, who.uid, who.gid, dir_fd=dir_fd, follow_symlinks=False)
            os.chmod(agent.SOCKET_NAME, 0o600, dir_fd=dir_fd, follow_symlinks=False)
            listener.listen(8)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            shutil.rmtree(path, ignore_errors=True)
            raise
        finally:
            os.close(dir_fd)
        mount = {
            "Type": "bind",
            "Source": str(path),
            "Target": agent.MOUNT_POINT,
            "ReadOnly": True,
            "BindOptions": {"Propagation": "rprivate"},
        }
        return Slot(path=path, listener=listener, mount=mount)

    # -- sandboxes -------------------------------------------------------------------------

    def attach(self, slot: Slot, sandbox: SandboxView) -> None:
        """`sandbox` (verified) uses `slot`; its supervisor starts with its first command,
        unless one was started while it waited in the warm pool and `warm.check` kept it
        (then its host pid joins the sandbox's protected pids)."""
        slot.sandbox = sandbox
        if slot.accepting is None:
            slot.accepting = trio.socket.from_stdlib_socket(slot.listener)
        if slot.link is not None:
            sandbox.protected = sandbox.protected | {slot.link.pid}
        self._slots[sandbox.id] = slot

    async def detach(self, container: str) -> None:
        """The sandbox is being removed: its supervisor and directory go with it."""
        self.streams.detach(container)
        slot = self._slots.pop(container, None)
        if slot is not None:
            slot.close()
            await trio.to_thread.run_sync(
                functools.partial(shutil.rmtree, slot.path, ignore_errors=True),
                limiter=self._fs_limiter,
            )

    def claim(self, container: str) -> cmd_cgroups.CommandCgroup | None:
        """The command cgroup the spare of `container`'s sandbox was moved ahead into, if
        it has such a spare no command claimed yet: the next command takes its id (its
        `owner`) and that cgroup (made already), and so the spare. None: the caller
        picks its own id and makes its cgroup."""
        slot = self._slots.get(container)
        if slot is None or slot.spare is None or slot.reserve is None or slot.reserve.claimed:
            return None
        slot.reserve.claimed = True
        return slot.reserve.cgroup

    async def spawn(self, sandbox: SandboxView, owner: str | None = None) -> Spawned | None:
        """A held child in `sandbox` (its supervisor's spare, or forked now), checked from
        the host (`Link.check`: a spare moved ahead was read once it was moved, its state
        now); `Spawned.go` makes it the command. `owner`: the command's id
        (a spare moved ahead into another command's cgroup is not taken).

        None: use the engine's exec for this command (nothing ran). Refuses
        `confinement_unmet` when the held child's facts differ from the sandbox's (the
        child is killed before it exec'd; the supervisor is killed and journalled
        `supervisor.tampered`).
        """
        slot = self._slots.get(sandbox.id)
        if slot is None or slot.no_python:
            return None
        link = await self._ready(slot, sandbox)
        if link is None:
            return None
        spawned, reserve = self._take_spare(slot, link, owner)
        leaf = reading = None
        if spawned is not None and reserve is not None:
            spawned, leaf = await ahead.moved(spawned, reserve)
            reading = reserve.reading if leaf is not None else None
        try:
            if spawned is not None:
                try:
                    link.check(spawned, leaf, reading)
                except LinkBroken:  # killed or stopped by the sandbox itself: fork one now
                    spawned.kill()  # a stopped one would hold a task of the pids limit
                    spawned.close()
                    spawned = None
            if spawned is None:
                spawned = await link.spawn()
        except LinkBroken as exc:
            if spawned is not None:
                spawned.kill()  # held, never ran: nothing of a command is killed
                spawned.close()
            if exc.reason != "child-gone":  # a held child killed by the sandbox itself
                await self._drop(slot, link, exc.reason)
            return None
        if spawned.failed is not None:
            spawned.close()
            return None
        if spawned.mismatches:
            try:
                await spawned.abort()
            finally:
                spawned.kill()
                spawned.close()
            report = mismatch_report(spawned.mismatches)
            await self._drop(slot, link, "confinement", report)
            raise ConfinementUnmet(
                "a command's own process did not show its sandbox's confinement; it was "
                "stopped before it ran: " + ", ".join(m.name for m in spawned.mismatches[:8]),
                **report,
            )
        return spawned

    def _take_spare(
        self, slot: Slot, link: Link, owner: str | None
    ) -> tuple[Spawned | None, ahead.Reserve | None]:
        """The slot's spare, unprotected (it is about to become a command), if it was
        forked by `link`, still lives and is not moved ahead for another command (then it
        is left for that one); else None (a dead or stale one is let go). With it, its
        `Reserve` if it has one."""
        spare, reserve = slot.spare, slot.reserve
        if spare is None:
            return None, None
        if spare.generation != link.generation or spare.exited():
            slot.drop_spare()
            return None, None
        if reserve is not None and reserve.cgroup.owner != owner:
            return None, None
        slot.spare = slot.reserve = None
        if slot.sandbox is not None:
            slot.sandbox.protected = slot.sandbox.protected - {spare.host_pid}
        return spare, reserve

    async def prefork(
        self,
        sandbox: SandboxView,
        reserve: Callable[[], cmd_cgroups.CommandCgroup | None] | None = None,
    ) -> Pending | None:
        """A command took the spare and started: ask `sandbox`'s supervisor for the next
        one (None: it has one, one is asked for already, or there is no supervisor). The
        caller `settle`s the answer before it scans the sandbox's processes, or
        `abandon`s it. `reserve`: makes the command cgroup of the next command (an id
        chosen now), which the spare is moved into as soon as it is kept."""
        slot = self._slots.get(sandbox.id)
        if slot is not None:
            slot.remove_orphans()
        if slot is None or slot.link is None or slot.spare is not None or slot.asked:
            return None
        link = slot.link
        slot.asked = True
        try:
            spawned = await link.fork()
        except LinkBroken as exc:
            slot.asked = False
            await self._drop(slot, link, exc.reason)
            return None
        except BaseException:  # cancelled: `fork` closed its side; the child exits
            slot.asked = False
            raise
        return Pending(self, slot, link, spawned, reserve)

    # -- lifecycle -----------------------------------------------------------------------

    async def _ready(self, slot: Slot, sandbox: SandboxView) -> Link | None:
        link = slot.link
        if link is not None and not slot.lock.locked() and link.problem() is None:
            return link  # the usual case, decided without a trip through the event loop
        async with slot.lock:
            link = slot.link
            if link is not None:
                problem = link.problem()
                if problem is None:
                    return link
                await self._drop(slot, link, problem)
            now = trio.current_time()
            slot.losses = [t for t in slot.losses if now - t < RESTART_WINDOW_S]
            if now < slot.retry_at or slot.no_python:
                return None
            if len(slot.losses) >= MAX_RESTARTS:
                slot.retry_at = slot.losses[0] + RESTART_WINDOW_S
                await self._journal_async(
                    "supervisor.unavailable", sandbox, slot.generation + 1, "restarts"
                )
                return None
            return await self._start(slot, sandbox)

    async def _start(self, slot: Slot, sandbox: SandboxView) -> Link | None:
        if not self.has_python(slot, sandbox.id, sandbox.init_pid):
            return None
        generation = slot.generation + 1
        t0 = trio.current_time()
        try:
            with trio.fail_after(START_S):
                base = await trio.to_thread.run_sync(
                    checks.baseline, sandbox.init_pid, sandbox.facts, limiter=self._fs_limiter
                )
                link = await self.launch(
                    slot, sandbox.id, sandbox.who, dict(sandbox.profile.env), base, generation
                )
        except START_ERRORS as exc:
            reason = exc.reason if isinstance(exc, StartFailed) else reason_of(exc)
            slot.retry_at = trio.current_time() + RETRY_S
            log.warning("%s: supervisor start failed: %s", sandbox.id[:12], reason)
            await self._journal_async("supervisor.unavailable", sandbox, generation, reason)
            return None
        if generation > 1:  # in place of one lost, tampered with or stopped
            METRICS.supervisor_replacements.inc()
        sandbox.protected = sandbox.protected | {link.pid}
        start_ms = round((trio.current_time() - t0) * 1000, 3)
        await self._journal_async(
            "supervisor.started", sandbox, generation, None, start_ms=start_ms
        )
        return link

    def has_python(self, slot: Slot, container: str, init_pid: int) -> bool:
        """Is there a python3 to start the program with? (No: `slot.no_python`, for good.)"""
        try:  # the last component is never followed (may be a symlink)
            os.lstat(f"/proc/{init_pid}/root{agent.COMMAND[0]}")
        except OSError:
            slot.no_python = True
            log.info(
                "%s: no %s in the image: commands use the engine's exec",
                container[:12],
                agent.COMMAND[0],
            )
            return False
        return True

    async def launch(
        self,
        slot: Slot,
        container: str,
        who: RunAs,
        environment: dict[str, str],
        base: checks.Baseline,
        generation: int,
    ) -> Link:
        """One start (`startup.start_program`), kept as `slot`'s supervisor `generation`
        (with `_start`, or `warm.prestart`). Raises what `START_ERRORS` names."""
        t0 = trio.current_time()
        assert slot.accepting is not None  # attached, or a warm member's (`prestart`)
        pid, pidfd, control = await start_program(
            self._engine, container, who, environment, base, slot.accepting
        )
        slot.generation = generation
        slot.link = Link(
            container=container,
            generation=generation,
            pid=pid,
            pidfd=pidfd,
            control=control,
            base=base,
            uid=who.uid,
            started=t0,
        )
        return slot.link

    async def _drop(
        self, slot: Slot, link: Link, reason: str, report: dict[str, Any] | None = None
    ) -> None:
        """Stop using `link`: kill it, unprotect its pid, journal why (once)."""
        if slot.link is not link:
            return
        slot.link = None
        slot.drop_spare()
        link.broken = reason
        link.kill()
        link.close()
        slot.losses.append(trio.current_time())
        sandbox = slot.sandbox
        if sandbox is not None:
            sandbox.protected = sandbox.protected - {link.pid}
            kind = "supervisor.tampered" if reason in TAMPERED else "supervisor.lost"
            extra = {} if report is None else {"mismatches": sorted(report["required"])}
            await self._journal_async(kind, sandbox, link.generation, reason, **extra)

    async def serving(self, container: str, generation: int, *, closed: bool = False) -> bool:
        """Is supervisor `generation` of `container` still current and serving? Asked when
        a command's report is late or its channel closed: a supervisor found gone,
        stopped or tampered with is dropped and journalled now, not at the next command.

        `closed`: a channel the supervisor holds closed without its report. A dying
        process closes its descriptors before it is a zombie, so it is looked at again
        for up to `CLOSED_WAIT_S` until it reads as exited; one that lives on and closed a
        channel without reporting is not serving either ("closed")."""
        slot = self._slots.get(container)
        if slot is None or slot.link is None or slot.link.generation != generation:
            return False
        link = slot.link
        problem = link.problem()
        if problem is None and closed:
            with trio.move_on_after(CLOSED_WAIT_S):
                while problem is None:
                    await trio.sleep(0.005)
                    problem = link.problem()
            problem = problem or "closed"
        if problem is None:
            return True
        await self._drop(slot, link, problem)
        return False

    async def _journal_async(
        self,
        kind: str,
        sandbox: SandboxView,
        generation: int,
        reason: str | None,
        **extra: Any,
    ) -> None:
        data: dict[str, Any] = {
            "container": sandbox.id[:12],
            "profile": sandbox.profile.name,
            "generation": generation,
            **({} if reason is None else {"reason": reason}),
            **extra,
        }
        await trio.to_thread.run_sync(
            lambda: self._journal.append(kind, data, workspace=sandbox.workspace)
        )


class Pending:
    """A spare asked for (`Supervisors.prefork`) and not yet kept or let go."""

    def __init__(
        self,
        owner: Supervisors,
        slot: Slot,
        link: Link,
        spawned: Spawned,
        reserve: Callable[[], cmd_cgroups.CommandCgroup | None] | None = None,
    ) -> None:
        self._owner = owner
        self._slot = slot
        self._link = link
        self._spawned: Spawned | None = spawned
        self._reserve = reserve

    async def settle(self) -> None:
        """Receive the supervisor's answer (bounded by `link.REPLY_S`) and keep the held
        child as the slot's spare, its host pid protected; or let it go (a failed fork,
        a supervisor dropped meanwhile, one kept already). A supervisor that did not
        answer as it should is dropped (`supervisor.lost`)."""
        spawned, self._spawned = self._spawned, None
        if spawned is None:
            return
        slot, link = self._slot, self._link
        try:
            await link.forked(spawned)
        except LinkBroken as exc:
            slot.asked = False
            spawned.close()
            if exc.reason == "closed":  # gone, most likely: journalled as what it is
                await self._owner.serving(link.container, link.generation, closed=True)
            elif exc.reason != "child-gone":
                await self._owner._drop(slot, link, exc.reason)
            return
        slot.asked = False
        sandbox = slot.sandbox
        if spawned.failed is not None or slot.link is not link or slot.spare is not None:
            spawned.close()
            return
        if sandbox is None:
            spawned.close()
            return
        slot.spare = spawned
        sandbox.protected = sandbox.protected | {spawned.host_pid}
        cgroup = self._reserve() if self._reserve is not None else None
        if cgroup is not None:
            slot.reserve = reserve = ahead.Reserve(cgroup)
            ahead.enter_soon(reserve, spawned)

    def abandon(self) -> None:
        """Not settled and not going to be (the run ended early): the held child exits
        without exec when its channel closes."""
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            self._slot.asked = False
            spawned.close()
