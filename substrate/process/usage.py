"""Per-command CPU time and peak memory, read from the sandbox's cgroup (`ProcResult.usage`,
docs/execution.md "Usage").

Theory of operation. A `Meter` is started just before the command's exec starts and
finished once its main process ended and its stragglers were reaped; the result is
the difference of the cgroup's counters over that window:
- CPU: v1 `cpuacct.usage` (ns), v2 `cpu.stat` `usage_usec`; user + system of every
  process in the cgroup, children and stragglers included.
- Peak memory: v1 `memory.max_usage_in_bytes`, reset to the current usage at the
  start (a write of "0") when nothing else uses the sandbox; v2 `memory.peak` through
  a descriptor of its own, reset at the start (a write resets the peak seen through
  that descriptor only: Linux 6.12 and later). A reset that fails (an older v2
  kernel, no permission) leaves the peak None: the counter then spans the container's
  whole life, not the command's.

Why the cgroup and not the command's own processes: an engine exec's main process is
the engine shim's child, which reaps it; substrate never sees its rusage, and polling
/proc would miss short processes and everything between polls. The price is that the
counters are the sandbox's: `exclusive` is true only when no other command or
terminal used the sandbox from the start to the finish (`Sandbox.acquired`
unchanged, nothing else running at the start); otherwise the figures include the
others' and are upper bounds. A v1 peak is reset only when exclusive at the start, so a
command running alongside another never shortens the other's window.

Cost: two small cgroupfs reads and one write at the start, two reads at the finish;
read on the event loop (cgroupfs is in memory, microseconds; no disk is touched).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from substrate.sandbox.reaper import CgroupDirs
from substrate.sandbox.sandboxes import Sandbox
from substrate.schema.proc import Usage

__all__ = ["Meter", "read_cpu_ns"]


def read_cpu_ns(dirs: CgroupDirs) -> int | None:
    """The cgroup's CPU time so far, in ns; None when unreadable."""
    if dirs.cpu is None:
        return None
    try:
        if not dirs.v2:
            return int(_read_small(dirs.cpu / "cpuacct.usage"))
        for line in _read_small(dirs.cpu / "cpu.stat").splitlines():
            key, _, value = line.partition(b" ")
            if key == b"usage_usec":
                return int(value) * 1000
    except (OSError, ValueError):
        return None
    return None


def _read_small(path: Path) -> bytes:
    """A small cgroupfs file in one read (no text layer: this is on every command's way)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


class _Peak:
    """The memory high-water mark over the command's window (see the module doc)."""

    def __init__(self, dirs: CgroupDirs, reset: bool) -> None:
        self._fd: int | None = None
        self._path: Path | None = None
        if dirs.memory is None:
            return
        if dirs.v2:
            self._open_v2(dirs.memory / "memory.peak")
        else:
            path = dirs.memory / "memory.max_usage_in_bytes"
            try:
                if reset:
                    path.write_text("0")
            except OSError:  # not reset: the container's peak, not the command's
                return
            self._path = path

    def _open_v2(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.write(fd, b"reset\n")
        except OSError:  # before Linux 6.12: not resettable, not the command's
            os.close(fd)
            return
        self._fd = fd

    def read(self) -> int | None:
        try:
            if self._fd is not None:
                return int(os.pread(self._fd, 64, 0))
            if self._path is not None:
                return int(self._path.read_text())
        except (OSError, ValueError):
            return None
        return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Meter:
    """One command's window on its sandbox's cgroup counters."""

    sandbox: Sandbox
    cpu_ns: int | None
    peak: _Peak
    acquired: int  # `Sandbox.acquired` at the start
    alone: bool  # nothing but this command used the sandbox at the start

    @classmethod
    def start(cls, sandbox: Sandbox) -> Meter:
        """Read the counters now (the command holds its `Sandbox.acquire` already)."""
        alone = sandbox.running <= 1
        dirs = sandbox.cgroups
        return cls(
            sandbox=sandbox,
            cpu_ns=read_cpu_ns(dirs),
            peak=_Peak(dirs, reset=alone),
            acquired=sandbox.acquired,
            alone=alone,
        )

    def finish(self) -> Usage | None:
        """The usage over the window (None when no counter could be read); closes."""
        try:
            dirs = self.sandbox.cgroups
            end = read_cpu_ns(dirs)
            cpu_s = None
            if end is not None and self.cpu_ns is not None:
                cpu_s = round(max(0, end - self.cpu_ns) / 1e9, 6)
            peak = self.peak.read()
        finally:
            self.close()
        if cpu_s is None and peak is None:
            return None
        return Usage(
            cpu_s=cpu_s,
            peak_memory_bytes=peak,
            exclusive=self.alone and self.sandbox.acquired == self.acquired,
            source="cgroup-v2" if dirs.v2 else "cgroup-v1",
        )

    def close(self) -> None:
        """Let go of the v2 descriptor (idempotent): a run that never started."""
        self.peak.close()
