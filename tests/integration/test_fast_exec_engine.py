"""Fast exec against the real engine: each sandbox's own supervisor (docs/fast-exec.md).

A daemon runs in-process (its own state dir and adopt root, the shipped profiles plus
`gated`, the default profile on a workspace with `write_deny = ["*.lock"]`) and runs
commands under `default` (substrate-sandbox:bookworm, which has python3: the fast path)
and `tiny` (busybox, no python3: the engine's exec). The supervisor-loss tests kill or
stop the supervisor from inside the sandbox, as the sandbox's own uid (the supervisor
runs as that uid: docs/fast-exec.md says why). The last test kills a real daemon process
with SIGKILL while a command runs on the fast path.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import shutil
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import trio

from substrate.config import PROJECT_ROOT
from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, open_client
from substrate.sandbox import reaper
from substrate.sandbox.containers import LABEL_DAEMON, Sandbox, daemon_id_for
from substrate.sandbox.supervisor import agent
from tests.harness import wait_until, wait_until_async
from tests.harness.engine import remove_daemon_containers
from tests.harness.inprocess import in_process_config, serving

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

OWNER = 1000
#: `pkill -f` pattern of the supervisor's command line (it is unique in a sandbox).
SUPERVISOR = "^" + " ".join(agent.COMMAND)


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str
    path: Path
    state: Path

    async def run(self, argv: list[str], profile: str = "default", **params: Any) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=argv, **params
        )

    def sandbox(self, profile: str = "default") -> Sandbox:
        found = self.daemon.execution.containers.cached(self.ws, profile)
        assert found is not None
        return found

    def journal(self, *kinds: str) -> list[dict[str, Any]]:
        return [e.data for e in self.daemon.journal.read(limit=100000) if e.kind in kinds]

    def command_pids(self, profile: str = "default") -> list[int]:
        """Host pids in the sandbox other than init, keep-alive and supervisor."""
        sandbox = self.sandbox(profile)
        return [p for p in reaper.cgroup_pids(sandbox.cgroups) if p not in sandbox.protected]


def supervisor_pids(sandbox: Sandbox) -> set[int]:
    """The protected pids that are a supervisor (by command line; not a held child, which
    has the same command line and a supervisor for its parent)."""
    found = set()
    for pid in sandbox.protected:
        try:
            proc = psutil.Process(pid)
            parent = proc.parent()
            if proc.cmdline() == list(agent.COMMAND) and (
                parent is None or parent.cmdline() != list(agent.COMMAND)
            ):
                found.add(pid)
        except psutil.Error:
            continue
    return found


def text(ref: dict[str, Any]) -> str:
    assert ref["encoding"] == "utf-8", ref
    value: str = ref["inline"]
    return value


def facts_of(result: dict[str, Any]) -> dict[str, Any]:
    return {f["name"]: f["value"] for f in result.get("exec_facts", [])}


@pytest.fixture
def state(docker_client: Any, tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    yield path
    remove_daemon_containers(docker_client, path)


async def open_env(state: Path, tmp_path: Path, **config: Any) -> AsyncIterator[Env]:
    profiles = tmp_path / "profiles"
    profiles.mkdir(exist_ok=True)
    for shipped in (PROJECT_ROOT / "profiles").glob("*.toml"):
        shutil.copy(shipped, profiles / shipped.name)
    # `default` with the plain bind: the reactive write gate on the fast path.
    default = (profiles / "default.toml").read_text()
    assert 'workspace = "layer"' in default
    (profiles / "plain-rw.toml").write_text(
        default.replace('workspace = "layer"', 'workspace = "rw"')
    )
    root = tmp_path / "roots"
    project = root / "project"
    (project / ".git").mkdir(parents=True, exist_ok=True)
    (project / "sub").mkdir(exist_ok=True)
    for path in (project, project / ".git", project / "sub"):
        os.chown(path, OWNER, OWNER)
    cfg = in_process_config(state, root, profiles, listen="127.0.0.1:0", **config)
    async with serving(cfg) as daemon, open_client(state / "substrate.sock") as client:
        ws = await client.call(
            "workspace.adopt", path=str(project), policy={"write_deny": ["*.lock"]}
        )
        yield Env(daemon, client, ws["workspace"], project, state)


@pytest.fixture
async def env(sandbox_image: str, state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    async for found in open_env(state, tmp_path):
        yield found


@pytest.fixture
async def engine_env(sandbox_image: str, state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    async for found in open_env(state, tmp_path, fast_exec=False):
        yield found


# --- the path and the per-command facts ---------------------------------------------------


async def test_fast_path_is_the_default_and_results_carry_the_commands_facts(env: Env) -> None:
    result = await env.run(["id", "-u"], facts="full")
    assert result["via"] == "supervisor"
    assert (result["exit_code"], text(result["stdout"])) == (0, f"{OWNER}\n")
    own = facts_of(result)
    sandbox = {f["name"]: f["value"] for f in result["facts"]}
    for name in ("no_new_privs", "seccomp_mode", "cap_eff", "cap_prm", "cap_bnd", "cap_amb"):
        assert own[name] == sandbox[name], name
    assert (own["no_new_privs"], own["seccomp_mode"], own["cap_eff"]) == (True, 2, [])
    assert (own["uid"], own["gid"]) == (OWNER, OWNER)
    assert (own["parent"], own["cgroup"], own["namespaces"]) == ("supervisor", "sandbox", "sandbox")
    sources = {f["source"] for f in result["exec_facts"]}
    assert sources == {"kernel:proc-status", "kernel:proc-cgroup", "kernel:proc-ns"}

    # The record keeps them: the same answer later.
    again = await env.client.call("proc.wait", proc=result["proc"], facts="full")
    assert again["via"] == "supervisor" and again["exec_facts"] == result["exec_facts"]
    # Unless asked, a reply says only that they were observed.
    short = await env.client.call("proc.wait", proc=result["proc"])
    assert "exec_facts" not in short and short["facts_summary"]["exec_checked"] is True
    exited = [e for e in env.journal("proc.exited") if e["proc"] == result["proc"]]
    assert exited[0]["via"] == "supervisor"
    started = env.journal("supervisor.started")
    assert [s["generation"] for s in started] == [1]
    assert set(started[0]) == {"container", "profile", "generation", "start_ms"}

    # The supervisor is protected from the reaper, and is not a command.
    assert len(supervisor_pids(env.sandbox())) == 1


async def test_engine_path_when_fast_exec_is_off(engine_env: Env) -> None:
    result = await engine_env.run(["sh", "-c", "ls /run/substrate; echo $?"], facts="full")
    assert result["via"] == "engine"
    assert "exec_facts" not in result
    assert "exec_checked" not in result["facts_summary"]
    assert text(result["stdout"]).strip().endswith("2")  # nothing bound there
    assert not (engine_env.state / "supervisor").exists()
    assert engine_env.journal("supervisor.started", "supervisor.unavailable") == []


async def test_an_image_without_python_keeps_the_engine_path(env: Env, tiny_image: str) -> None:
    result = await env.run(["echo", "hi"], profile="tiny")
    assert (result["via"], text(result["stdout"])) == ("engine", "hi\n")
    assert env.journal("supervisor.started", "supervisor.unavailable") == []


# --- a command on the fast path behaves as on the engine's --------------------------------


async def test_output_stdin_cwd_env_and_start_failures(env: Env) -> None:
    result = await env.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result["exit_code"], text(result["stdout"]), text(result["stderr"])) == (
        3,
        "out\n",
        "err\n",
    )
    assert text((await env.run(["cat"], stdin="hello\n"))["stdout"]) == "hello\n"
    raw = bytes(range(256))
    binary = await env.run(["cat"], stdin_b64=base64.b64encode(raw).decode())
    assert base64.b64decode(binary["stdout"]["inline"]) == raw
    assert (await env.run(["cat"]))["stdout"]["bytes"] == 0  # no stdin: EOF at once
    data = "".join(f"line {i:06d}\n" for i in range(50000))  # beyond the pipe buffers
    big = await env.run(["cat"], stdin=data)
    assert big["stdout"]["sha256"] == hashlib.sha256(data.encode()).hexdigest()
    assert text((await env.run(["pwd"], cwd="sub"))["stdout"]) == "/workspace/sub\n"
    listed = text((await env.run(["env"]))["stdout"]).splitlines()
    names = {line.partition("=")[0] for line in listed}
    # The profile's env, the sandbox's own, and its git_identity (a layer profile's).
    git = {"GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"}
    assert names == {"PATH", "HOSTNAME", "LANG", "HOME", "SUBSTRATE_PROC", *git}
    missing = await env.run(["no-such-program"])
    assert (missing["exit_code"], text(missing["stderr"])) == (
        127,
        "substrate: no-such-program: command not found\n",
    )
    assert missing["stdout"]["bytes"] == 0
    denied = await env.run(["/etc/passwd"])
    assert (denied["exit_code"], text(denied["stderr"])) == (
        126,
        "substrate: /etc/passwd: permission denied\n",
    )
    for result in (missing, denied, big):
        assert result["via"] == "supervisor"


async def test_concurrent_commands_share_one_supervisor(env: Env) -> None:
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        results[i] = await env.run(["sh", "-c", f"sleep 0.3; echo {i}; echo e{i} >&2"])

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(one, i)
    for i, result in results.items():
        assert (result["via"], text(result["stdout"]), text(result["stderr"])) == (
            "supervisor",
            f"{i}\n",
            f"e{i}\n",
        )
    assert len(env.journal("supervisor.started")) == 1


def held_children(sandbox: Sandbox) -> set[int]:
    """The protected pids that are a supervisor's held child (forked ahead, not exec'd)."""
    found = set()
    for pid in sandbox.protected:
        try:
            proc = psutil.Process(pid)
            parent = proc.parent()
            if parent is not None and parent.pid in supervisor_pids(sandbox):
                found.add(pid)
        except psutil.Error:
            continue
    return found


async def test_a_held_child_waits_protected_and_is_never_a_straggler(env: Env) -> None:
    procs = []
    for i in range(6):  # alone in the sandbox: the reaper would take any ownerless process
        result = await env.run(["true"] if i % 2 else ["sh", "-c", "exit 0"])
        assert (result["via"], result["exit_code"]) == ("supervisor", 0)
        procs.append(result["proc"])
        held = held_children(env.sandbox())
        assert len(held) == 1, held  # the next command's, forked while this one ran
        assert env.command_pids() == []
    exited = {e["proc"]: e for e in env.journal("proc.exited")}
    assert [(exited[p]["reaped"], exited[p]["killed"]) for p in procs] == [(0, 0)] * 6
    # Concurrent commands: one held child at a time, the others forked on demand.
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(env.run, ["sleep", "0.2"])
    assert len(held_children(env.sandbox())) == 1 and env.command_pids() == []


async def test_a_held_child_waits_in_the_next_commands_cgroup(env: Env) -> None:
    """The spare is moved into a command cgroup made for an id chosen ahead while the
    previous command runs; the next command takes that id, the spare, and the check
    still reads its cgroup (beneath the container's) and every other fact."""
    await env.run(["true"])
    for _ in range(3):
        sandbox = env.sandbox()
        (held,) = held_children(sandbox)
        await wait_until_async(functools.partial(moved_ahead, held))
        ahead = cgroup_of(held).rsplit("substrate-cmd-", 1)[1]
        assert held in sandbox.protected  # waits protected, though in a command cgroup
        result = await env.run(["cat", "/proc/self/cgroup"], facts="full")
        assert (result["via"], result["exit_code"]) == ("supervisor", 0)
        assert result["proc"] == ahead  # the command that took it has the id it was moved for
        assert f"/substrate-cmd-{ahead}\n" in text(result["stdout"])
        facts = facts_of(result)
        assert (facts["cgroup"], facts["parent"], facts["namespaces"]) == (
            "sandbox",
            "supervisor",
            "sandbox",
        )
        assert not psutil.pid_exists(held) or held not in env.sandbox().protected
    # A spare moved ahead and killed by the sandbox itself is let go: the next command
    # forks its own and its cgroup (an empty one) does not stay behind.
    (held,) = held_children(env.sandbox())
    await wait_until_async(functools.partial(moved_ahead, held))
    ahead = cgroup_of(held).rsplit("substrate-cmd-", 1)[1]
    os.kill(held, 9)
    # (Once it is dead: a command arriving while the kill lands would take it and report
    # the 137 of a command killed by its sandbox at once.)
    await wait_until_async(functools.partial(gone, held))
    result = await env.run(["true"])
    assert (result["via"], result["exit_code"]) == ("supervisor", 0)
    await env.run(["true"])
    unified = unified_dir(env.sandbox())
    await wait_until_async(lambda: not (unified / f"substrate-cmd-{ahead}").exists())


async def test_a_held_child_stopped_after_it_was_read_ahead_is_not_used(env: Env) -> None:
    """The spare is read from the host once it is moved ahead; what the command that
    takes it checks again is its state: stopped by the sandbox after that reading, it
    is let go and the command runs in a child forked for it."""
    await env.run(["true"])
    (held,) = held_children(env.sandbox())
    await wait_until_async(functools.partial(moved_ahead, held))
    os.kill(held, signal.SIGSTOP)  # code of the sandbox's uid may do this
    await wait_until_async(lambda: psutil.Process(held).status() == psutil.STATUS_STOPPED)
    with trio.fail_after(30):  # not left waiting on a child that would never exec
        result = await env.run(["true"])
    assert (result["via"], result["exit_code"]) == ("supervisor", 0)
    await wait_until_async(functools.partial(gone, held))  # killed, never used


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def moved_ahead(pid: int) -> bool:
    return "substrate-cmd-" in cgroup_of(pid)


def cgroup_of(pid: int) -> str:
    """The unified-hierarchy line of host process `pid`'s `/proc/<pid>/cgroup`."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line for line in lines if line.startswith("0::"))


def unified_dir(sandbox: Sandbox) -> Path:
    """The container's directory in the unified hierarchy (where command cgroups go)."""
    assert sandbox.cgroups.unified is not None
    return sandbox.cgroups.unified


async def test_timeout_kills_the_whole_tree(env: Env) -> None:
    script = "trap '' TERM; (trap '' TERM; sleep 300) & sleep 300"
    result = await env.run(["sh", "-c", script], timeout_s=1)
    assert result["via"] == "supervisor"
    assert result["timed_out"] is True and result["exit_code"] == 137
    assert env.command_pids() == []


async def test_background_children_are_reaped(env: Env) -> None:
    result = await env.run(["sh", "-c", "sleep 300 & echo started"])
    assert (result["exit_code"], text(result["stdout"])) == (0, "started\n")
    assert env.command_pids() == []


async def test_signal_and_subscription_on_the_fast_path(env: Env) -> None:
    c = env.client
    script = "for i in 1 2 3; do echo tick $i; sleep 0.05; done; sleep 300"
    proc = (
        await c.call("proc.start", workspace=env.ws, profile="default", argv=["sh", "-c", script])
    )["proc"]
    await c.call("proc.subscribe", proc=proc)
    seen = b""
    async for message in c.notifications:
        params = message["params"]
        if message["method"] == "proc.output" and params["proc"] == proc:
            seen += str(params.get("data") or "").encode()
            if seen.count(b"tick") == 3:
                break
    assert seen == b"tick 1\ntick 2\ntick 3\n"
    assert (await c.call("proc.signal", proc=proc, signal="TERM"))["delivered"] >= 1
    ended = await c.call("proc.wait", proc=proc)
    assert (ended["exit_code"], ended["signal"], ended["via"]) == (143, "TERM", "supervisor")
    assert env.command_pids() == []


async def test_a_run_cut_off_is_killed_and_recorded(env: Env) -> None:
    assert (await env.run(["true"]))["via"] == "supervisor"  # the sandbox is up
    # A caller that goes away mid-run (its connection closes) cuts the run off.
    async with open_client(env.state / "substrate.sock") as other:
        with trio.move_on_after(1.0):
            await other.call(
                "proc.run", workspace=env.ws, profile="default", argv=["sh", "-c", "sleep 300"]
            )
    await wait_until_async(lambda: not env.command_pids(), 30, message="commands left running")
    listed = await env.client.call("proc.list", workspace=env.ws)
    newest = listed["processes"][0]
    done = await env.client.call("proc.wait", proc=newest["proc"])
    assert done["via"] == "supervisor" and done["exit_code"] in (137, 143)


async def test_write_gate_on_the_fast_path(env: Env) -> None:
    result = await env.run(["sh", "-c", "echo x > denied.lock; echo y > kept.txt"], "plain-rw")
    assert result["via"] == "supervisor"
    blocked = [(b["path"].split(":", 1)[1], b["reverted"]) for b in result["policy_blocked"]]
    assert blocked == [("denied.lock", True)]
    assert not (env.path / "denied.lock").exists()
    assert (env.path / "kept.txt").read_text() == "y\n"


async def test_working_layer_on_the_fast_path(env: Env) -> None:
    result = await env.run(["sh", "-c", "echo layered > made.txt"], profile="default")
    assert result["via"] == "supervisor"
    assert [e["path"] for e in result["changes"]["applied"]] == ["made.txt"]
    assert (env.path / "made.txt").read_text() == "layered\n"
    second = await env.run(["cat", "made.txt"], profile="default")
    assert (second["via"], text(second["stdout"])) == ("supervisor", "layered\n")


# --- a supervisor lost or interfered with ---------------------------------------------------


async def test_a_supervisor_killed_from_inside_is_journaled_and_replaced(env: Env) -> None:
    first = await env.run(["true"])
    assert first["via"] == "supervisor"
    old = supervisor_pids(env.sandbox())
    assert len(old) == 1
    # As the sandbox's own uid: the supervisor runs as that uid, so this may kill it.
    killer = await env.run(["pkill", "-KILL", "-f", SUPERVISOR])
    assert killer["via"] == "supervisor"
    assert killer["exit_code"] is None  # its reporter died while it ran: the code is lost
    lost = env.journal("supervisor.lost")
    assert [(e["generation"], e["reason"]) for e in lost] == [(1, "exited")]

    after = await env.run(["id", "-u"], facts="full")
    assert (after["via"], after["exit_code"], text(after["stdout"])) == ("supervisor", 0, "1000\n")
    own = facts_of(after)
    assert (own["no_new_privs"], own["seccomp_mode"], own["cap_eff"], own["uid"]) == (
        True,
        2,
        [],
        OWNER,
    )
    assert [e["generation"] for e in env.journal("supervisor.started")] == [1, 2]
    assert not (old & set(env.sandbox().protected)), "a dead supervisor's pid stays protected"
    for entry in env.journal("supervisor.started", "supervisor.lost"):
        assert "argv" not in str(entry) and "pkill" not in str(entry)


async def test_a_stopped_supervisor_is_replaced(env: Env) -> None:
    assert (await env.run(["true"]))["via"] == "supervisor"
    stopper = await env.run(["pkill", "-STOP", "-f", SUPERVISOR])
    assert stopper["exit_code"] is None  # it stopped its own reporter: the code is lost
    after = await env.run(["echo", "still"])
    assert (after["via"], text(after["stdout"])) == ("supervisor", "still\n")
    assert [(e["generation"], e["reason"]) for e in env.journal("supervisor.lost")] == [
        (1, "stopped")
    ]


async def test_too_many_losses_fall_back_to_the_engine(env: Env) -> None:
    for _ in range(3):
        assert (await env.run(["true"]))["via"] == "supervisor"
        await env.run(["pkill", "-KILL", "-f", SUPERVISOR])
    fallback = await env.run(["echo", "ok"])
    assert (fallback["via"], text(fallback["stdout"])) == ("engine", "ok\n")
    reasons = [e["reason"] for e in env.journal("supervisor.unavailable")]
    assert reasons == ["restarts"]


# --- the daemon killed with a command on the fast path ---------------------------------------


def labelled(docker_client: Any, daemon_id: str) -> list[str]:
    found = docker_client.api.containers(all=True, filters={"label": f"{LABEL_DAEMON}={daemon_id}"})
    return [str(c["Id"]) for c in found]


def test_kill_9_of_the_daemon_leaves_nothing_running(
    daemon_factory: Callable[..., DaemonProcess], docker_client: Any, sandbox_image: str
) -> None:
    d = daemon_factory()
    daemon_id = daemon_id_for(d.state_dir)
    try:
        ws = d.adopt(d.make_workspace())
        c = d.client()
        loop = "echo started; while true; do sleep 0.1; done"
        proc = c.call("proc.start", workspace=ws, profile="default", argv=["sh", "-c", loop])[
            "proc"
        ]
        wait_until(
            lambda: c.call("proc.status", proc=proc)["stdout_bytes"] > 0,
            60,
            interval=0.1,
            message="no output",
        )
        (container,) = labelled(docker_client, daemon_id)
        dirs = os.listdir(d.state_dir / "supervisor")
        assert len(dirs) == 1

        d.kill()
        # Before any restart: the supervisor saw its connection close and killed the
        # command; only the init and its keep-alive remain in the container.
        wait_until(
            lambda: len(docker_client.api.top(container)["Processes"]) == 2,
            30,
            interval=0.1,
            message="the command outlived its daemon",
        )

        d.start()
        wait_until(
            lambda: not labelled(docker_client, daemon_id),
            60,
            interval=0.2,
            message="the dead daemon's containers were not reaped",
        )
        c = d.client()
        assert c.call("proc.status", proc=proc)["state"] == "lost"
        assert os.listdir(d.state_dir / "supervisor") == []
        assert d.verify_journal()["ok"] is True
    finally:
        d.close()
        for ident in labelled(docker_client, daemon_id):
            docker_client.api.remove_container(ident, force=True, v=True)
