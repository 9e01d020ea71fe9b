"""The stream supervisors of a daemon's gVisor sandboxes: start, loss, replacement.

Theory of operation (docs/fast-exec.md "Under gVisor"):
- `ready(sandbox)` (a command in a runsc sandbox with a read-only root filesystem): its
  running `StreamLink`, or one started now — but only while no code of the sandbox's
  has run in it (`fresh`: every user so far a command, none of them started yet), so
  nothing of the sandbox can read the start's secret off the supervisor's stdin, which
  a process of its uid can open under runsc. Concurrent first commands wait for the one
  start (the slot's lock) and all take the stream. A start: one engine exec of `stream_agent`'s text
  (`command`: `python3 -I -S -B -c <program>`) as the sandbox's uid:gid with the
  profile's environment, stdin attached, no terminal; the secret (32 random bytes) as
  the first frame on its stdin; its tagged `ready` within `START_S`; the link's reader
  runs as a system task for the life of the stream. None: use the engine's exec.
- The stream ends (the supervisor was killed — sandboxed code of its uid can —, the
  engine dropped the exec, a frame's tag was wrong): `supervisor.lost` (`closed`) or
  `supervisor.tampered` (`protocol`), and that sandbox's commands take the engine's exec
  from then on: a new supervisor's secret would travel on a stdin that whatever killed
  the last one could read. A new sandbox (after a timeout, a kill, the idle reaper)
  gets its own with its first command.
- `detach(container)`: the sandbox is being removed; its link closes.
Journal entries carry `transport: "stream"` besides what the runc supervisor's carry.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from substrate.errors import Refusal
from substrate.sandbox.engine import ContainerGone, Engine, EngineError
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import RunAs
from substrate.sandbox.supervisor import stream_agent
from substrate.sandbox.supervisor.startup import StartFailed, reason_of
from substrate.sandbox.supervisor.stream_link import StreamLink

log = logging.getLogger("substrate.sandbox.supervisor")

#: The runtime whose sandboxes get a stream supervisor.
STREAM_RUNTIMES = frozenset({"runsc"})
#: A start (exec, `ready`) takes at most this long.
START_S = 15.0
#: A stream that ended: how long its sandbox may take to be removed (then it was no
#: supervisor's loss) before the loss is journalled, seconds.
REMOVAL_S = 5.0
#: Exit codes of an exec whose program could not be started (no python3 in the image).
NOT_STARTED = frozenset({126, 127})

Journal = Callable[..., Awaitable[None]]


def command(program: str) -> list[str]:
    """The supervisor's argv: the interpreter isolated (no PYTHON* variables, user site or
    script directory), no `site`, no bytecode written; the program itself in argv."""
    return ["/usr/bin/python3", "-I", "-S", "-B", "-c", program]


def streamed(profile: Profile) -> bool:
    """Does a sandbox of `profile` get a stream supervisor? gVisor, and a read-only root
    filesystem (else a command could change the interpreter a later start runs)."""
    return profile.runtime in STREAM_RUNTIMES and profile.read_only_rootfs


def fresh(sandbox: StreamSandbox) -> bool:
    """Has no code of the sandbox's run in it yet? Every user it had is a command (no
    terminal), and none of them started its program."""
    return not sandbox.code_started and sandbox.acquired == sandbox.command_users


class StreamSandbox(Protocol):
    """What the stream supervisors use of a `containers.Sandbox`."""

    id: str
    workspace: str
    profile: Profile
    who: RunAs
    acquired: int
    command_users: int
    code_started: bool


@dataclass
class StreamSlot:
    link: StreamLink | None = None
    generation: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)
    #: No (more) stream for this sandbox: its start failed, it was lost, or the sandbox
    #: had run code of its own (a terminal, a started command) before a command asked.
    done: bool = False
    detached: trio.Event = field(default_factory=trio.Event)


class Streams:
    """Every gVisor sandbox's stream supervisor of one daemon, keyed by container id."""

    def __init__(self, engine: Engine, journal: Journal) -> None:
        self._engine = engine
        self._journal = journal
        self._slots: dict[str, StreamSlot] = {}
        self._sandboxes: dict[str, StreamSandbox] = {}
        self._program = Path(stream_agent.__file__).read_text(encoding="utf-8")
        #: Commands started over a stream (for tests and the bench: `via` says it too).
        self.started = 0
        #: Streams that ended as their sandbox was removed (not journalled as lost).
        self.ended_with_sandbox = 0

    async def ready(self, sandbox: StreamSandbox) -> StreamLink | None:
        """The sandbox's running link, or one started now; None: use the engine's exec."""
        slot = self._slots.get(sandbox.id)
        if slot is not None and slot.link is not None and slot.link.broken is None:
            return slot.link  # the usual case
        if slot is None:
            if not streamed(sandbox.profile):
                return None
            slot = self._slots[sandbox.id] = StreamSlot(done=not fresh(sandbox))
            self._sandboxes[sandbox.id] = sandbox
        async with slot.lock:
            if slot.link is not None and slot.link.broken is None:
                return slot.link
            if slot.done:
                return None
            slot.done = True  # one start per sandbox (see the module doc)
            return await self._start(slot, sandbox)

    async def _start(self, slot: StreamSlot, sandbox: StreamSandbox) -> StreamLink | None:
        generation = slot.generation + 1
        t0 = trio.current_time()
        link: StreamLink | None = None
        try:
            with trio.fail_after(START_S):
                exec_id = await self._engine.exec_create(
                    sandbox.id,
                    command(self._program),
                    user=str(sandbox.who),
                    workdir="/",
                    environment=dict(sandbox.profile.env),
                    stdin=True,
                )
                stream = await self._engine.exec_start(exec_id)
                sock = trio.socket.from_stdlib_socket(stream.sock)
                secret = secrets.token_bytes(stream_agent.SECRET_BYTES)
                link = StreamLink(sandbox.id, generation, exec_id, sock, stream.initial, secret)
                key = stream_agent.encode({"op": "key", "key": secret.hex()})
                del secret
                await sock.send(key)  # a few dozen bytes into an empty stream: whole
                trio.lowlevel.spawn_system_task(_reader, link)
                await link.ready.wait()
                if link.broken is not None:
                    raise StartFailed(await self._why(exec_id, link.broken))
        except (
            StartFailed,
            trio.TooSlowError,
            Refusal,
            ContainerGone,
            EngineError,
            OSError,
        ) as exc:
            if link is not None:
                link.close("start")
            reason = _reason(exc)
            log.warning("%s: stream supervisor start failed: %s", sandbox.id[:12], reason)
            await self._note("supervisor.unavailable", sandbox, generation, reason)
            return None
        slot.generation = generation
        slot.link = link
        link.on_broken = self._on_broken
        start_ms = round((trio.current_time() - t0) * 1000, 3)
        await self._note("supervisor.started", sandbox, generation, None, start_ms=start_ms)
        return link

    async def _why(self, exec_id: str, broken: str) -> str:
        """A stream that ended before `ready`: no python3 (the engine could not start the
        program), or the program's own end."""
        try:
            info = await self._engine.exec_inspect(exec_id)
        except (ContainerGone, EngineError, Refusal):
            return broken
        if info.get("ExitCode") in NOT_STARTED:
            log.info("no python3 in the gVisor sandbox's image: commands use the engine's exec")
            return "no_python"
        return "exited" if broken == "closed" else broken

    def _on_broken(self, link: StreamLink) -> None:
        slot = self._slots.get(link.container)
        sandbox = self._sandboxes.get(link.container)
        if slot is None or slot.link is not link or sandbox is None:
            return  # detached, or replaced already
        slot.link = None
        trio.lowlevel.spawn_system_task(self._lost, slot, sandbox, link)

    async def _lost(self, slot: StreamSlot, sandbox: StreamSandbox, link: StreamLink) -> None:
        """Journal a lost stream — unless its container is going (a timeout, a kill, the
        idle reaper remove the container, then `detach` the sandbox; the stream ends as
        the container's processes are killed): that is no supervisor's loss."""
        reason = link.broken or "closed"
        if reason == "closed":
            with trio.move_on_after(REMOVAL_S):
                await slot.detached.wait()
            if slot.detached.is_set():
                self.ended_with_sandbox += 1
                return
            try:
                info = await self._engine.inspect(sandbox.id)
            except (ContainerGone, EngineError, Refusal):
                info = {}
            if not info.get("State", {}).get("Running"):
                self.ended_with_sandbox += 1
                return
        log.warning("%s: stream supervisor lost: %s", link.container[:12], reason)
        kind = "supervisor.tampered" if reason == "protocol" else "supervisor.lost"
        await self._note(kind, sandbox, link.generation, reason)

    def detach(self, container: str) -> None:
        """The sandbox is being removed: its link closes (nothing is journalled)."""
        slot = self._slots.pop(container, None)
        self._sandboxes.pop(container, None)
        if slot is not None:
            slot.detached.set()
        if slot is not None and slot.link is not None:
            link, slot.link = slot.link, None
            link.close("detached")
            self.ended_with_sandbox += 1

    async def _note(
        self,
        kind: str,
        sandbox: StreamSandbox,
        generation: int,
        reason: str | None,
        **extra: Any,
    ) -> None:
        try:
            await self._journal(kind, sandbox, generation, reason, transport="stream", **extra)
        except Exception:  # a journal failure must not end a system task (the daemon)
            log.exception("stream supervisor: journal entry %s failed", kind)


async def _reader(link: StreamLink) -> None:
    try:
        await link.run_reader()
    except Exception:  # never the daemon's end: the link is closed, its commands lost
        log.exception("%s: stream supervisor reader failed", link.container[:12])
        link.close("reader")


def _reason(exc: BaseException) -> str:
    return exc.reason if isinstance(exc, StartFailed) else reason_of(exc)
