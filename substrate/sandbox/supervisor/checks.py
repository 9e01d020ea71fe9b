"""What the host sees of a supervisor and of each command it forks, before either is trusted.

Every process of a sandbox shows the same confinement: the `Baseline` is read once per
supervisor start from the verified sandbox (its facts, its init's cgroups and
namespaces). A command's own process is read from the host while the supervisor holds it
forked and not yet exec'd (`read_process`), and turned into per-command facts
(`command_facts`, pure) compared with the baseline (`mismatches`, pure): NoNewPrivs,
Seccomp mode, the four capability sets and the ids from `/proc/<pid>/status`; the
cgroups (`/proc/<pid>/cgroup` equal to the init's, text for text, or but for the command
cgroup it was moved into ahead: `same_cgroup`); the namespaces (the
inode of each `/proc/<pid>/ns/*` equal to the init's); and its parentage (its parent is
the supervisor's host process, its pid inside the sandbox is the one the supervisor
reported). Under no-new-privileges exec can only keep or drop what the held child has,
so what is seen before exec bounds what the command runs with (docs/fast-exec.md).

The supervisor itself is checked when it starts (`supervisor_start_problem`: also its
confinement, cgroups and namespaces) and on every spawn (`supervisor_problem`): still the
same process (its pidfd), not traced, not stopped, still non-dumpable (the entries of a
non-dumpable process's `/proc/<pid>` are owned by root).

Reads go through one `/proc/<pid>` directory fd (all from the same process); a process
that is gone raises ProcessLookupError. Cost: three small procfs reads and seven `stat`s,
about 0.1 ms.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from substrate.sandbox import parsers as P
from substrate.sandbox.facts import Fact, FactValue, Mismatch, compare
from substrate.sandbox.readings import facts, read_at

#: The `/proc/<pid>/status` facts every process of a sandbox shares with its init.
STATUS_FACTS = (
    "no_new_privs",
    "seccomp_mode",
    "cap_eff",
    "cap_prm",
    "cap_bnd",
    "cap_amb",
    "uid",
    "gid",
)
_STATUS_LINES = frozenset(
    {"NoNewPrivs", "Seccomp", "CapEff", "CapPrm", "CapBnd", "CapAmb", "Uid", "Gid"}
)
#: Namespaces compared with the init's (`/proc/<pid>/ns/<name>`).
NAMESPACES = ("pid", "mnt", "net", "ipc", "uts", "user", "cgroup")
#: What the per-command facts beyond the status ones must read.
SAME = "sandbox"
PARENT = "supervisor"


@dataclass(frozen=True)
class Baseline:
    """What every process of one sandbox must show (read when its supervisor starts)."""

    status: dict[str, FactValue]  # STATUS_FACTS, from the sandbox's verified facts
    cgroup: str  # the init's /proc/<pid>/cgroup text
    namespaces: tuple[int, ...]  # the init's namespace inodes, in NAMESPACES order


@dataclass(frozen=True)
class Reading:
    """One process as the host sees it (raw texts; pure helpers interpret them)."""

    status: str  # /proc/<pid>/status
    cgroup: str  # /proc/<pid>/cgroup
    namespaces: tuple[int, ...]  # inodes, in NAMESPACES order (-1 when unreadable)
    owner: int  # uid owning /proc/<pid>/fd: 0 for a non-dumpable process


def baseline(init_pid: int, sandbox_facts: Sequence[Fact]) -> Baseline:
    """The baseline of the sandbox whose init is `init_pid`. Blocking (procfs)."""
    seen = {f.name: f.value for f in sandbox_facts}
    reading = read_process(init_pid)
    return Baseline(
        status={name: seen.get(name) for name in STATUS_FACTS},
        cgroup=reading.cgroup,
        namespaces=reading.namespaces,
    )


def unverified_baseline(init_pid: int) -> Baseline:
    """What the init of a sandbox not verified yet (a warm pool member's) shows now, read
    from the host: the baseline its supervisor is started against while it waits. It is
    never the one a command is checked against: once the sandbox is verified for a
    workspace, its supervisor is checked again against `baseline` (`startup.warm_problem`).
    Blocking (procfs). Raises ProcessLookupError, and ValueError on a malformed status."""
    reading = read_process(init_pid)
    return Baseline(
        status=status_values(reading.status),
        cgroup=reading.cgroup,
        namespaces=reading.namespaces,
    )


def read_process(pid: int) -> Reading:
    """Read `pid` through one directory fd. Raises ProcessLookupError when it is gone."""
    try:
        dir_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}") from None
    try:
        # The directory keeps its owner; the entries in it belong to root once the
        # process is non-dumpable.
        owner = os.stat("fd", dir_fd=dir_fd, follow_symlinks=False).st_uid
        status = read_at(dir_fd, "status")
        cgroup = read_at(dir_fd, "cgroup")
        inodes = []
        for name in NAMESPACES:
            try:
                inodes.append(os.stat(f"ns/{name}", dir_fd=dir_fd).st_ino)
            except OSError:
                inodes.append(-1)
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} went away") from None
    finally:
        os.close(dir_fd)
    return Reading(status=status, cgroup=cgroup, namespaces=tuple(inodes), owner=owner)


def pidfd_pid(pidfd: int) -> int | None:
    """The host pid a pidfd refers to (its fdinfo `Pid:`); None once it was reaped."""
    try:
        fd = os.open(f"/proc/self/fdinfo/{pidfd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 4096).decode("ascii", "replace")
        finally:
            os.close(fd)
    except OSError:
        return None
    value = P.parse_status_field(text, "Pid")
    if value is None or not value.lstrip("-").isdigit() or int(value) <= 0:
        return None
    return int(value)


def status_fields(status_text: str) -> dict[str, str]:
    """A status text's lines as {key: value} (pure; one pass)."""
    out: dict[str, str] = {}
    for line in status_text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def status_values(status_text: str, fields: dict[str, str] | None = None) -> dict[str, FactValue]:
    """The STATUS_FACTS of a status text (pure; `fields`: its `status_fields`, when the
    caller has them). Raises ValueError when malformed or when a line is missing (a
    missing capability line must not read as "none")."""
    f = status_fields(status_text) if fields is None else fields
    missing = _STATUS_LINES - f.keys()
    if missing:
        raise ValueError("status lines missing: " + ", ".join(sorted(missing)))

    def ids(key: str) -> tuple[int, ...]:
        return tuple(int(v) for v in f[key].split())

    return {
        "no_new_privs": f["NoNewPrivs"] == "1",
        "seccomp_mode": int(f["Seccomp"]),
        "cap_eff": P.cap_names(int(f["CapEff"], 16)),
        "cap_prm": P.cap_names(int(f["CapPrm"], 16)),
        "cap_bnd": P.cap_names(int(f["CapBnd"], 16)),
        "cap_amb": P.cap_names(int(f["CapAmb"], 16)),
        "uid": P.one_id(ids("Uid")),
        "gid": P.one_id(ids("Gid")),
    }


def same_cgroup(text: str, base: str, leaf: str | None = None) -> bool:
    """Is `/proc/<pid>/cgroup` text `text` the sandbox's (`base`, the init's)? Either equal,
    text for text, or — `leaf` given: a held child moved ahead into the command cgroup the
    daemon made for it (docs/fast-exec.md "Held children") — equal on every line but one,
    which names `leaf` directly beneath the init's cgroup of that hierarchy (pure)."""
    if text == base:
        return True
    if leaf is None or "/" in leaf or not leaf:
        return False
    lines, want = text.splitlines(), base.splitlines()
    if len(lines) != len(want):
        return False
    differ = [(a, b) for a, b in zip(lines, want, strict=True) if a != b]
    if len(differ) != 1:
        return False
    seen, init = differ[0]
    return seen == (init if init.endswith("/") else init + "/") + leaf


def command_facts(
    reading: Reading,
    base: Baseline,
    *,
    supervisor_pid: int,
    reported_pid: int,
    leaf: str | None = None,
) -> list[Fact]:
    """The per-command facts of a held child (pure but for the clock in `observed_at`).

    `supervisor_pid`: the supervisor's host pid (the child's parent); `reported_pid`:
    the pid the supervisor reported, inside the sandbox's pid namespace (the last
    `NSpid` entry). A malformed status gives None values (never meets the baseline).
    """
    fields = status_fields(reading.status)
    try:
        values = status_values(reading.status, fields)
    except ValueError:
        values = dict.fromkeys(STATUS_FACTS)
    nspid = fields.get("NSpid", "").split()
    ours = fields.get("PPid") == str(supervisor_pid) and nspid[-1:] == [str(reported_pid)]
    now = time.time()
    status_source, cgroup_source, ns_source = (
        "kernel:proc-status",
        "kernel:proc-cgroup",
        "kernel:proc-ns",
    )
    return [
        *(Fact(name=n, value=v, source=status_source, observed_at=now) for n, v in values.items()),
        Fact(
            name="parent", value=PARENT if ours else "other", source=status_source, observed_at=now
        ),
        Fact(
            name="cgroup",
            value=SAME if same_cgroup(reading.cgroup, base.cgroup, leaf) else "other",
            source=cgroup_source,
            observed_at=now,
        ),
        Fact(
            name="namespaces",
            value=SAME if _same_namespaces(reading, base) else "other",
            source=ns_source,
            observed_at=now,
        ),
    ]


def required(base: Baseline) -> dict[str, FactValue]:
    """What a command's facts must read (pure)."""
    return {**base.status, "parent": PARENT, "cgroup": SAME, "namespaces": SAME}


def mismatches(found: Sequence[Fact], base: Baseline) -> list[Mismatch]:
    """The per-command facts that do not meet the baseline (pure)."""
    return compare(required(base), found)


def read_status(pid: int) -> tuple[str, int]:
    """(status text, owner of `/proc/<pid>/fd`) of `pid`: the per-spawn look at a
    supervisor. Raises ProcessLookupError when it is gone."""
    try:
        dir_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}") from None
    try:
        owner = os.stat("fd", dir_fd=dir_fd, follow_symlinks=False).st_uid
        return read_at(dir_fd, "status"), owner
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} went away") from None
    finally:
        os.close(dir_fd)


def supervisor_problem(status: str, owner: int, uid: int) -> str | None:
    """Why a running supervisor is not to be trusted now, or None (pure; every spawn).

    "exited" (a zombie), "traced" (a tracer is attached), "stopped" (SIGSTOP: it would
    not answer),
    "dumpable" (its `/proc` entries are owned by its own uid: it did not, or no longer,
    refuse ptrace and fd access to its uid; not checked for a root sandbox, where the
    owner says nothing).
    """
    tracer = P.parse_status_field(status, "TracerPid")
    if tracer not in (None, "0"):
        return "traced"
    state = (P.parse_status_field(status, "State") or "")[:1]
    if state in ("Z", "X"):
        return "exited"
    if state in ("T", "t"):
        return "stopped"
    if uid != 0 and owner != 0:
        return "dumpable"
    return None


def status_state(status: str) -> str:
    """The one-letter `State` of a status text ("" when it has none; pure)."""
    return (P.parse_status_field(status, "State") or "")[:1]


def read_state(pid: int) -> str:
    """The one-letter state of `pid` from `/proc/<pid>/stat` (one small read: the field
    after the command name, which ends at the last ")"). Raises ProcessLookupError when
    it is gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}") from None
    try:
        text = os.read(fd, 4096)
    except ProcessLookupError:
        raise
    except OSError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} went away") from None
    finally:
        os.close(fd)
    _, sep, rest = text.rpartition(b")")
    return rest[1:2].decode("ascii", "replace") if sep else ""


def held_state_problem(state: str) -> bool:
    """Is a held child in state `state` (`status_state`, `read_state`) stopped or
    exiting (T, t, Z, X), so that it would never exec? (Pure; its sandbox's code may
    stop or kill it.)"""
    return state[:1] in ("T", "t", "Z", "X")


def supervisor_start_problem(reading: Reading, base: Baseline, uid: int) -> str | None:
    """`supervisor_problem`, and at start also: "confinement" (status facts other than
    the baseline's), "cgroup", "namespaces" (pure)."""
    problem = supervisor_problem(reading.status, reading.owner, uid)
    if problem is not None:
        return problem
    try:
        values = status_values(reading.status)
    except ValueError:
        return "confinement"
    if compare(base.status, facts(values, "kernel:proc-status")):
        return "confinement"
    if reading.cgroup != base.cgroup:
        return "cgroup"
    if not _same_namespaces(reading, base):
        return "namespaces"
    return None


def _same_namespaces(reading: Reading, base: Baseline) -> bool:
    return -1 not in reading.namespaces and reading.namespaces == base.namespaces
