"""The stream supervisor of a gVisor sandbox against the real engine (runsc).

docs/fast-exec.md "Under gVisor": a runsc sandbox's commands go through a supervisor
speaking over its engine exec's attach stream. A daemon runs in-process (the shipped
profiles, and `gvisor-engine`: `gvisor` with the stream off, `fast_exec = false` is
daemon-wide, so the engine's path is a second daemon's). The same commands on both paths
must give the same exit codes and bytes.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from substrate.config import PROJECT_ROOT
from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, open_client
from substrate.sandbox.supervisor.stream_supervisors import Streams
from tests.harness import wait_until_async
from tests.harness.engine import remove_daemon_containers
from tests.harness.inprocess import in_process_config, serving

OWNER = 1000
GVISOR = "gvisor"


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str

    async def run(self, argv: list[str], **params: Any) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile=GVISOR, argv=argv, **params
        )

    @property
    def streams(self) -> Streams:
        supervisors = self.daemon.execution.supervisors
        assert supervisors is not None
        return supervisors.streams

    def journal(self, *kinds: str) -> list[dict[str, Any]]:
        return [e.data for e in self.daemon.journal.read(limit=100000) if e.kind in kinds]


def output(ref: dict[str, Any]) -> bytes:
    if ref.get("encoding") == "utf-8":
        return str(ref["inline"]).encode()
    if ref.get("encoding") == "base64":
        return base64.b64decode(ref["inline"])
    return b""


async def open_env(state: Path, tmp_path: Path, name: str, **config: Any) -> AsyncIterator[Env]:
    profiles = tmp_path / f"profiles-{name}"
    profiles.mkdir(exist_ok=True)
    for shipped in (PROJECT_ROOT / "profiles").glob("*.toml"):
        shutil.copy(shipped, profiles / shipped.name)
    project = tmp_path / f"roots-{name}" / "project"
    (project / ".git").mkdir(parents=True, exist_ok=True)
    for path in (project, project / ".git", project.parent):
        os.chown(path, OWNER, OWNER)
    cfg = in_process_config(state, project.parent, profiles, listen="127.0.0.1:0", **config)
    async with serving(cfg) as daemon, open_client(state / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(project))
        yield Env(daemon, client, ws["workspace"])


@pytest.fixture
def states(docker_client: Any, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    paths = (tmp_path / "state-stream", tmp_path / "state-engine")
    for path in paths:
        path.mkdir(mode=0o700)
    yield paths
    for path in paths:
        remove_daemon_containers(docker_client, path)


@pytest.fixture
async def env(sandbox_image: str, states: tuple[Path, Path], tmp_path: Path) -> AsyncIterator[Env]:
    async for found in open_env(states[0], tmp_path, "stream"):
        yield found


def summary(result: dict[str, Any]) -> tuple[Any, ...]:
    return (
        result["exit_code"],
        result.get("signal"),
        output(result["stdout"]),
        output(result["stderr"]),
        result["stdout"]["bytes"],
        result["stdout"]["sha256"],
        result["stdout"]["truncated"],
    )


#: Commands run on both paths: (argv, params).
SAME = [
    (["true"], {}),
    (["sh", "-c", "echo out; echo err >&2; exit 3"], {}),
    (["no-such-program"], {}),
    (["/no/such/path"], {}),
    (["/etc/hostname"], {}),  # not executable: 126
    (["sh", "-c", "kill -9 $$"], {}),
    (["sh", "-c", "kill -TERM $$"], {}),
    (["cat"], {"stdin": base64.b64encode(b"in\x00put" * 1000).decode()}),
    (["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x"], {}),
    (["sh", "-c", "pwd; id -u"], {"cwd": "."}),
    (["sh", "-c", "sleep 0.2 & echo bg"], {}),
    (["ls", "/proc/self/fd"], {}),  # no descriptor of the supervisor's
    (["sh", "-c", "trap -p; ps -o pgid=,sid= -p $$ | wc -w"], {}),  # default signals, own group
]


async def test_same_answers_as_the_engine_path(
    sandbox_image: str, states: tuple[Path, Path], tmp_path: Path
) -> None:
    stream_results, engine_results = [], []
    async for env in open_env(states[0], tmp_path, "stream"):
        for argv, params in SAME:
            result = await env.run(argv, **params)
            assert result["via"] == "supervisor", (argv, result)
            assert "exec_facts" not in result or not result["exec_facts"]
            stream_results.append(summary(result))
        assert env.streams.started == len(SAME)
    async for env in open_env(states[1], tmp_path, "engine", fast_exec=False):
        for argv, params in SAME:
            result = await env.run(argv, **params)
            assert result["via"] == "engine"
            engine_results.append(summary(result))
    for (argv, _), ours, theirs in zip(SAME, stream_results, engine_results, strict=True):
        assert ours == theirs, argv
    assert stream_results[2][0] == 127 and b"command not found" in stream_results[2][3]
    assert stream_results[5][:2] == (137, "KILL")


async def test_big_output_is_spooled_whole(env: Env) -> None:
    size = 200 << 20
    result = await env.run(["head", "-c", str(size), "/dev/zero"])
    assert result["via"] == "supervisor"
    assert (result["exit_code"], result["stdout"]["bytes"]) == (0, size)
    assert result["stdout"]["sha256"] == hashlib.sha256(bytes(size)).hexdigest()


async def at_once(env: Env, argvs: list[list[str]]) -> list[Any]:
    """`argvs` run concurrently; their results, in order."""
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        results[i] = await env.run(argvs[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(argvs)):
            nursery.start_soon(one, i)
    return [results[i] for i in range(len(argvs))]


async def test_concurrent_commands_on_one_stream(env: Env) -> None:
    await env.run(["true"])  # the stream is up
    argvs = [["sh", "-c", f"sleep 0.{i % 3}; echo {i}; exit {i}"] for i in range(8)]
    for i, result in enumerate(await at_once(env, argvs)):
        assert (result["via"], result["exit_code"], output(result["stdout"])) == (
            "supervisor",
            i,
            f"{i}\n".encode(),
        )
    assert len(env.journal("supervisor.started")) == 1


async def test_concurrent_first_commands_share_one_stream(env: Env) -> None:
    """The sandbox's first commands at once: none has run code there yet, so the one
    stream starts and every one of them takes it."""
    argvs = [["sh", "-c", f"echo {i}"] for i in range(4)]
    for i, result in enumerate(await at_once(env, argvs)):
        assert (result["via"], output(result["stdout"])) == ("supervisor", f"{i}\n".encode())
    assert len(env.journal("supervisor.started")) == 1


async def test_a_timeout_kills_the_command(env: Env) -> None:
    stuck = await env.run(["sh", "-c", "trap '' TERM; sleep 1000"], timeout_s=1)
    assert (stuck["via"], stuck["timed_out"], stuck["exit_code"]) == ("supervisor", True, 137)
    after = await env.run(["echo", "fresh"])  # a new sandbox, and its own stream
    assert (after["via"], output(after["stdout"])) == ("supervisor", b"fresh\n")
    assert len(env.journal("supervisor.started")) == 2
    # The first stream ended as its sandbox was removed: no supervisor's loss.
    await wait_until_async(lambda: env.streams.ended_with_sandbox == 1, 30)
    assert env.journal("supervisor.lost", "supervisor.tampered") == []


async def test_term_and_int_reach_only_their_command(env: Env) -> None:
    """INT and TERM go to the command's process group through the stream: a command that
    traps them handles them, and a second command in the same sandbox runs on."""
    await env.run(["true"])  # the stream is up
    trapping = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile=GVISOR,
        argv=["sh", "-c", "trap 'echo int; exit 7' INT; while :; do sleep 0.05; done"],
    )
    bystander = await env.client.call(
        "proc.start", workspace=env.ws, profile=GVISOR, argv=["sleep", "1000"]
    )
    await trio.sleep(0.5)  # the trap is set
    sent = await env.client.call("proc.signal", proc=trapping["proc"], signal="INT")
    assert sent["delivered"] == 1
    ended = await env.client.call("proc.wait", proc=trapping["proc"], timeout_s=30)
    assert (ended["exit_code"], output(ended["stdout"])) == (7, b"int\n")
    status = await env.client.call("proc.status", proc=bystander["proc"])
    assert status["state"] == "running"
    sent = await env.client.call("proc.signal", proc=bystander["proc"], signal="TERM")
    assert sent["delivered"] == 1
    ended = await env.client.call("proc.wait", proc=bystander["proc"], timeout_s=30)
    assert (ended["exit_code"], ended["signal"]) == (143, "TERM")
    # Both on the one stream, in the one sandbox: nothing was removed.
    after = await env.run(["echo", "same"])
    assert (after["via"], output(after["stdout"])) == ("supervisor", b"same\n")
    assert len(env.journal("supervisor.started")) == 1
    # A signal for a command that ended reaches nothing.
    gone = await env.client.call("proc.signal", proc=trapping["proc"], signal="TERM")
    assert gone["delivered"] == 0


#: The supervisor's command line begins so (`stream_supervisors.command`).
SUPERVISOR = "^/usr/bin/python3 -I -S -B -c"


async def test_a_killed_supervisor_leaves_the_engine_path(env: Env) -> None:
    first = await env.run(["true"])
    assert first["via"] == "supervisor"
    # From inside, as the same uid: the command that kills it runs on it, so its own
    # exit is reported just before the stream ends, or lost with it.
    killed = await env.run(["pkill", "-9", "-f", SUPERVISOR])
    assert killed["via"] == "supervisor"
    assert killed["exit_code"] in (0, None)
    await wait_until_async(lambda: bool(env.journal("supervisor.lost")), 30)
    after = await env.run(["sh", "-c", "echo again; exit 4"])
    assert (after["via"], after["exit_code"], output(after["stdout"])) == ("engine", 4, b"again\n")
    [started] = env.journal("supervisor.started")
    assert (started["generation"], started["transport"]) == (1, "stream")
    [lost] = env.journal("supervisor.lost")
    assert (lost["reason"], lost["transport"]) == ("closed", "stream")


async def test_a_forged_frame_breaks_the_stream(env: Env) -> None:
    """A process of the supervisor's uid can open its stdout under runsc: what it writes
    there is not tagged with the start's key, and the link breaks (`supervisor.tampered`)
    instead of reporting the forged exit."""
    await env.run(["true"])
    forge = (
        "import os, struct\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        cmd = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        "    if cmd[:5] == [b'/usr/bin/python3', b'-I', b'-S', b'-B', b'-c']:\n"
        '        body = b\'{"op":"exited","id":"x","code":0}\'\n'
        "        fd = os.open(f'/proc/{pid}/fd/1', os.O_WRONLY)\n"
        "        os.write(fd, struct.pack('>II', len(body), 0) + bytes(16) + body)\n"
        "        print('forged')\n"
    )
    forged = await env.run(["python3", "-c", forge])
    assert forged["via"] == "supervisor"
    await wait_until_async(lambda: bool(env.journal("supervisor.tampered")), 30)
    [tampered] = env.journal("supervisor.tampered")
    assert tampered["reason"] == "protocol"
    after = await env.run(["sh", "-c", "echo after; exit 5"])
    assert (after["via"], after["exit_code"], output(after["stdout"])) == ("engine", 5, b"after\n")


async def test_the_supervisor_memory_is_not_readable(env: Env) -> None:
    """Non-dumpable under runsc: a process of its uid cannot read its memory (where the
    start's secret is), though it can open its stdio (hence the tags)."""
    await env.run(["true"])
    probe = (
        "import os\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        cmd = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        "    if cmd[:5] == [b'/usr/bin/python3', b'-I', b'-S', b'-B', b'-c']:\n"
        "        try:\n"
        "            open(f'/proc/{pid}/mem', 'rb').read(1)\n"
        "            print('read')\n"
        "        except OSError as e:\n"
        "            print('refused', e.errno)\n"
    )
    result = await env.run(["python3", "-c", probe])
    assert (result["exit_code"], output(result["stdout"])) == (0, b"refused 13\n")
