"""Fast exec without Docker: the wire (sans-IO), the host checks (pure), and the
supervisor program run on this host as a subprocess (`tests.harness.host_supervisor`),
driven by the daemon's `Link`.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
from collections.abc import AsyncIterator

import pytest
import trio

from substrate.sandbox.supervisor import agent, checks
from substrate.sandbox.supervisor.link import Link, LinkBroken
from tests.harness import wait_until
from tests.harness.host_supervisor import host_link

# -- the wire ---------------------------------------------------------------------------


def test_frames_round_trip_split_anywhere() -> None:
    frames = agent.encode({"op": "go", "argv": ["é", "\udcff"]}, 2) + agent.encode({"op": "abort"})
    for cut in range(len(frames) + 1):
        decoder = agent.Decoder(1 << 16)
        out = decoder.feed(frames[:cut], [7, 8]) + decoder.feed(frames[cut:])
        assert [m for m, _ in out] == [{"op": "go", "argv": ["é", "\udcff"]}, {"op": "abort"}]
        assert [fds for _, fds in out] == [[7, 8], []]
        assert decoder.buffered == 0


def test_descriptors_queue_in_order_across_frames() -> None:
    decoder = agent.Decoder(1 << 16)
    data = agent.encode({"n": 1}, 1) + agent.encode({"n": 2}, 0) + agent.encode({"n": 3}, 2)
    out = decoder.feed(data, [10, 11, 12])
    assert [(m["n"], fds) for m, fds in out] == [(1, [10]), (2, []), (3, [11, 12])]


@pytest.mark.parametrize(
    "data",
    [
        struct.pack(">IB", 1 << 20, 0),  # larger than the decoder allows
        struct.pack(">IB", 2, 9) + b"{}",  # more descriptors than a frame may carry
        struct.pack(">IB", 3, 0) + b"[1]",  # not an object
        struct.pack(">IB", 3, 0) + b"{x}",  # not JSON
        struct.pack(">IB", 2, 1) + b"{}",  # announced a descriptor that never came
    ],
)
def test_broken_frames_are_refused(data: bytes) -> None:
    with pytest.raises(agent.ProtocolError):
        agent.Decoder(1024).feed(data)


def test_encode_refuses_too_many_descriptors() -> None:
    with pytest.raises(agent.ProtocolError):
        agent.encode({}, agent.MAX_FDS + 1)


def test_a_held_child_moved_ahead_reads_as_in_its_sandbox_only_beneath_it() -> None:
    base = "9:pids:/docker/abc\n0::/docker/abc\n"
    leaf = "substrate-cmd-p_0123456789abcdef"
    assert checks.same_cgroup(base, base)
    assert checks.same_cgroup(f"9:pids:/docker/abc\n0::/docker/abc/{leaf}\n", base, leaf)
    # Not without the leaf the daemon made, not another leaf, not deeper, not two lines.
    assert not checks.same_cgroup(f"9:pids:/docker/abc\n0::/docker/abc/{leaf}\n", base)
    assert not checks.same_cgroup("9:pids:/docker/abc\n0::/docker/abc/other\n", base, leaf)
    assert not checks.same_cgroup(f"9:pids:/docker/abc\n0::/docker/abc/x/{leaf}\n", base, leaf)
    assert not checks.same_cgroup(f"9:pids:/docker/xyz\n0::/docker/abc/{leaf}\n", base, leaf)
    assert not checks.same_cgroup(f"9:pids:/docker/abc/{leaf}\n0::/docker/abc/{leaf}\n", base, leaf)
    assert not checks.same_cgroup(f"0::/docker/abc/{leaf}\n", base, leaf)
    assert not checks.same_cgroup(f"9:pids:/docker/abc\n0::/docker/abc/{leaf}\n", base, "a/b")


def test_hello_mac_depends_on_the_secret() -> None:
    assert agent.hello_mac(b"a" * 32) == agent.hello_mac(b"a" * 32)
    assert agent.hello_mac(b"a" * 32) != agent.hello_mac(b"b" * 32)


def test_exit_code_of_a_wait_status() -> None:
    assert agent.exit_code_of(3 << 8) == 3
    assert agent.exit_code_of(9) == 137  # killed by SIGKILL
    assert agent.exit_code_of(15) == 143


# -- the host checks (pure) ---------------------------------------------------------------

STATUS = """Name:\ttrue
State:\tS (sleeping)
PPid:\t400
TracerPid:\t0
Uid:\t1000\t1000\t1000\t1000
Gid:\t1000\t1000\t1000\t1000
NSpid:\t4242\t13
CapPrm:\t0000000000000000
CapEff:\t0000000000000000
CapBnd:\t0000000000000000
CapAmb:\t0000000000000000
NoNewPrivs:\t1
Seccomp:\t2
"""
BASE = checks.Baseline(
    status={
        "no_new_privs": True,
        "seccomp_mode": 2,
        "cap_eff": [],
        "cap_prm": [],
        "cap_bnd": [],
        "cap_amb": [],
        "uid": 1000,
        "gid": 1000,
    },
    cgroup="0::/docker/abc\n",
    namespaces=(1, 2, 3, 4, 5, 6, 7),
)


def reading(status: str = STATUS, **kw: object) -> checks.Reading:
    values: dict[str, object] = {
        "status": status,
        "cgroup": BASE.cgroup,
        "namespaces": BASE.namespaces,
        "owner": 0,
    }
    values.update(kw)
    return checks.Reading(**values)  # type: ignore[arg-type]


def command_mismatches(r: checks.Reading, **kw: int) -> list[str]:
    found = checks.command_facts(
        r, BASE, supervisor_pid=kw.get("sup", 400), reported_pid=kw.get("rep", 13)
    )
    return [m.name for m in checks.mismatches(found, BASE)]


def test_a_held_child_like_its_sandbox_meets_the_baseline() -> None:
    found = checks.command_facts(reading(), BASE, supervisor_pid=400, reported_pid=13)
    assert checks.mismatches(found, BASE) == []
    by_name = {f.name: (f.value, f.source) for f in found}
    assert by_name["no_new_privs"] == (True, "kernel:proc-status")
    assert by_name["parent"] == ("supervisor", "kernel:proc-status")
    assert by_name["cgroup"] == ("sandbox", "kernel:proc-cgroup")
    assert by_name["namespaces"] == ("sandbox", "kernel:proc-ns")


@pytest.mark.parametrize(
    ("status", "kw", "names"),
    [
        (STATUS.replace("NoNewPrivs:\t1", "NoNewPrivs:\t0"), {}, ["no_new_privs"]),
        (STATUS.replace("Seccomp:\t2", "Seccomp:\t0"), {}, ["seccomp_mode"]),
        (STATUS.replace("CapEff:\t0000000000000000", "CapEff:\t0000000000200000"), {}, ["cap_eff"]),
        (STATUS.replace("CapBnd:\t0000000000000000", "CapBnd:\t00000000000000c0"), {}, ["cap_bnd"]),
        (STATUS.replace("Uid:\t1000\t1000\t1000\t1000", "Uid:\t1000\t0\t0\t0"), {}, ["uid"]),
        (STATUS, {"sup": 401}, ["parent"]),  # its parent is not the supervisor
        (STATUS, {"rep": 14}, ["parent"]),  # not the pid the supervisor reported
        ("garbage", {}, [*checks.STATUS_FACTS, "parent"]),
    ],
)
def test_any_weaker_or_foreign_process_is_a_mismatch(
    status: str, kw: dict[str, int], names: list[str]
) -> None:
    assert command_mismatches(reading(status), **kw) == names


def test_another_cgroup_or_namespace_is_a_mismatch() -> None:
    assert command_mismatches(reading(cgroup="0::/\n")) == ["cgroup"]
    assert command_mismatches(reading(namespaces=(1, 2, 9, 4, 5, 6, 7))) == ["namespaces"]
    assert command_mismatches(reading(namespaces=(-1, 2, 3, 4, 5, 6, 7))) == ["namespaces"]


def test_supervisor_problems() -> None:
    assert checks.supervisor_problem(STATUS, 0, 1000) is None
    assert checks.supervisor_problem(
        STATUS.replace("TracerPid:\t0", "TracerPid:\t77"), 0, 1000
    ) == ("traced")
    assert checks.supervisor_problem(STATUS.replace("S (sleeping)", "T (stopped)"), 0, 1000) == (
        "stopped"
    )
    assert checks.supervisor_problem(STATUS.replace("S (sleeping)", "Z (zombie)"), 0, 1000) == (
        "exited"
    )
    assert checks.supervisor_problem(STATUS, 1000, 1000) == "dumpable"
    assert checks.supervisor_problem(STATUS, 0, 0) is None  # a root sandbox: not observable
    assert checks.supervisor_start_problem(reading(), BASE, 1000) is None
    weaker = STATUS.replace("Seccomp:\t2", "Seccomp:\t0")
    assert checks.supervisor_start_problem(reading(weaker), BASE, 1000) == "confinement"
    assert checks.supervisor_start_problem(reading(cgroup="x"), BASE, 1000) == "cgroup"


def test_pidfd_names_its_host_process() -> None:
    fd = os.pidfd_open(os.getpid())
    try:
        assert checks.pidfd_pid(fd) == os.getpid()
    finally:
        os.close(fd)


# -- the program, on this host --------------------------------------------------------


@pytest.fixture
async def link() -> AsyncIterator[Link]:
    async with host_link() as found:
        yield found


def pipes() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(the command's ends: stdin, stdout, stderr), (ours: stdin writer, stdout, stderr)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return (in_r, out_w, err_w), (in_w, out_r, err_r)


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


async def run(
    link: Link, argv: list[str], stdin: bytes = b""
) -> tuple[int | None, int | None, bytes, bytes]:
    theirs, (in_w, out_r, err_r) = pipes()
    env = {"PATH": "/usr/bin:/bin", "SUBSTRATE_PROC": "p_test"}
    spawned = await link.spawn()
    try:
        assert spawned.mismatches == [], spawned.mismatches
        assert spawned.host_pid > 0 and not spawned.exited()
        await spawned.go(argv, env, "/", theirs)
        for fd in theirs:
            os.close(fd)
        os.write(in_w, stdin)
        os.close(in_w)
        code, err = await spawned.wait_exit()
        out, errs = await trio.to_thread.run_sync(lambda: (read_all(out_r), read_all(err_r)))
        return code, err, out, errs
    finally:
        spawned.close()


async def test_a_command_runs_with_its_stdio_and_code(link: Link) -> None:
    code, err, out, errs = await run(
        link, ["sh", "-c", 'cat; echo "$SUBSTRATE_PROC" >&2; exit 3'], b"in\n"
    )
    assert (code, err, out, errs) == (3, None, b"in\n", b"p_test\n")


async def test_a_command_killed_by_a_signal_is_128_plus_n(link: Link) -> None:
    code, _, _, _ = await run(link, ["sh", "-c", "kill -9 $$"])
    assert code == 137


async def test_an_exec_that_fails_reports_its_errno(link: Link) -> None:
    code, err, out, _ = await run(link, ["/nonexistent/program"])
    assert (code, err, out) == (agent.EXEC_FAILED, errno.ENOENT, b"")


async def test_the_held_child_is_checked_before_it_runs(link: Link) -> None:
    spawned = await link.spawn()
    try:
        names = {f.name: f.value for f in spawned.facts}
        assert names["parent"] == "supervisor" and names["cgroup"] == "sandbox"
        assert names["uid"] == os.getuid()
        await spawned.abort()
        code, _ = await spawned.wait_exit()
        assert code == agent.ABORTED
    finally:
        spawned.close()


async def test_a_held_child_forked_ahead_waits_and_is_checked_when_used(link: Link) -> None:
    spare = await link.fork()  # asked for; the answer is read later
    try:
        await link.forked(spare)
        assert spare.host_pid > 0 and spare.facts == [] and not spare.exited()
        with trio.move_on_after(0.2):  # held: nothing runs before `go`
            await spare.wait_gone()
        assert not spare.exited()
        link.check(spare)  # read on the very process that will exec
        assert spare.mismatches == []
        assert {f.name: f.value for f in spare.facts}["parent"] == "supervisor"
        theirs, (in_w, out_r, err_r) = pipes()
        await spare.go(["sh", "-c", "echo ran; cat"], {"PATH": "/usr/bin:/bin"}, "/tmp", theirs)
        for fd in theirs:
            os.close(fd)
        os.write(in_w, b"late\n")
        os.close(in_w)
        code, err = await spare.wait_exit()
        out = await trio.to_thread.run_sync(read_all, out_r)
        assert (code, err, out) == (0, None, b"ran\nlate\n")
        os.close(err_r)
    finally:
        spare.close()


async def test_a_held_child_whose_channel_closes_exits_without_exec(link: Link) -> None:
    spare = await link.fork()
    await link.forked(spare)
    pidfd = os.dup(spare.pidfd)
    try:
        spare.chan.close()  # the daemon let go of it
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
        spare.close()


async def test_a_held_child_gone_before_its_check_is_not_read(link: Link) -> None:
    spare = await link.fork()
    await link.forked(spare)
    try:
        spare.kill()  # what sandboxed code of the same uid could do to it
        with trio.fail_after(10):
            await spare.wait_gone()
        with pytest.raises(LinkBroken, match="child-gone"):
            link.check(spare)
    finally:
        spare.close()


async def test_a_child_unlike_the_baseline_has_mismatches(link: Link) -> None:
    link.base = checks.Baseline(
        status={**link.base.status, "uid": 4321}, cgroup=link.base.cgroup, namespaces=(1,) * 7
    )
    spawned = await link.spawn()
    try:
        assert sorted(m.name for m in spawned.mismatches) == ["namespaces", "uid"]
    finally:
        spawned.close()  # its channel closes: the held child exits, nothing ran


async def test_the_daemon_going_away_kills_running_children(link: Link) -> None:
    theirs, (in_w, out_r, err_r) = pipes()
    spawned = await link.spawn()
    try:
        await spawned.go(["sleep", "60"], {"PATH": "/usr/bin:/bin"}, "/", theirs)
        for fd in theirs:
            os.close(fd)
        link.control.close()  # what a dead daemon's kernel does to the connection
        with trio.fail_after(10):
            await spawned.wait_gone()
        code, _ = await spawned.wait_exit()
        assert code in (137, None)  # reported as killed, or the supervisor exited first
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(link.pidfd)  # the supervisor exited too
    finally:
        spawned.close()
        for fd in (in_w, out_r, err_r):
            os.close(fd)


async def test_a_dead_supervisor_breaks_the_link(link: Link) -> None:
    link.kill()
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(link.pidfd)
    assert link.problem() == "exited"
    with pytest.raises(LinkBroken):
        await link.spawn()


def test_the_state_read_alone_agrees_with_the_status_of_a_live_and_a_stopped_process() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert checks.read_state(child.pid) == checks.status_state(checks.read_status(child.pid)[0])
        assert not checks.held_state_problem(checks.read_state(child.pid))
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: checks.read_state(child.pid) == "T", 10)
        assert checks.held_state_problem(checks.read_state(child.pid))
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ProcessLookupError):
        checks.read_state(child.pid)
