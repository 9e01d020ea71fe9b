"""`proc.run`, `facts.probe` and `profile.*` against the real engine, through the socket.

Each test starts a daemon in-process (its own state dir, adopt root and a copy of the
shipped profiles plus a few test profiles), talks to it over its agent socket, and
leaves nothing behind: the daemon removes its sandboxes when it stops, and the fixture
removes anything still carrying its daemon id.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import sqlite3
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from substrate.config import PROJECT_ROOT
from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, RpcError, open_client
from substrate.sandbox import reaper
from substrate.sandbox.containers import LABEL_DAEMON, LABEL_EPOCH, daemon_id_for
from substrate.sandbox.profiles import GIT_IDENTITY_ENV
from tests.harness import chown_tree, wait_until_async
from tests.harness.engine import remove_daemon_containers
from tests.harness.inprocess import in_process_config, serving

OWNER = 1000

#: Test-only profiles, written next to copies of the shipped ones.
TEST_PROFILES = {
    "allowlisted": 'image = "substrate-tiny:latest"\nmemory = "64m"\nargv_allow = ["echo"]\n',
    "smallmem": 'image = "substrate-tiny:latest"\nmemory = "32m"\n',
    "smalltmp": 'image = "substrate-tiny:latest"\nmemory = "64m"\ntmpfs = { "/tmp" = "1m" }\n',
    "fewpids": 'image = "substrate-tiny:latest"\nmemory = "64m"\npids = 48\ntimeout_s = 30\n',
    "smallout": 'image = "substrate-tiny:latest"\nmemory = "64m"\nmax_output_bytes = 100000\n',
}


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    root: Path
    ws: str
    ws_path: Path

    async def run(self, argv: list[str], profile: str = "tiny", **params: Any) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=argv, **params
        )

    async def refusal(self, argv: list[str], profile: str = "tiny", **params: Any) -> RpcError:
        with pytest.raises(RpcError) as caught:
            await self.run(argv, profile, **params)
        return caught.value

    def sandbox_pids(self, profile: str = "tiny") -> list[int]:
        """Host pids in the sandbox other than its init and keep-alive."""
        sandbox = self.daemon.execution.containers.cached(self.ws, profile)
        assert sandbox is not None
        return [p for p in reaper.cgroup_pids(sandbox.cgroups) if p not in sandbox.protected]


def text(ref: dict[str, Any]) -> str:
    assert ref["encoding"] == "utf-8", ref
    value: str = ref["inline"]
    return value


@pytest.fixture
def profiles_dir(tmp_path: Path) -> Path:
    out = tmp_path / "profiles"
    out.mkdir()
    for shipped in (PROJECT_ROOT / "profiles").glob("*.toml"):
        shutil.copy(shipped, out / shipped.name)
    for name, body in TEST_PROFILES.items():
        (out / f"{name}.toml").write_text(body)
    return out


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return state


@pytest.fixture
def adopt_root(tmp_path: Path) -> Path:
    root = tmp_path / "roots"
    project = root / "project"
    (project / ".git" / "hooks").mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "sub").mkdir()
    (project / "README").write_text("hello\n")
    os.symlink("/", project / "escape")
    chown_tree(project, OWNER)
    return root


@pytest.fixture
def leftovers(docker_client: Any, state_dir: Path) -> Iterator[str]:
    """This test's daemon id; whatever still carries it at the end is removed."""
    daemon_id = daemon_id_for(state_dir)
    yield daemon_id
    remove_daemon_containers(docker_client, state_dir)


@pytest.fixture
async def env(
    tiny_image: str,
    leftovers: str,
    state_dir: Path,
    adopt_root: Path,
    profiles_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Env]:
    # The daemon's own engine address must never reach a sandbox.
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    config = in_process_config(state_dir, adopt_root, profiles_dir)
    async with serving(config) as daemon, open_client(state_dir / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(adopt_root / "project"))
        yield Env(daemon, client, adopt_root, ws["workspace"], adopt_root / "project")


# --- argv, exit codes, stdin, cwd ------------------------------------------------------------


async def test_argv_is_never_a_shell_line(env: Env) -> None:
    result = await env.run(["echo", "$(id)", ";", "rm", "-rf", "/"])
    assert result["exit_code"] == 0
    assert text(result["stdout"]) == "$(id) ; rm -rf /\n"
    assert (env.ws_path / "README").exists()


async def test_exit_codes_and_stderr(env: Env) -> None:
    result = await env.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result["exit_code"], result["signal"], result["timed_out"]) == (3, None, False)
    assert text(result["stdout"]) == "out\n"
    assert text(result["stderr"]) == "err\n"
    assert (await env.run(["false"]))["exit_code"] == 1


async def test_stdin_text_and_bytes(env: Env) -> None:
    result = await env.run(["cat"], stdin="hello\nworld\n")
    assert text(result["stdout"]) == "hello\nworld\n"
    raw = bytes(range(256))
    result = await env.run(["cat"], stdin_b64=base64.b64encode(raw).decode())
    assert result["stdout"]["encoding"] == "base64"
    assert base64.b64decode(result["stdout"]["inline"]) == raw
    no_stdin = await env.run(["cat"])
    assert no_stdin["stdout"]["bytes"] == 0


async def test_large_stdin_and_output_flow_at_once(env: Env) -> None:
    data = "".join(f"line {i:06d}\n" for i in range(50000))  # 600 KB, beyond pipe buffers
    result = await env.run(["cat"], stdin=data)
    out = result["stdout"]
    assert out["bytes"] == len(data)
    assert out["sha256"] == hashlib.sha256(data.encode()).hexdigest()


async def test_cwd_and_owner(env: Env) -> None:
    assert text((await env.run(["pwd"]))["stdout"]) == "/workspace\n"
    assert text((await env.run(["pwd"], cwd="sub"))["stdout"]) == "/workspace/sub\n"
    assert text((await env.run(["id", "-u"]))["stdout"]) == f"{OWNER}\n"
    await env.run(["sh", "-c", "echo made > /workspace/sub/new"])
    assert (env.ws_path / "sub" / "new").stat().st_uid == OWNER


@pytest.mark.parametrize(
    ("cwd", "refusal"),
    [
        ("..", "path_invalid"),
        ("sub/../..", "path_invalid"),
        ("/etc", "path_invalid"),
        ("escape", "symlink_refused"),
        ("missing", "not_found"),
        ("README", "not_a_directory"),
    ],
)
async def test_cwd_outside_the_workspace_is_refused(env: Env, cwd: str, refusal: str) -> None:
    assert (await env.refusal(["pwd"], cwd=cwd)).refusal == refusal


# --- refusals before anything runs --------------------------------------------------------------


async def test_argv_refusals(env: Env) -> None:
    assert (await env.refusal([])).refusal == "argv_denied"
    assert (await env.refusal(["echo", "a\x00b"])).refusal == "argv_denied"
    assert (await env.refusal(["cat", "/etc/passwd"], "allowlisted")).refusal == "argv_denied"
    allowed = await env.run(["echo", "fine"], "allowlisted")
    assert text(allowed["stdout"]) == "fine\n"


async def test_unknown_profile_and_timeout_above_profile(env: Env) -> None:
    assert (await env.refusal(["true"], "no-such-profile")).refusal == "profile_unknown"
    assert (await env.refusal(["true"], timeout_s=100000)).refusal == "limit_exceeded"
    both = await env.refusal(["cat"], stdin="a", stdin_b64="YQ==")
    assert both.refusal == "invalid_params"
    assert env.daemon.execution.containers.cached(env.ws, "tiny") is None  # nothing ran


async def test_root_owned_workspace_is_refused(env: Env) -> None:
    rooted = env.root / "rooted"
    rooted.mkdir()
    ws = await env.client.call("workspace.adopt", path=str(rooted))
    with pytest.raises(RpcError) as caught:
        await env.client.call("proc.run", workspace=ws["workspace"], profile="tiny", argv=["id"])
    assert caught.value.refusal == "confinement_unmet"
    assert "chown" in caught.value.message


# --- timeouts, stragglers, hostile commands -------------------------------------------------------


async def test_term_ignoring_process_is_killed_after_grace(env: Env) -> None:
    script = "trap '' TERM; echo ready; while :; do sleep 1; done"
    result = await env.run(["sh", "-c", script], timeout_s=1)
    assert result["timed_out"] is True
    assert (result["exit_code"], result["signal"]) == (137, "KILL")
    assert text(result["stdout"]) == "ready\n"
    assert env.sandbox_pids() == []


async def test_double_forking_term_ignoring_tree_is_gone(env: Env) -> None:
    # The grandchild is re-parented to the container's init: only the marker finds it.
    script = "trap '' TERM; (trap '' TERM; (trap '' TERM; sleep 1000) & ) ; sleep 1000"
    result = await env.run(["sh", "-c", script], timeout_s=1)
    assert result["timed_out"] is True
    assert env.sandbox_pids() == []


async def test_scrubbed_environment_double_fork_is_reaped(env: Env) -> None:
    # `env -i` drops the marker; nothing else runs in the sandbox, so it is still reaped.
    script = "(env -i sh -c 'sleep 1000' &) ; true"
    result = await env.run(["sh", "-c", script])
    assert result["exit_code"] == 0
    assert env.sandbox_pids() == []


async def test_background_children_are_reaped(env: Env) -> None:
    detached = await env.run(["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"])
    assert detached["exit_code"] == 0
    assert env.sandbox_pids() == []
    # This one keeps the output pipe open: the command still ends when its main process does.
    holding = await env.run(["sh", "-c", "sleep 1000 & echo started"])
    assert (holding["exit_code"], holding["timed_out"]) == (0, False)
    assert text(holding["stdout"]) == "started\n"
    assert env.sandbox_pids() == []


async def test_command_that_closes_its_output_is_still_waited_for(env: Env) -> None:
    quiet = await env.run(["sh", "-c", "exec >&- 2>&-; sleep 1; exit 5"])
    assert (quiet["exit_code"], quiet["timed_out"]) == (5, False)
    stuck = await env.run(["sh", "-c", "exec >&- 2>&-; sleep 1000"], timeout_s=1)
    assert (stuck["timed_out"], stuck["exit_code"]) == (True, 143)
    assert env.sandbox_pids() == []


async def test_fork_bomb_is_contained(env: Env) -> None:
    async def bomb() -> Any:
        return await env.run(["sh", "-c", "f() { f | f & }; f; sleep 3"], "fewpids", timeout_s=10)

    def bomb_running() -> bool:
        sandbox = env.daemon.execution.containers.cached(env.ws, "fewpids")
        return sandbox is not None and bool(env.sandbox_pids("fewpids"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bomb)
        await wait_until_async(bomb_running, 30, message="the fork bomb never started")
        status = await env.client.call("daemon.status")  # still answering
        assert status["engine"]["reachable"] is True
    assert env.sandbox_pids("fewpids") == []
    after = await env.run(["echo", "ok"], "fewpids")
    assert text(after["stdout"]) == "ok\n"


async def test_memory_bomb_is_oom_killed(env: Env) -> None:
    result = await env.run(["tail", "/dev/zero"], "smallmem", timeout_s=60)
    assert result["oom_killed"] is True
    assert (result["exit_code"], result["signal"]) == (137, "KILL")


async def test_oom_of_a_child_is_reported(env: Env) -> None:
    result = await env.run(["sh", "-c", "tail /dev/zero; echo survived"], "smallmem", timeout_s=60)
    assert result["oom_killed"] is True
    assert result["exit_code"] == 0
    assert text(result["stdout"]) == "survived\n"


async def test_filling_tmp_gives_enospc_inside(env: Env) -> None:
    result = await env.run(["dd", "if=/dev/zero", "of=/tmp/fill", "bs=64k", "count=64"], "smalltmp")
    assert result["exit_code"] != 0
    assert "No space left on device" in text(result["stderr"])


async def test_git_dir_is_read_only_inside(env: Env) -> None:
    result = await env.run(["sh", "-c", "echo evil > /workspace/.git/hooks/x"])
    assert result["exit_code"] != 0
    assert "Read-only file system" in text(result["stderr"])
    assert not (env.ws_path / ".git" / "hooks" / "x").exists()
    ok = await env.run(["sh", "-c", "echo fine > /workspace/ok"])
    assert ok["exit_code"] == 0
    assert (env.ws_path / "ok").read_text() == "fine\n"


async def test_git_file_of_a_worktree_is_read_only_inside(env: Env) -> None:
    worktree = env.root / "worktree"
    worktree.mkdir()
    (worktree / ".git").write_text("gitdir: /elsewhere/.git/worktrees/w\n")
    chown_tree(worktree, OWNER)
    ws = (await env.client.call("workspace.adopt", path=str(worktree)))["workspace"]
    call = {"workspace": ws, "profile": "tiny"}
    result = await env.client.call("proc.run", argv=["sh", "-c", "echo x >> .git"], **call)
    assert result["exit_code"] != 0
    assert (worktree / ".git").read_text() == "gitdir: /elsewhere/.git/worktrees/w\n"
    probe = await env.client.call("facts.probe", **call)
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["readonly_dirs"] == [".git"]


async def test_no_engine_socket_or_address_inside(env: Env) -> None:
    probe = "ls /var/run/docker.sock /run/docker.sock 2>&1; env"
    result = await env.run(["sh", "-c", probe])
    out = text(result["stdout"])
    assert out.count("No such file or directory") == 2
    assert "DOCKER" not in out
    names = {line.split("=", 1)[0] for line in out.splitlines() if "=" in line}
    git_identity = set(GIT_IDENTITY_ENV)  # the profile's `git_identity`, over `env`
    assert (
        names
        <= {"LANG", "PATH", "HOME", "SUBSTRATE_PROC", "PWD", "SHLVL", "HOSTNAME"} | git_identity
    )


async def test_output_past_max_is_truncated(env: Env) -> None:
    result = await env.run(["yes"], "smallout", timeout_s=2)
    assert result["timed_out"] is True, {k: v for k, v in result.items() if k != "facts"}
    out = result["stdout"]
    assert out["truncated"] is True
    assert out["bytes"] == 100000
    assert out["artifact"].startswith("art_")
    assert out["preview_head"].startswith("y\ny\n")


async def test_large_output_becomes_an_artifact(env: Env) -> None:
    result = await env.run(["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' a"])
    out = result["stdout"]
    assert (out["bytes"], out["truncated"]) == (300000, False)
    assert "inline" not in out
    assert len(out["preview_head"].encode()) <= 4096
    stat = await env.client.call("artifact.stat", artifact=out["artifact"])
    assert (stat["bytes"], stat["sha256"]) == (300000, out["sha256"])


async def test_default_profile_runs_python_and_git(env: Env, sandbox_image: str) -> None:
    script = "import os, sys; print(sys.version_info[0], os.getuid())"
    result = await env.run(["python3", "-c", script], "default")
    assert text(result["stdout"]) == f"3 {OWNER}\n"
    git = await env.run(["git", "--version"], "default")
    assert text(git["stdout"]).startswith("git version")
    # `.git` is the checkout's git layer on "default": writable there, never here.
    hooks = await env.run(["touch", "/workspace/.git/hooks/x"], "default")
    assert hooks["exit_code"] == 0
    assert not (env.ws_path / ".git" / "hooks" / "x").exists()


async def test_endless_output_keeps_daemon_memory_flat(env: Env) -> None:
    me = psutil.Process()
    await env.run(["true"])
    idle = me.memory_info().rss
    size = 200 << 20  # four times the budget below
    result = await env.run(["head", "-c", str(size), "/dev/zero"])
    assert (result["stdout"]["bytes"], result["stdout"]["truncated"]) == (size, False)
    assert me.memory_info().rss - idle < 50 << 20


async def test_substrate_exec_prints_output_and_exits_with_the_code(env: Env) -> None:
    argv = [sys.executable, "-m", "substrate", "--state-dir", str(env.daemon.state_dir)]
    argv += ["exec", "--profile", "tiny", "--workspace", env.ws, "--"]
    argv += ["sh", "-c", "echo to-out; echo to-err >&2; exit 7"]
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 7
    assert done.stdout == b"to-out\n"
    assert b"to-err\n" in done.stderr


# --- journal ------------------------------------------------------------------------------------


async def test_journal_has_facts_and_outcomes_never_output(env: Env) -> None:
    marker = "output-marker-5f1c"
    await env.run(["echo", marker])
    entries = (await env.client.call("journal.read", workspace=env.ws))["entries"]
    kinds = [e["kind"] for e in entries]
    assert "proc.facts" in kinds
    started = next(e for e in entries if e["kind"] == "proc.started")
    exited = next(e for e in entries if e["kind"] == "proc.exited")
    assert started["data"]["argv0"] == "echo" and started["data"]["argc"] == 2
    assert exited["data"]["exit_code"] == 0
    assert exited["data"]["stdout"]["bytes"] == len(marker) + 1
    assert all(marker not in str(e["data"]) for e in entries)


async def test_argv_is_journaled_as_a_digest_and_kept_in_the_record(env: Env) -> None:
    secret = "sk-live-0f9e8d7c6b5a49382716"
    argv = ["sh", "-c", f"echo {secret} | wc -c", "inline-script"]
    result = await env.run(argv)
    assert result["exit_code"] == 0
    status = await env.client.call("proc.status", proc=result["proc"])
    assert status["argv"] == argv
    started = [e for e in env.daemon.journal.read(limit=10000) if e.kind == "proc.started"]
    assert started[-1].data == {
        "proc": result["proc"],
        "profile": "tiny",
        "argv0": "sh",
        "argc": 4,
        "argv_sha256": hashlib.sha256(json.dumps(argv, separators=(",", ":")).encode()).hexdigest(),
        "cwd": ".",
        "container": started[-1].data["container"],
    }
    with sqlite3.connect(env.daemon.state_dir / "substrate.db") as db:
        rows = db.execute("SELECT kind, data FROM journal").fetchall()
    assert rows and not [kind for kind, data in rows if secret in data]


# --- what a sandbox sees --------------------------------------------------------------------


async def test_a_missing_program_is_127_with_a_message_on_stderr(env: Env) -> None:
    missing = await env.run(["no-such-program", "arg"])
    assert (missing["exit_code"], missing["signal"]) == (127, None)
    assert missing["stdout"]["bytes"] == 0
    assert "no-such-program" in text(missing["stderr"])
    assert "not found" in text(missing["stderr"])
    by_path = await env.run(["/no/such/program"])
    assert by_path["exit_code"] == 127
    assert "/no/such/program" in text(by_path["stderr"])
    not_executable = await env.run(["/workspace/README"])
    assert not_executable["exit_code"] == 126
    assert "/workspace/README" in text(not_executable["stderr"])
    assert not_executable["stdout"]["bytes"] == 0
    # A program that exits 126 or 127 itself keeps its own output.
    own = await env.run(["sh", "-c", "echo mine; exit 127"])
    assert (own["exit_code"], text(own["stdout"])) == (127, "mine\n")


async def test_the_sandbox_has_no_name_server(env: Env) -> None:
    result = await env.run(["cat", "/etc/resolv.conf"])
    assert result["exit_code"] == 0
    assert "nameserver" not in text(result["stdout"])
    assert text(result["stdout"]).strip() == ""
    write = await env.run(["sh", "-c", "echo nameserver 1.1.1.1 > /etc/resolv.conf"])
    assert write["exit_code"] != 0


async def test_fact_sources_name_no_host_path(env: Env) -> None:
    result = await env.run(["true"], facts="full")
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="tiny")
    entries = env.daemon.journal.read(limit=10000)
    journaled = [f for e in entries if e.kind == "proc.facts" for f in e.data["facts"]]
    for facts in (result["facts"], probe["facts"]):
        sources = {f["name"]: f["source"] for f in facts}
        assert sources["cap_bnd"] == "kernel:proc-status"
        assert sources["readonly_dirs"] == "kernel:mountinfo"
        assert sources["memory_limit"] == "cgroup:memory.max" or sources["memory_limit"] == (
            "cgroup:memory.limit_in_bytes"
        )
        for name, source in sources.items():
            assert "/" not in source, (name, source)
    assert journaled and all("/" not in f["source"] for f in journaled)


async def test_every_git_at_any_depth_is_read_only_inside(env: Env) -> None:
    project = env.root / "nested"
    (project / ".git" / "modules" / "sub").mkdir(parents=True)
    (project / "vendor" / "lib" / ".git" / "hooks").mkdir(parents=True)
    (project / "vendor" / "lib" / ".git" / "config").write_text("[core]\n")
    (project / "mod" / "sub").mkdir(parents=True)
    (project / "mod" / "sub" / ".git").write_text("gitdir: ../../.git/modules/sub\n")
    (project / "deep" / "a" / "b" / "c" / ".git").mkdir(parents=True)
    os.symlink("vendor/lib", project / "link")  # never followed
    chown_tree(project, OWNER)
    ws = (await env.client.call("workspace.adopt", path=str(project)))["workspace"]
    call = {"workspace": ws, "profile": "tiny"}
    attempts = {
        "vendor/lib/.git/hooks/post-checkout": "echo x > vendor/lib/.git/hooks/post-checkout",
        "vendor/lib/.git/config": "echo x >> vendor/lib/.git/config",
        "mod/sub/.git": "echo x >> mod/sub/.git",
        "deep/a/b/c/.git/x": "echo x > deep/a/b/c/.git/x",
        ".git/modules/sub/x": "echo x > .git/modules/sub/x",
    }
    for rel, script in attempts.items():
        result = await env.client.call("proc.run", argv=["sh", "-c", script], **call)
        assert result["exit_code"] != 0, rel
        assert "Read-only file system" in text(result["stderr"]), rel
    assert (project / "vendor" / "lib" / ".git" / "config").read_text() == "[core]\n"
    assert (project / "mod" / "sub" / ".git").read_text() == "gitdir: ../../.git/modules/sub\n"
    assert not (project / "deep" / "a" / "b" / "c" / ".git" / "x").exists()
    ok = await env.client.call("proc.run", argv=["sh", "-c", "echo fine > vendor/lib/ok"], **call)
    assert ok["exit_code"] == 0
    probe = await env.client.call("facts.probe", **call)
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert set(facts["readonly_dirs"]) >= {
        ".git",
        "vendor/lib/.git",
        "mod/sub/.git",
        "deep/a/b/c/.git",
    }


# --- sandboxes: facts, labels, reuse, lifecycle ---------------------------------------------------


def labelled(docker_client: Any, daemon_id: str) -> list[str]:
    """Ids of the containers carrying `daemon_id` (one list call: no per-container race)."""
    found = docker_client.api.containers(all=True, filters={"label": f"{LABEL_DAEMON}={daemon_id}"})
    return [str(c["Id"]) for c in found]


async def gone(docker_client: Any, daemon_id: str) -> None:
    """Wait (polling the engine, at most 30 s) until no container carries `daemon_id`."""
    await wait_until_async(lambda: not labelled(docker_client, daemon_id), 30, interval=0.1)


async def test_profiles_are_listed_and_shown(env: Env) -> None:
    listed = (await env.client.call("profile.list"))["profiles"]
    names = {p["name"] for p in listed}
    assert {"default", "readonly", "gvisor", "interactive", "tiny"} <= names
    tiny = await env.client.call("profile.get", name="tiny")
    assert (tiny["name"], tiny["image"], tiny["workspace"]) == (
        "tiny",
        "substrate-tiny:latest",
        "rw",
    )
    with pytest.raises(RpcError) as caught:
        await env.client.call("profile.get", name="nope")
    assert caught.value.refusal == "profile_unknown"


async def test_probe_returns_facts_and_runs_nothing(env: Env, docker_client: Any) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="tiny")
    assert probe["facts"]
    assert all({"name", "source"} <= set(fact) for fact in probe["facts"])
    result = await env.run(["true"], facts="full")
    assert result["facts"] == probe["facts"]  # verified once per container
    assert len(labelled(docker_client, env.daemon.execution.daemon_id)) == 1


@pytest.mark.parametrize(
    ("setting", "value", "fact"),
    [("read_only", False, "rootfs_readonly"), ("cap_add", ["SYS_ADMIN"], "cap_bnd")],
)
async def test_weaker_container_with_our_labels_is_refused_never_reused(
    env: Env,
    docker_client: Any,
    test_labels: dict[str, str],
    setting: str,
    value: Any,
    fact: str,
) -> None:
    from substrate.sandbox import profiles as profile_lib
    from substrate.sandbox.spec import RunAs, container_spec

    execution = env.daemon.execution
    profile = execution.profile("tiny")
    spec = container_spec(
        profile,
        who=RunAs(OWNER, OWNER),
        workspace_source=str(env.ws_path),
        readonly_dirs=[".git"],
        security_opt=profile_lib.security_opts(profile, PROJECT_ROOT / "seccomp"),
    )
    spec["host_config"][setting] = value  # the one weaker setting
    labels = {
        **test_labels,
        **execution.containers.labels_for(env.ws, "tiny"),
        LABEL_EPOCH: str(env.daemon.epoch),
    }
    api = docker_client.api
    host_config = api.create_host_config(**spec.pop("host_config"))
    planted = api.create_container(**spec, labels=labels, host_config=host_config)["Id"]
    api.start(planted)

    refused = await env.refusal(["true"])
    assert refused.refusal == "confinement_unmet"
    assert fact in refused.data["observed"]
    assert planted not in labelled(
        docker_client, execution.daemon_id
    )  # removed, so it can never be reused
    result = await env.run(["sh", "-c", "touch /etc/x 2>&1; echo $?"])
    assert text(result["stdout"]).strip().endswith("1")  # the fresh one has a read-only root
    entries = (await env.client.call("journal.read", workspace=env.ws))["entries"]
    assert any(e["kind"] == "proc.facts" and e["data"]["ok"] is False for e in entries)


async def test_network_namespace_has_only_loopback(env: Env) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="tiny")
    facts = {f["name"]: f for f in probe["facts"]}
    assert facts["net_links"]["value"] == ["lo"]
    assert facts["net_routes"]["value"] == []
    assert facts["net_links"]["source"] == "netns:rtnetlink"
    assert facts["workspace_identity"]["value"] == "{0.st_dev}:{0.st_ino}".format(
        env.ws_path.stat()
    )


async def test_gvisor_profile_runs_under_runsc(env: Env, sandbox_image: str) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="gvisor")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["runtime"] == "runsc"
    assert facts["net_links"] == ["lo"]
    result = await env.run(["python3", "-c", "print(6 * 7)"], "gvisor")
    assert text(result["stdout"]) == "42\n"
    stuck = await env.run(["sh", "-c", "trap '' TERM; sleep 1000"], "gvisor", timeout_s=1)
    assert (stuck["timed_out"], stuck["exit_code"], stuck["signal"]) == (True, 137, "KILL")
    after = await env.run(["echo", "fresh"], "gvisor")
    assert text(after["stdout"]) == "fresh\n"


async def test_sandbox_removed_behind_our_back_is_replaced(env: Env, docker_client: Any) -> None:
    await env.run(["true"])
    first = env.daemon.execution.containers.cached(env.ws, "tiny")
    docker_client.api.remove_container(first.id, force=True)
    result = await env.run(["echo", "again"])
    assert text(result["stdout"]) == "again\n"
    second = env.daemon.execution.containers.cached(env.ws, "tiny")
    assert second.id != first.id


async def test_release_removes_the_workspace_sandboxes(env: Env, docker_client: Any) -> None:
    await env.run(["true"])
    assert len(labelled(docker_client, env.daemon.execution.daemon_id)) == 1
    await env.client.call("workspace.release", workspace=env.ws)
    assert labelled(docker_client, env.daemon.execution.daemon_id) == []


async def test_restart_reaps_what_a_previous_run_left(
    tiny_image: str,
    leftovers: str,
    state_dir: Path,
    adopt_root: Path,
    profiles_dir: Path,
    docker_client: Any,
    test_labels: dict[str, str],
) -> None:
    stale = docker_client.containers.create(
        tiny_image,
        ["sleep", "infinity"],
        labels={**test_labels, LABEL_DAEMON: leftovers, LABEL_EPOCH: "0"},
        network_mode="none",
    )
    async with serving(in_process_config(state_dir, adopt_root, profiles_dir)):
        await gone(docker_client, leftovers)
    assert stale.id not in labelled(docker_client, leftovers)


async def test_running_processes_are_capped(
    tiny_image: str, leftovers: str, state_dir: Path, adopt_root: Path, profiles_dir: Path
) -> None:
    config = in_process_config(state_dir, adopt_root, profiles_dir, max_processes=1)
    async with serving(config), open_client(state_dir / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(adopt_root / "project"))
        call = {"workspace": ws["workspace"], "profile": "tiny"}
        async with trio.open_nursery() as inner:
            inner.start_soon(lambda: client.call("proc.run", argv=["sleep", "3"], **call))

            async def sleep_running() -> bool:
                listed = (await client.call("proc.list"))["processes"]
                return any(p["state"] == "running" for p in listed)

            await wait_until_async(sleep_running, 30)
            with pytest.raises(RpcError) as caught:
                await client.call("proc.run", argv=["true"], **call)
            assert caught.value.refusal == "limit_exceeded"
        after = await client.call("proc.run", argv=["true"], **call)
        assert after["exit_code"] == 0


async def test_idle_sandbox_is_removed(
    tiny_image: str,
    leftovers: str,
    state_dir: Path,
    adopt_root: Path,
    profiles_dir: Path,
    docker_client: Any,
) -> None:
    config = in_process_config(state_dir, adopt_root, profiles_dir, container_idle_s=0.5)
    async with serving(config), open_client(state_dir / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(adopt_root / "project"))
        await client.call("proc.run", workspace=ws["workspace"], profile="tiny", argv=["true"])
        assert len(labelled(docker_client, leftovers)) == 1
        await gone(docker_client, leftovers)
        again = await client.call(
            "proc.run", workspace=ws["workspace"], profile="tiny", argv=["true"]
        )
        assert again["exit_code"] == 0


# --- draining a node (docs/deployment.md "Draining a node") ---------------------------------


async def test_drain_refuses_new_commands_and_waits_for_the_running_one(
    env: Env, state_dir: Path
) -> None:
    started = await env.client.call(
        "proc.start", workspace=env.ws, profile="tiny", argv=["sh", "-c", "sleep 2; echo done"]
    )
    async with open_client(state_dir / "operator.sock") as operator:
        # Agents may not drain a node.
        with pytest.raises(RpcError) as denied:
            await env.client.call("daemon.drain", timeout_s=0)
        assert denied.value.refusal == "unauthorized"
        drained = await operator.call("daemon.drain", timeout_s=120)
        # The running command was waited for, not killed.
        assert (drained["draining"], drained["running"]) == (True, 0)
        finished = await env.client.call("proc.wait", proc=started["proc"])
        assert (finished["exit_code"], text(finished["stdout"])) == (0, "done\n")
        refused = await env.refusal(["true"])
        assert refused.refusal == "draining"
        status = await env.client.call("daemon.status")
        assert (status["draining"], status["running"]) == (True, 0)
        resumed = await operator.call("daemon.drain", cancel=True)
        assert resumed["draining"] is False
    assert (await env.run(["true"]))["exit_code"] == 0


async def test_drain_returns_at_its_timeout_with_the_commands_still_running(
    env: Env, state_dir: Path
) -> None:
    started = await env.client.call(
        "proc.start", workspace=env.ws, profile="tiny", argv=["sleep", "30"]
    )
    async with open_client(state_dir / "operator.sock") as operator:
        drained = await operator.call("daemon.drain", timeout_s=0.5)
        assert (drained["draining"], drained["running"]) == (True, 1)
        await env.client.call("proc.signal", proc=started["proc"], signal="KILL")
        await operator.call("daemon.drain", cancel=True)
