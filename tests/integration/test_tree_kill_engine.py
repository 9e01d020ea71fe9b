"""The end-of-command kill against the real engine: a command's processes are found by the
cgroup the daemon put it in, never by anything the sandbox can set (docs/execution.md,
"Kill and reap").

A uid-1000 checkout, the shipped `default` profile (a working layer, fast exec) and the
same daemon with `fast_exec = false` (the engine's exec). Each command backgrounds
writers that forge their `SUBSTRATE_PROC` (empty, removed, another command's id) and
keep appending under /workspace; once the command has ended, no process of it is left
in the container (seen from the host), and the next command concludes normally.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from substrate.sandbox.containers import Sandbox
from substrate.sandbox.supervisor import agent
from tests.harness import wait_until_async
from tests.harness.engine import remove_daemon_containers
from tests.integration.test_fast_exec_engine import Env, open_env, text

#: A writer under /workspace; its output is not the command's (else it would hold the
#: command's pipes open: a different straggler, killed when the main process ends).
LOOP = "while :; do date >> /workspace/{name}.log; sleep 0.1; done"
QUIET = " </dev/null >/dev/null 2>&1"


def writers(*forged: str | None) -> str:
    """A script backgrounding one writer per forged marker (None: the marker removed),
    each double-forked so it is re-parented to the container's init at once."""
    parts = []
    for i, marker in enumerate(forged):
        prefix = "env -u SUBSTRATE_PROC" if marker is None else f"env SUBSTRATE_PROC={marker}"
        parts.append(f"( {prefix} sh -c '{LOOP.format(name=f'bg{i}')}'{QUIET} & )")
    return "; ".join(parts) + "; sleep 0.3; echo started"


def cmdlines(env: Env) -> list[list[str]]:
    """The command lines of every process in the sandbox but init, keep-alive,
    supervisor and held children (a running command's next one is not protected until
    that command ends: docs/fast-exec.md), read on the host."""
    found = []
    for pid in env.command_pids():
        try:
            cmdline = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if cmdline != list(agent.COMMAND):
            found.append(cmdline)
    return found


def command_cgroups(sandbox: Sandbox) -> list[str]:
    """The names of the cgroups beneath the container's own in the unified hierarchy
    (where the daemon makes one per command), read on the host; but the one a held
    child waits in, moved ahead for the next command (docs/fast-exec.md "Held
    children"): that one must hold nothing but the held child (a protected pid)."""
    lines = Path(f"/proc/{sandbox.init_pid}/cgroup").read_text().splitlines()
    (unified,) = [line[3:] for line in lines if line.startswith("0::")]
    for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        here = root / unified.lstrip("/")
        if (here / "cgroup.procs").exists():
            found = []
            for e in sorted(here.iterdir()):
                if not e.is_dir():
                    continue
                members = {int(p) for p in (e / "cgroup.procs").read_text().split()}
                if not members or not members <= sandbox.protected:
                    found.append(e.name)
            return found
    raise AssertionError("no unified cgroup hierarchy on this host")


def all_cgroups(sandbox: Sandbox) -> list[str]:
    """Every cgroup beneath the container's own in the unified hierarchy."""
    lines = Path(f"/proc/{sandbox.init_pid}/cgroup").read_text().splitlines()
    (unified,) = [line[3:] for line in lines if line.startswith("0::")]
    for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        here = root / unified.lstrip("/")
        if (here / "cgroup.procs").exists():
            return sorted(e.name for e in here.iterdir() if e.is_dir())
    raise AssertionError("no unified cgroup hierarchy on this host")


@pytest.fixture
def state(docker_client: Any, tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    yield path
    remove_daemon_containers(docker_client, path)


@pytest.fixture(params=[True, False], ids=["fast", "engine"])
async def env(
    request: pytest.FixtureRequest, sandbox_image: str, state: Path, tmp_path: Path
) -> AsyncIterator[Env]:
    async for found in open_env(state, tmp_path, fast_exec=request.param):
        yield found


async def test_forged_markers_do_not_let_a_writer_outlive_its_command(env: Env) -> None:
    first = await env.run(["true"])
    script = writers("", None, first["proc"], "p_0123456789abcdef")
    result = await env.run(["sh", "-c", script])
    assert (result["exit_code"], text(result["stdout"])) == (0, "started\n")
    assert cmdlines(env) == []  # nothing of it left, whatever its marker said
    # Its writes landed with its own conclusion: nothing held the generation.
    changes = result["changes"]
    assert "error" not in changes, changes
    assert sorted(e["path"] for e in changes["applied"]) == [f"bg{i}.log" for i in range(4)]
    # The next command concludes normally and its changes apply.
    after = await env.run(["sh", "-c", "echo next > next.txt"])
    assert "error" not in after["changes"] and after["changes"]["generation"] == 1
    assert [e["path"] for e in after["changes"]["applied"]] == ["next.txt"]
    assert (env.path / "next.txt").read_text() == "next\n"
    # Every command's cgroup is gone; the next command's, made ahead, may be empty for a
    # moment while its held child is moved in (a worker thread): it settles, a leak does not.
    await wait_until_async(
        lambda: command_cgroups(env.sandbox()) == [], 10, message="a command cgroup was left"
    )
    ids = {first["proc"], result["proc"], after["proc"]}
    assert not any(n.endswith(tuple(ids)) for n in all_cgroups(env.sandbox()))


#: Waits (boundedly) until the shell is in its own cgroup, as on the engine path the
#: daemon moves it there just after it started: its children are then born in it.
IN_OWN_CGROUP = (
    "for i in $(seq 200); do grep -q substrate-cmd- /proc/self/cgroup && break; sleep 0.01; done; "
)


async def test_a_writer_forging_a_live_commands_id_dies_with_its_own(env: Env) -> None:
    server = await env.client.call(
        "proc.start", workspace=env.ws, profile="default", argv=["sleep", "300"]
    )
    try:
        loops = [
            f"env SUBSTRATE_PROC={marker} sh -c '{LOOP.format(name=name)}'{QUIET} &"
            for name, marker in (("forged", server["proc"]), ("empty", ""))
        ]
        result = await env.run(["sh", "-c", IN_OWN_CGROUP + " ".join(loops) + " echo started"])
        assert (result["exit_code"], text(result["stdout"])) == (0, "started\n")
        assert result["changes"]["deferred"] is True  # the server still uses the generation
        assert cmdlines(env) == [["sleep", "300"]]  # only the server is left
    finally:
        await env.client.call("proc.signal", proc=server["proc"], signal="KILL")
        ended = await env.client.call("proc.wait", proc=server["proc"])
    assert ended["signal"] == "KILL"
    assert cmdlines(env) == []
    assert "error" not in ended["changes"], ended["changes"]


async def test_the_sandbox_cannot_leave_its_cgroup(env: Env) -> None:
    script = IN_OWN_CGROUP + (
        "for f in $(find /sys/fs/cgroup -name cgroup.procs 2>/dev/null); do "
        'echo $$ 2>/dev/null > "$f" && echo "moved $f"; done; '
        "for d in /sys/fs/cgroup /sys/fs/cgroup/*; do mkdir $d/x 2>/dev/null && echo made $d; done; "
        "mkdir -p /tmp/cg && mount -t cgroup2 none /tmp/cg 2>/dev/null && echo mounted; "
        "cat /proc/self/cgroup"
    )
    result = await env.run(["sh", "-c", script])
    out = text(result["stdout"])
    assert "moved" not in out and "made" not in out and "mounted" not in out, out
    assert f"/substrate-cmd-{result['proc']}\n" in out, out  # it is still in its own
