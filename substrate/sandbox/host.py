"""What the daemon reads from the host kernel about a started sandbox container.

`Containers` verifies a container through a `SandboxHost`: its confinement facts (from
`substrate.sandbox.observe`), the identity of its init (a restarted container is a
different process), its cgroup directories and the init's keep-alive child (both for
`substrate.sandbox.reaper`). `HostKernel` reads the real kernel; the in-memory
`substrate.sandbox.fake_engine.FakeHost` answers for tests of the container logic.

Every method blocks (procfs, cgroupfs, netlink): callers use worker threads, except for
`identity`, a few small procfs reads.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

from substrate.sandbox import observe, reaper
from substrate.sandbox.facts import Fact
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import HOME_TARGET, WORKSPACE_TARGET


class SandboxHost(Protocol):
    """The host's view of a started sandbox container."""

    def observe(
        self,
        init_pid: int,
        inspect: Mapping[str, Any],
        profile: Profile,
        readonly_dirs: Sequence[str],
        *,
        home: bool = False,
    ) -> list[Fact]:
        """Every confinement fact of the container whose init is `init_pid`, with the
        identities of its workspace mounts (and of its persistent home, with `home`).
        Raises ProcessLookupError when it is gone."""
        ...

    def observe_mounts(
        self, init_pid: int, readonly_dirs: Sequence[str], *, engine_ok: bool
    ) -> list[Fact]:
        """The facts of a working layer sandbox that a swap of its generation can change:
        the mount facts and the workspace identities (`observe.observe_mounts`,
        `observe.identities`). Raises ProcessLookupError when it is gone."""
        ...

    def identity(self, pid: int) -> Hashable | None:
        """The identity of host process `pid` (None if it is gone): equal for one process
        only, whatever reuses its pid (`reaper.ProcInfo.ident`)."""
        ...

    def cgroups(self, pid: int) -> reaper.CgroupDirs:
        """The cgroup directories of process `pid`. Raises OSError when it is gone."""
        ...

    def children_in(self, cgroups: reaper.CgroupDirs, pid: int) -> set[int]:
        """The children of `pid` in `cgroups` (the init's keep-alive), as host pids."""
        ...


class HostKernel:
    """The real host: procfs, cgroupfs, the container's network namespace."""

    def observe(
        self,
        init_pid: int,
        inspect: Mapping[str, Any],
        profile: Profile,
        readonly_dirs: Sequence[str],
        *,
        home: bool = False,
    ) -> list[Fact]:
        """`observe.observe` plus `observe.identities` (about 2 ms of CPU)."""
        found = observe.observe(
            init_pid,
            inspect,
            workspace_target=WORKSPACE_TARGET,
            layer=profile.workspace == "layer",
        )
        mounted = profile.workspace != "none"
        if mounted or home:
            found += observe.identities(
                init_pid,
                readonly_dirs,
                runtime=profile.runtime,
                workspace_target=WORKSPACE_TARGET if mounted else None,
                home_target=HOME_TARGET if home else None,
            )
        return found

    def observe_mounts(
        self, init_pid: int, readonly_dirs: Sequence[str], *, engine_ok: bool
    ) -> list[Fact]:
        found = observe.observe_mounts(
            init_pid, engine_ok=engine_ok, workspace_target=WORKSPACE_TARGET, layer=True
        )
        return found + observe.identities(
            init_pid, readonly_dirs, runtime="runc", workspace_target=WORKSPACE_TARGET
        )

    def identity(self, pid: int) -> Hashable | None:
        return reaper.identity(pid)

    def cgroups(self, pid: int) -> reaper.CgroupDirs:
        return reaper.CgroupDirs.of_pid(pid)

    def children_in(self, cgroups: reaper.CgroupDirs, pid: int) -> set[int]:
        infos = (reaper.read_proc(p) for p in reaper.cgroup_pids(cgroups))
        return {i.pid for i in infos if i is not None and i.ppid == pid}
