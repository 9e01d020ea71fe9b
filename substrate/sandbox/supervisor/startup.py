"""The start of one supervisor (docs/fast-exec.md "How a command runs", step 2).

`start_program` is one start, from the engine's exec to the authenticated control
connection: the program (`agent.COMMAND`) is exec'd as the sandbox's uid:gid with the
profile's environment; its `ready` is read from the engine's multiplexed stream
(`read_ready`) once it is non-dumpable; then its host pid is read from the engine (one
call: it runs) and a pidfd opened on it (whatever fails after the exec started, the
process is killed: `_kill_exec` before the pid is known, its pidfd after); it is checked
from the host (`checks.supervisor_start_problem`); only then is the start's secret (32
random bytes) written on its stdin, and the one connection on the sandbox's socket whose
peer credentials name that process and whose `hello` carries the secret's MAC is
accepted (`accept_hello`; anyone else connecting is closed). A start that does not
complete raises `StartFailed` with its journal word (`reason_of` names the others).
`supervisors.Supervisors._start` bounds it, keeps the result and journals it.

A warm pool member's supervisor is started the same way while the member waits
(`Supervisors.prestart`), against what its init shows then (`checks.unverified_baseline`:
nothing is verified yet), as the uid:gid the member's container runs as. Once the member
is verified for a workspace, `warm_problem` checks that supervisor again, from the host,
against the workspace's verified baseline before anything runs on it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import signal
import socket
import struct
from typing import Any

import trio

from substrate.errors import Refusal
from substrate.sandbox.engine import ContainerGone, Engine, EngineError
from substrate.sandbox.spec import RunAs
from substrate.sandbox.supervisor import agent, checks
from substrate.sandbox.supervisor.link import Link, LinkBroken, receive

log = logging.getLogger("substrate.sandbox.supervisor")


#: Seconds a failed start may take to find and kill its process.
KILL_S = 5.0


class StartFailed(Exception):
    """A start that did not complete; `reason` is its journal word."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def start_program(
    engine: Engine,
    container: str,
    who: RunAs,
    environment: dict[str, str],
    base: checks.Baseline,
    accepting: trio.socket.SocketType,
) -> tuple[int, int, trio.socket.SocketType]:
    """Start the program in `container` through the engine; (host pid, pidfd, control
    connection). Raises `StartFailed`, and what the engine's exec raises.

    `ready` is read before the pid is asked for: by then the exec runs, so one
    `exec_inspect` finds it (polling the engine while the exec was still being set up
    cost several calls per start, under load most of them). Whatever fails after the
    exec started, the process is killed: through a pidfd on the pid the engine gives."""
    exec_id = await engine.exec_create(
        container,
        list(agent.COMMAND),
        user=str(who),
        workdir="/",
        environment=environment,
        stdin=True,
    )
    stream = await engine.exec_start(exec_id)
    sock = trio.socket.from_stdlib_socket(stream.sock)
    pidfd = -1
    try:
        try:
            await read_ready(sock, stream.initial)
        except BaseException:
            await _kill_exec(engine, exec_id)
            raise
        pid = await exec_pid(engine, exec_id)
        pidfd = os.pidfd_open(pid)
        try:
            reading = checks.read_process(pid)
        except ProcessLookupError:
            raise StartFailed("exited") from None
        problem = checks.supervisor_start_problem(reading, base, who.uid)
        if problem is not None:
            raise StartFailed(problem)
        secret = secrets.token_bytes(32)
        await sock.send(secret.hex().encode() + b"\n")
        control = await accept_hello(accepting, pid, secret)
        return pid, pidfd, control
    except BaseException:
        if pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        raise
    finally:
        sock.close()


async def _kill_exec(engine: Engine, exec_id: str) -> None:
    """A start that failed before its pid was asked for: kill the process if it runs
    (shielded, bounded by `KILL_S`: a cancelled start is cleaned up too)."""
    with trio.CancelScope(shield=True), trio.move_on_after(KILL_S):
        try:
            pidfd = os.pidfd_open(await exec_pid(engine, exec_id))
        except (StartFailed, Refusal, ContainerGone, EngineError, OSError):
            return  # it exited, or the engine cannot say: nothing to kill
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)


async def exec_pid(engine: Engine, exec_id: str) -> int:
    """The host pid of a running exec (asked again, backing off, until it runs)."""
    delay = 0.002
    while True:
        info = await engine.exec_inspect(exec_id)
        pid = int(info.get("Pid") or 0)
        if info.get("Running") and pid > 0:
            return pid
        if not info.get("Running") and info.get("ExitCode") is not None:
            raise StartFailed("exited")
        await trio.sleep(delay)
        delay = min(delay * 2, 0.2)


async def read_ready(sock: trio.socket.SocketType, initial: bytes) -> None:
    """Read the engine's multiplexed stream until the program wrote `ready` on stdout."""
    buf, out = bytearray(initial), bytearray()
    while b"\n" not in out:
        while len(buf) >= 8:
            kind, length = struct.unpack(">BxxxI", buf[:8])
            if len(buf) < 8 + length:
                break
            if kind == 1:
                out += buf[8 : 8 + length]
            del buf[: 8 + length]
        if b"\n" in out:
            break
        if len(out) > 256 or len(buf) > 1 << 16:
            raise StartFailed("protocol")
        chunk = await sock.recv(4096)
        if not chunk:
            raise StartFailed("exited")
        buf += chunk
    if out.split(b"\n", 1)[0] != b"ready":
        raise StartFailed("protocol")


async def accept_hello(
    accepting: trio.socket.SocketType, pid: int, secret: bytes
) -> trio.socket.SocketType:
    """The connection from process `pid` that proves the secret; others are closed."""
    while True:
        conn, _ = await accepting.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer = struct.unpack("3i", creds)[0]
        if peer != pid:
            log.warning("supervisor socket: a connection from another process was closed")
            conn.close()
            continue
        decoder = agent.Decoder(agent.MAX_REPORT)
        pending: list[dict[str, Any]] = []
        try:
            hello = await receive(conn, decoder, pending)
        except (OSError, LinkBroken, trio.ClosedResourceError):
            conn.close()
            raise StartFailed("hello") from None
        mac = str(hello.get("mac", ""))
        if (
            hello.get("op") != "hello"
            or hello.get("v") != agent.VERSION
            or not hmac.compare_digest(mac, agent.hello_mac(secret))
        ):
            conn.close()
            raise StartFailed("hello")
        return conn


def warm_problem(link: Link, base: checks.Baseline, uid: int) -> str | None:
    """Why a supervisor started before its sandbox was verified cannot serve it, or None
    (blocking but tiny: a signal to its pidfd, three procfs reads). Checked as a start is
    (`checks.supervisor_start_problem`: not traced, stopped or dumpable; the status
    facts, cgroups and namespaces of `base`, the verified sandbox's), and its uid must be
    `uid`, the one the workspace's commands run as: "uid" else."""
    if link.uid != uid:
        return "uid"
    problem = link.problem()
    if problem is not None:
        return problem
    try:
        reading = checks.read_process(link.pid)
        signal.pidfd_send_signal(link.pidfd, 0)  # still it: the reading was its own
    except ProcessLookupError:
        return "exited"
    return checks.supervisor_start_problem(reading, base, uid)


def reason_of(exc: BaseException) -> str:
    """The journal word of an exception that ended a start (`supervisor.unavailable`)."""
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    if isinstance(exc, trio.ClosedResourceError):
        return "closed"
    if isinstance(exc, ContainerGone):
        return "container_gone"
    if isinstance(exc, Refusal):
        return exc.name
    if isinstance(exc, OSError):
        return "os_error"
    return "engine_error"
