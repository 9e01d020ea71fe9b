"""Per-command usage from the sandbox's cgroup (`substrate.process.usage`), on cgroup
directories the test lays out: the CPU delta over the window, the v1 peak reset only
when the command is alone, `exclusive`, the v2 peak through its own descriptor, what
cannot be read; and the usage a record keeps."""

from __future__ import annotations

import hashlib
from pathlib import Path

from substrate.process.records import Outcome, ProcessRecords
from substrate.process.usage import Meter, read_cpu_ns
from substrate.sandbox.profiles import Profile
from substrate.sandbox.reaper import CgroupDirs
from substrate.sandbox.sandboxes import Sandbox
from substrate.sandbox.spec import RunAs
from substrate.schema.artifact import OutputRef
from substrate.schema.proc import Usage
from substrate.store.db import Store
from substrate.store.journal import Journal


def sandbox_on(dirs: CgroupDirs) -> Sandbox:
    profile = Profile(name="p", image="i")
    return Sandbox(
        id="c" * 64,
        workspace="w",
        profile=profile,
        declared=profile,
        who=RunAs(1000, 1000),
        init_pid=1,
        init=1,
        protected=frozenset(),
        cgroups=dirs,
        facts=[],
        host_visible=True,
    )


def v1(tmp_path: Path) -> tuple[CgroupDirs, Path, Path]:
    cpu, mem = tmp_path / "cpuacct", tmp_path / "memory"
    cpu.mkdir(parents=True)
    mem.mkdir()
    (cpu / "cpuacct.usage").write_text("5000000000\n")
    (mem / "memory.max_usage_in_bytes").write_text("900000\n")
    dirs = CgroupDirs(procs=mem, memory=mem, freezer=None, v2=False, cpu=cpu)
    return dirs, cpu / "cpuacct.usage", mem / "memory.max_usage_in_bytes"


def test_v1_cpu_delta_and_a_peak_reset_for_a_lone_command(tmp_path: Path) -> None:
    dirs, cpu, peak = v1(tmp_path)
    box = sandbox_on(dirs)
    box.acquire()
    meter = Meter.start(box)
    assert peak.read_text() == "0"  # reset: the kernel restarts it at the usage now
    cpu.write_text("6250000000\n")
    peak.write_text("4096000\n")
    assert meter.finish() == Usage(
        cpu_s=1.25, peak_memory_bytes=4096000, exclusive=True, source="cgroup-v1"
    )


def test_a_command_that_shared_its_sandbox_is_not_exclusive(tmp_path: Path) -> None:
    dirs, _, peak = v1(tmp_path)
    box = sandbox_on(dirs)
    box.acquire()
    box.acquire()  # another command runs already: its peak window is left alone
    shared = Meter.start(box)
    assert peak.read_text() == "900000\n"
    usage = shared.finish()
    assert usage is not None and (usage.exclusive, usage.peak_memory_bytes) == (False, 900000)
    box.release()
    alone = Meter.start(box)
    box.acquire()  # a terminal came and went while it ran
    box.release()
    usage = alone.finish()
    assert usage is not None and usage.exclusive is False


def test_v2_reads_cpu_stat_and_the_peak_through_its_own_descriptor(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("usage_usec 1000\nuser_usec 600\nsystem_usec 400\n")
    (tmp_path / "memory.peak").write_text("777\n")
    dirs = CgroupDirs(procs=tmp_path, memory=tmp_path, freezer=None, v2=True, cpu=tmp_path)
    assert read_cpu_ns(dirs) == 1_000_000
    box = sandbox_on(dirs)
    box.acquire()
    meter = Meter.start(box)
    assert (tmp_path / "memory.peak").read_text().startswith("reset")  # written through it
    (tmp_path / "cpu.stat").write_text("usage_usec 501000\n")
    (tmp_path / "memory.peak").write_text("123456\n")
    assert meter.finish() == Usage(
        cpu_s=0.5, peak_memory_bytes=123456, exclusive=True, source="cgroup-v2"
    )


def test_a_peak_that_cannot_be_reset_or_a_missing_cgroup_is_not_reported(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("usage_usec 1000\n")
    (tmp_path / "memory.peak").mkdir()  # no resettable file: a kernel before 6.12, say
    dirs = CgroupDirs(procs=tmp_path, memory=tmp_path, freezer=None, v2=True, cpu=tmp_path)
    box = sandbox_on(dirs)
    box.acquire()
    usage = Meter.start(box).finish()
    assert usage is not None and (usage.cpu_s, usage.peak_memory_bytes) == (0.0, None)
    # A v1 peak the daemon may not reset is not the command's either.
    v1_dirs, _, peak = v1(tmp_path / "v1")
    peak.unlink()
    peak.mkdir()  # the write fails
    usage = Meter.start(sandbox_on(v1_dirs)).finish()
    assert usage is not None and usage.peak_memory_bytes is None
    gone = tmp_path / "gone"
    nothing = CgroupDirs(procs=gone, memory=gone, freezer=None, v2=False, cpu=gone)
    assert Meter.start(sandbox_on(nothing)).finish() is None


def test_a_record_keeps_its_usage_and_journals_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "substrate.db")
    usage = Usage(cpu_s=0.25, peak_memory_bytes=1 << 20, exclusive=True, source="cgroup-v1")
    empty = OutputRef(bytes=0, sha256=hashlib.sha256(b"").hexdigest(), truncated=False)
    try:
        journal = Journal(store)
        records = ProcessRecords(store, journal)
        records.started(
            workspace="w", proc="p_1", profile="p", argv=["true"], cwd=".", container="c", actor="t"
        )
        outcome = Outcome(
            exit_code=0,
            signal=None,
            timed_out=False,
            oom_killed=False,
            duration_ms=1.0,
            reaped=0,
            killed=0,
            usage=usage,
        )
        records.exited(
            workspace="w",
            proc="p_1",
            outcome=outcome,
            stdout=empty,
            stderr=empty,
            blocked=[],
            actor="t",
        )
        row = records.get("p_1")
        assert row is not None and row.usage == usage
        (exited,) = [e for e in journal.read(limit=100) if e.kind == "proc.exited"]
        assert exited.data["usage"] == {
            "cpu_s": 0.25,
            "peak_memory_bytes": 1 << 20,
            "exclusive": True,
            "source": "cgroup-v1",
        }
    finally:
        store.close()
