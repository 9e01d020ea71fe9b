"""The agent surface of commands against a real daemon and engine (docs/protocol.md §5,
§14), with the tiny busybox profile: streamed stdin (`proc.write`), `substrate exec`
printing live and forwarding Ctrl-C, facts as a digest and a summary unless asked in
full, and per-command usage from the cgroup.

Each test runs its own daemon (subprocess), stopped gracefully at the end; its sandboxes
are removed when it stops and by the `surface_daemon` fixture (containers labelled with
its daemon id), which also checks that no layer mount is left. No test waits
on time: each orders on what it saw (a line printed, a note on stderr).
"""

from __future__ import annotations

import base64
import hashlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import trio

from substrate.protocol.client import AsyncClient, RpcError
from tests.harness.daemon import daemon_env
from tests.harness.engine import remove_daemon_containers, sweep_mounts

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

OWNER = 1000
#: Generous bound on any one wait below: reaching it is a failure, never a pass.
LIMIT_S = 120


@pytest.fixture
def surface_daemon(
    daemon_factory: Callable[..., DaemonProcess], docker_client: Any, tiny_image: str
) -> Iterator[DaemonProcess]:
    d = daemon_factory()
    try:
        yield d
    finally:
        if d.running:
            d.stop()  # a graceful stop takes the `default` sandboxes' layer mounts down
        d.close()
        remove_daemon_containers(docker_client, d.state_dir)
        assert sweep_mounts(d.state_dir) == []  # never leave a mount behind


def piece(params: dict[str, Any]) -> bytes:
    if params.get("data") is not None:
        return str(params["data"]).encode()
    return base64.b64decode(params.get("data_b64") or "")


async def read_until(client: AsyncClient, proc: str, want: bytes) -> bytes:
    """stdout of `proc` (subscribed) until it contains `want`; fails on its exit first."""
    out = b""
    async for message in client.notifications:
        params = message["params"]
        if params.get("proc") != proc:
            continue
        assert message["method"] == "proc.output", (out, params)
        if params["stream"] == "stdout":
            out += piece(params)
            if want in out:
                return out
    raise AssertionError("connection closed")


async def exit_of(client: AsyncClient, proc: str) -> dict[str, Any]:
    async for message in client.notifications:
        if message["method"] == "proc.exit" and message["params"]["proc"] == proc:
            return dict(message["params"])
    raise AssertionError("connection closed")


# --- streamed stdin -----------------------------------------------------------------------


#: Every way a command starts: the engine's exec (tiny: no Python for a supervisor), the
#: sandbox's supervisor (default: fast exec, docs/fast-exec.md), and gVisor's stream
#: supervisor (fast-exec.md "Under gVisor").
PATHS = pytest.mark.parametrize(
    ("profile", "via"),
    [("tiny", "engine"), ("default", "supervisor"), ("gvisor", "supervisor")],
    ids=["engine", "fast", "gvisor-stream"],
)


@PATHS
async def test_stdin_streams_line_by_line_then_eof(
    surface_daemon: DaemonProcess, sandbox_image: str, profile: str, via: str
) -> None:
    d = surface_daemon
    ws = d.adopt(d.make_workspace())
    script = 'while read l; do echo "got:$l"; done; echo done'
    async with d.async_client() as c:
        with trio.fail_after(LIMIT_S):
            proc = (
                await c.call(
                    "proc.start",
                    workspace=ws,
                    profile=profile,
                    argv=["sh", "-c", script],
                    stdin="stream",
                )
            )["proc"]
            await c.call("proc.subscribe", proc=proc)
            first = await c.call("proc.write", proc=proc, data="a\n")
            assert first["accepted"] == 2 and first["eof"] is False
            # The command answers the first line while its stdin is still open.
            assert await read_until(c, proc, b"got:a\n") == b"got:a\n"
            last = await c.call("proc.write", proc=proc, data_b64="Ygo=", eof=True)  # "b\n"
            assert (last["accepted"], last["eof"]) == (2, True)
            result = await c.call("proc.wait", proc=proc)
            assert (result["exit_code"], result["via"]) == (0, via)
            assert result["stdout"]["inline"] == "got:a\ngot:b\ndone\n"
            with pytest.raises(RpcError) as caught:
                await c.call("proc.write", proc=proc, data="late\n")
            assert caught.value.refusal == "stdin_closed"
            assert caught.value.data["reason"] in ("eof", "ended")


@PATHS
async def test_megabytes_of_stdin_arrive_whole_and_in_order(
    surface_daemon: DaemonProcess, sandbox_image: str, profile: str, via: str
) -> None:
    """More than the stdin buffer, the pipe and the sockets hold: each write waits for
    room as the command reads (back-pressure), and nothing is lost or reordered."""
    d = surface_daemon
    ws = d.adopt(d.make_workspace())
    blob = hashlib.shake_256(b"substrate").digest(6 << 20)  # 6 MiB, not compressible
    async with d.async_client() as c:
        with trio.fail_after(LIMIT_S):
            proc = (
                await c.call(
                    "proc.start",
                    workspace=ws,
                    profile=profile,
                    argv=["sha256sum"],
                    stdin="stream",
                )
            )["proc"]
            step = 192 << 10
            for at in range(0, len(blob), step):
                chunk = base64.b64encode(blob[at : at + step]).decode()
                taken = await c.call("proc.write", proc=proc, data_b64=chunk)
                assert taken["buffered"] <= 1 << 20
            closed = await c.call("proc.write", proc=proc, eof=True)
            assert closed["eof"] is True
            result = await c.call("proc.wait", proc=proc)
    assert (result["exit_code"], result["via"]) == (0, via)
    assert result["stdout"]["inline"].split()[0] == hashlib.sha256(blob).hexdigest()


async def test_only_the_starter_or_the_operator_writes(surface_daemon: DaemonProcess) -> None:
    d = surface_daemon
    ws = d.adopt(d.make_workspace())
    params = {"workspace": ws, "profile": "tiny", "argv": ["cat"]}
    async with d.async_client(operator=True) as op, d.async_client() as agent:
        with trio.fail_after(LIMIT_S):
            theirs = (await op.call("proc.start", stdin="stream", **params))["proc"]
            with pytest.raises(RpcError) as caught:
                await agent.call("proc.write", proc=theirs, data="x")
            assert caught.value.refusal == "unauthorized"
            await op.call("proc.write", proc=theirs, data="from the operator\n", eof=True)
            assert (await op.call("proc.wait", proc=theirs))["stdout"]["inline"] == (
                "from the operator\n"
            )
            ours = (await agent.call("proc.start", stdin="stream", **params))["proc"]
            await op.call("proc.write", proc=ours, data="operator may\n")
            await agent.call("proc.write", proc=ours, data="starter may\n", eof=True)
            done = await agent.call("proc.wait", proc=ours)
            assert done["stdout"]["inline"] == "operator may\nstarter may\n"
            plain = (await agent.call("proc.start", stdin="text\n", **params))["proc"]
            await agent.call("proc.wait", proc=plain)
            with pytest.raises(RpcError) as caught:
                await agent.call("proc.write", proc=plain, data="x")
            assert caught.value.data == {"refusal": "stdin_closed", "reason": "ended"}
            with pytest.raises(RpcError) as caught:
                await agent.call("proc.run", stdin="stream", **params)
            assert caught.value.refusal == "invalid_params"


# --- substrate exec -----------------------------------------------------------------------


def exec_argv(d: DaemonProcess, ws: str, script: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "substrate",
        "--state-dir",
        str(d.state_dir),
        "exec",
        "--profile",
        "tiny",
        "--workspace",
        ws,
        *extra,
        "--",
        "sh",
        "-c",
        script,
    ]


@asynccontextmanager
async def child(argv: list[str], **kw: Any) -> AsyncIterator[trio.Process]:
    """A child process, killed (and waited for) if still running at the end."""
    proc = await trio.lowlevel.open_process(argv, **kw)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                await pipe.aclose()


class Lines:
    """Lines of a child's pipe, read as they come."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = b""

    async def until(self, want: bytes) -> bytes:
        while want not in self._buf:
            chunk = await self._stream.receive_some(1 << 16)
            assert chunk, f"EOF before {want!r}; got {self._buf!r}"
            self._buf += chunk
        return self._buf

    async def rest(self) -> bytes:
        while chunk := await self._stream.receive_some(1 << 16):
            self._buf += chunk
        return self._buf


async def test_exec_prints_the_first_line_before_the_command_ends(
    surface_daemon: DaemonProcess,
) -> None:
    """Ordering: the command prints a line, then blocks reading stdin; the test sends
    the line that releases it only after it saw the first one printed by the CLI."""
    d = surface_daemon
    ws = d.adopt(d.make_workspace())
    script = 'echo first; read x; echo "second $x"; echo to-err >&2; exit 3'
    with trio.fail_after(LIMIT_S):
        async with child(
            exec_argv(d, ws, script, "--stdin"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=daemon_env(),
        ) as cli:
            assert cli.stdin is not None and cli.stdout is not None and cli.stderr is not None
            out = Lines(cli.stdout)
            assert await out.until(b"first\n") == b"first\n"
            await cli.stdin.send_all(b"go\n")
            await cli.stdin.aclose()
            assert await out.rest() == b"first\nsecond go\n"
            assert b"to-err\n" in await Lines(cli.stderr).rest()
            assert await cli.wait() == 3


async def test_exec_forwards_ctrl_c_as_int_then_kill(surface_daemon: DaemonProcess) -> None:
    d = surface_daemon
    ws = d.adopt(d.make_workspace())
    traps = 'trap "echo got-int; exit 7" INT; echo ready; while :; do sleep 1; done'
    ignores = 'trap "" INT; echo ready; while :; do sleep 1; done'
    pipes = {
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "env": daemon_env(),
    }
    with trio.fail_after(LIMIT_S):
        async with child(exec_argv(d, ws, traps), **pipes) as cli:
            assert cli.stdout is not None
            out = Lines(cli.stdout)
            await out.until(b"ready\n")
            cli.send_signal(signal.SIGINT)
            assert await out.rest() == b"ready\ngot-int\n"
            assert await cli.wait() == 7
        async with child(exec_argv(d, ws, ignores), **pipes) as cli:
            assert cli.stdout is not None and cli.stderr is not None
            await Lines(cli.stdout).until(b"ready\n")
            err = Lines(cli.stderr)
            cli.send_signal(signal.SIGINT)
            await err.until(b"Ctrl-C again sends KILL")  # INT was delivered, and ignored
            assert cli.poll() is None
            cli.send_signal(signal.SIGINT)
            assert await cli.wait() == 128 + signal.SIGKILL


# --- facts and usage ----------------------------------------------------------------------


async def test_facts_come_as_a_digest_and_summary_unless_asked(
    surface_daemon: DaemonProcess,
) -> None:
    d = surface_daemon
    ws = d.adopt(d.make_workspace())
    run = {"workspace": ws, "profile": "tiny", "argv": ["true"]}
    async with d.async_client() as c:
        with trio.fail_after(LIMIT_S):
            short = await c.call("proc.run", **run)
            full = await c.call("proc.run", facts="full", **run)
            waited = await c.call("proc.wait", proc=short["proc"], facts="full")
            status = await c.call("proc.status", proc=short["proc"])
            await c.call("proc.subscribe", proc=short["proc"], facts="full")
            replayed = await exit_of(c, short["proc"])
    assert "facts" not in short and "facts" not in status
    assert short["facts_digest"] == full["facts_digest"] == status["facts_digest"]
    summary = short["facts_summary"]
    assert summary == full["facts_summary"] == status["facts_summary"]
    assert {k: summary[k] for k in ("verified", "runtime", "uid", "gid", "seccomp")} == {
        "verified": True,
        "runtime": "runc",
        "uid": OWNER,
        "gid": OWNER,
        "seccomp": "filter",
    }
    assert (summary["network"], summary["workspace"], summary["capabilities"]) == ("none", "rw", 0)
    assert summary["no_new_privs"] is True and summary["rootfs_readonly"] is True
    # The list, when asked, is the one the digest names (a client can check it).
    assert full["facts"] == waited["facts"] == replayed["facts"]
    encoded = msgspec.json.encode(full["facts"])
    assert hashlib.sha256(encoded).hexdigest() == full["facts_digest"]
    # What a model is fed: the facts were most of a `true` result.
    assert 2 * len(msgspec.json.encode(short)) < len(msgspec.json.encode(full))


async def test_usage_is_the_commands_cpu_and_peak_memory(surface_daemon: DaemonProcess) -> None:
    d = surface_daemon
    ws = d.adopt(d.make_workspace())
    call = {"workspace": ws, "profile": "tiny"}
    spin = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"
    fill = "head -c 67108864 /dev/zero > /tmp/big && rm /tmp/big"  # 64 MiB of tmpfs
    async with d.async_client() as c:
        with trio.fail_after(LIMIT_S):
            idle = await c.call("proc.run", argv=["sleep", "0.2"], **call)
            busy = await c.call("proc.run", argv=["sh", "-c", spin], **call)
            big = await c.call("proc.run", argv=["sh", "-c", fill], **call)
            small = await c.call("proc.run", argv=["true"], **call)
            again = await c.call("proc.wait", proc=big["proc"])
            status = await c.call("proc.status", proc=big["proc"])
            other = (await c.call("proc.start", argv=["sleep", "300"], **call))["proc"]
            shared = await c.call("proc.run", argv=["true"], **call)
            await c.call("proc.signal", proc=other, signal="KILL")
            await c.call("proc.wait", proc=other)
    for result in (idle, busy, big, small):
        assert result["usage"]["exclusive"] is True, result["usage"]
    assert shared["usage"]["exclusive"] is False
    assert busy["usage"]["cpu_s"] > idle["usage"]["cpu_s"]
    assert again["usage"] == status["usage"] == big["usage"]  # kept in the record
    source = big["usage"]["source"]
    v2 = await trio.Path("/sys/fs/cgroup/cgroup.controllers").exists()
    assert source == ("cgroup-v2" if v2 else "cgroup-v1")
    if big["usage"]["peak_memory_bytes"] is None:
        # Documented: cgroup v2 before Linux 6.12 cannot scope a peak to one command.
        assert source == "cgroup-v2"
        return
    assert big["usage"]["peak_memory_bytes"] >= 64 << 20
    # Reset at each command's start: the next one's peak does not carry the 64 MiB.
    assert small["usage"]["peak_memory_bytes"] < 32 << 20
