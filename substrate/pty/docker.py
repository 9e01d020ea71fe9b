"""The real terminal backend: a TTY exec in the workspace's confined sandbox container.

A session's shell runs exactly like a command of `proc.run` (docs/protocol.md §5): in the sandbox
that `Containers.ensure` created and verified from the kernel for (workspace, profile),
as the sandbox's uid:gid, in `/workspace`, with the profile's environment (plus
`TERM=xterm-256color` when the profile sets no `TERM`), in a cgroup of its own
(`sandbox.cmd_cgroups`: the shell is moved there as soon as the engine names it, before
a person can type), so that ending the session ends every process it started. The shell is the profile's
`env.SHELL`, else `/bin/sh`; it must pass the profile's `argv_allow`.

The engine's hijacked exec socket is raw with a TTY (not multiplexed); it is driven
directly by Trio (non-blocking), so a session costs no worker thread while idle. Resizes
go to `exec_resize`; the exit code comes from `exec_inspect` once the stream ends.

On a `workspace = "layer"` profile the session is a user of the sandbox's generation like
a command (`substrate.layer.LayerUsers`), from before its exec to its end: what the shell
changes is applied through the guarded path (mode "apply", as `terminal:<grant>`) when
the generation concludes — when the session ends if nothing else uses it then, else with
the last command's. `terminate` records the summary in `ended["changes"]` for `pty.closed`
(docs/terminals.md).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from substrate.errors import GrantInvalid, RuntimeUnavailable
from substrate.layer import LayerClosed, LayerUsers, Use, journal_summary
from substrate.process.argv import exec_env, validate_argv, workdir_for
from substrate.process.processes import RunRequest
from substrate.sandbox import cmd_cgroups, reaper
from substrate.sandbox.cmd_cgroups import CommandCgroup
from substrate.sandbox.engine import ContainerGone, Engine, ExecStream
from substrate.sandbox.profiles import Profile

if TYPE_CHECKING:
    from substrate.process.service import Execution
    from substrate.sandbox.containers import Containers, Sandbox
    from substrate.workspace.registry import Workspace

log = logging.getLogger("substrate.pty")

#: Seconds between TERM and KILL when a session ends with processes left.
GRACE_S = 2.0
DEFAULT_SHELL = "/bin/sh"
DEFAULT_TERM = "xterm-256color"
#: How long a session's start waits for the engine to name the shell's process.
ENCLOSE_S = 5.0


def shell_argv(profile: Profile) -> list[str]:
    """The session's argv: the profile's `SHELL`, else /bin/sh (checked by `argv_allow`)."""
    argv = [profile.env.get("SHELL", DEFAULT_SHELL)]
    validate_argv(argv, profile.argv_allow)
    return argv


class DockerPty:
    """One TTY exec. Owns a use of the sandbox (released by `terminate`)."""

    def __init__(
        self,
        engine: Engine,
        containers: Containers,
        sandbox: Sandbox,
        exec_id: str,
        stream: ExecStream,
        marker: str,
        info: dict[str, Any],
        layer: tuple[LayerUsers[Sandbox], Use[Sandbox]] | None = None,
        cgroup: CommandCgroup | None = None,
    ) -> None:
        self.info = info
        self.ended: dict[str, Any] = {}
        self._layer = layer  # its hold on a layer sandbox's generation
        self._engine = engine
        self._containers = containers
        self._sandbox = sandbox
        self._exec = exec_id
        self._marker = marker
        self._cgroup = cgroup
        # Output that arrived together with the engine's response head.
        self._initial = stream.initial
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(stream.sock))
        self._send_lock = trio.Lock()
        self._released = False
        self._code: int | None = None

    async def read(self, max_bytes: int) -> bytes:
        if self._initial:
            data, self._initial = self._initial[:max_bytes], self._initial[max_bytes:]
            await trio.lowlevel.checkpoint()
            return data
        try:
            return bytes(await self._stream.receive_some(max_bytes))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def write(self, data: bytes) -> None:
        async with self._send_lock:
            # A broken stream means the process is gone; the pump sees the end.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._stream.send_all(data)

    async def resize(self, cols: int, rows: int) -> None:
        with contextlib.suppress(ContainerGone):
            await self._engine.exec_resize(self._exec, rows=rows, cols=cols)

    async def wait(self) -> int:
        if self._code is not None:
            return self._code
        # The engine records the exit code as the stream closes; allow it a moment.
        for delay in (0, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0):
            await trio.sleep(delay)
            try:
                found = await self._engine.exec_inspect(self._exec)
            except ContainerGone:
                break
            if not found.get("Running") and found.get("ExitCode") is not None:
                self._code = int(found["ExitCode"])
                return self._code
        self._code = -1
        return self._code

    async def terminate(self) -> None:
        if self._released:
            return
        self._released = True
        sandbox = self._sandbox
        try:
            if sandbox.host_visible:
                await reaper.terminate(
                    sandbox.cgroups,
                    self._marker,
                    sandbox.protected,
                    alone=sandbox.running <= 1,
                    grace_s=GRACE_S,
                )
                if self._cgroup is not None:
                    with trio.CancelScope(shield=True):
                        await cmd_cgroups.close(self._cgroup)
            elif sandbox.running <= 1:
                # Under gVisor its processes are not host processes: stop the sandbox
                # (the next command gets a fresh, verified one).
                await self._containers.forget(sandbox, "terminal_closed")
        finally:
            if self._layer is not None:
                # Its processes are gone: the generation may conclude (never cut short).
                users, use = self._layer
                with trio.CancelScope(shield=True):
                    changes = await users.end(use)
                if changes is not None:
                    self.ended["changes"] = journal_summary(changes)
            sandbox.release()
            await self._stream.aclose()


async def _enclose(engine: Engine, exec_id: str, cgroup: CommandCgroup, sandbox: Sandbox) -> None:
    """Move the shell into its cgroup once the engine names its process (a few ms: the
    engine reports the pid once runc started it). Bounded: at most `ENCLOSE_S`."""
    with trio.move_on_after(ENCLOSE_S):
        delay = 0.002
        while True:
            found = await engine.exec_inspect(exec_id)
            pid = int(found.get("Pid") or 0)
            if found.get("Running") and pid > 0:
                await trio.to_thread.run_sync(
                    cmd_cgroups.enclose, cgroup, pid, reaper.cgroup_pids(sandbox.cgroups)
                )
                return
            if not found.get("Running") and found.get("ExitCode") is not None:
                return
            await trio.sleep(delay)
            delay = min(delay * 2, 0.2)


class DockerPtys:
    """The `PtySpawner` of the daemon: sessions in verified sandboxes."""

    def __init__(self, execution: Execution, workspace: Callable[[str], Workspace]) -> None:
        self._execution = execution
        self._workspace = workspace

    async def __call__(
        self, *, workspace: str, profile: str, cols: int, rows: int, session: str, actor: str
    ) -> DockerPty:
        """Start the shell. Refuses `unknown_workspace`, `profile_unknown`, `grant_invalid`
        (profile no longer interactive), `draining`, `argv_denied`, `confinement_unmet`,
        `image_missing`, `runtime_unavailable`, like any command. Costs a container start
        and a fact check when the sandbox is cold, else three engine calls. On a layer
        profile it joins the generation first: it waits while one concludes."""
        execution = self._execution
        execution.processes.refuse_if_draining()
        ws = self._workspace(workspace)
        prof: Profile = execution.profile(profile)
        if not prof.interactive:
            raise GrantInvalid(f"profile {profile!r} is not interactive", profile=profile)
        argv = shell_argv(prof)
        containers: Containers = execution.containers
        engine: Engine = execution.engine
        users: LayerUsers[Sandbox] = execution.processes.layer_users
        req = RunRequest(ws=ws, profile=prof.name, argv=tuple(argv), actor=actor)
        marker = "t_" + secrets.token_hex(8)
        for attempt in (1, 2):
            sandbox = await containers.ensure(ws, prof)
            sandbox.acquire()
            use = None
            cgroup: CommandCgroup | None = None
            try:
                if sandbox.layer is not None:  # the session shares the generation
                    use = await users.join(sandbox, session, req)
                # The sandbox's profile: with the secrets' values (never the loaded one's).
                env = {"TERM": DEFAULT_TERM, **exec_env(sandbox.profile, marker)}
                exec_id = await engine.exec_create(
                    sandbox.id,
                    argv,
                    user=str(sandbox.who),
                    workdir=workdir_for(prof, "."),
                    environment=env,
                    stdin=True,
                    tty=True,
                )
                if sandbox.host_visible:
                    cgroup = cmd_cgroups.make(sandbox.cgroups, marker)
                stream = await engine.exec_start(exec_id, tty=True)
                if cgroup is not None:
                    await _enclose(engine, exec_id, cgroup, sandbox)
            except (ContainerGone, LayerClosed):
                if cgroup is not None:
                    cmd_cgroups.remove(cgroup)
                if use is not None:
                    await users.abandon(use)
                sandbox.release()
                await containers.forget(sandbox, "gone")
                if attempt == 2:
                    raise RuntimeUnavailable("the sandbox container keeps disappearing") from None
                continue
            except BaseException:
                if cgroup is not None:
                    cmd_cgroups.remove(cgroup)
                if use is not None:
                    await users.abandon(use)
                sandbox.release()
                raise
            pty = DockerPty(
                engine,
                containers,
                sandbox,
                exec_id,
                stream,
                marker,
                {
                    "container": sandbox.id[:12],
                    "exec": exec_id[:12],
                    "user": str(sandbox.who),
                    "argv": argv,
                    "runtime": prof.runtime,
                },
                None if use is None else (users, use),
                cgroup,
            )
            try:
                await pty.resize(cols, rows)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await pty.terminate()
                raise
            return pty
        raise AssertionError("unreachable")
