"""`Sandbox`: one container this daemon created and verified.

One container this daemon created and verified (`substrate.sandbox.containers` makes
them, the execution and terminal layers run commands in them; a working layer's
conclusion sees one as `substrate.layer.conclusion.LayerSandbox`).

Its own module, not `containers`': it is the value every user holds (the process layer,
terminals, `process.usage`, the supervisors through their `SandboxView`), with a life of
its own (its users counted, its facts replaced after a layer's swap), while `Containers`
is the cache and the pipeline that make and remove them; a user of the value need not
import the factory."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import trio

from substrate.layer.mounts import WorkingLayer
from substrate.sandbox import reaper
from substrate.sandbox.facts import Fact
from substrate.sandbox.profiles import Profile
from substrate.sandbox.proxy_link import ProxyLink
from substrate.sandbox.spec import RunAs
from substrate.workspace.homes import Home

__all__ = ["Sandbox"]


@dataclass
class Sandbox:
    """A verified container. `running` counts commands (and terminals) using it now."""

    id: str
    workspace: str
    #: The profile as its commands get it: with secrets, `env` holds their values
    #: (`profiles.with_secrets`). Never serialize it; `.name` is what records carry.
    profile: Profile
    #: The profile as declared when the sandbox was made (no secret values): a reload
    #: that changes it retires the sandbox (`Containers.retire`).
    declared: Profile
    who: RunAs
    init_pid: int
    init: Hashable  # the init's identity (`reaper.ProcInfo.ident`): pid reuse aside
    protected: frozenset[int]
    cgroups: reaper.CgroupDirs
    facts: list[Fact]
    host_visible: bool
    running: int = 0
    acquired: int = 0  # users it ever had: a change tells that one came and went
    #: Of those, commands (the others are terminals); and whether any command's program
    #: was started in it yet. While every user was a command and none started, no code
    #: of the sandbox's has run in it (gVisor's stream start relies on that).
    command_users: int = 0
    code_started: bool = False
    last_used: float = field(default_factory=time.monotonic)
    #: Workspace-relative paths mounted read-only over the workspace → (st_dev, st_ino).
    readonly: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: The working layer of a `workspace = "layer"` sandbox (None for the others).
    layer: WorkingLayer | None = None
    egress: ProxyLink | None = None  # a `network = "egress"` sandbox's link to the proxy
    #: The persistent home bound at /home/agent (None: this daemon keeps none).
    home: Home | None = None
    #: `SecretStore.version` of the secrets in `profile.env` when they were read.
    secrets_version: tuple[object, ...] = ()

    def acquire(self, *, command: bool = False) -> None:
        """Count a user (a command, a terminal): never idle-reaped, never `alone`."""
        self.running += 1
        self.acquired += 1
        self.command_users += command
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.running -= 1
        self.last_used = time.monotonic()

    async def kill_left(self, limiter: trio.CapacityLimiter | None = None) -> int:
        """Kill every unprotected process left in the container (`reaper.kill_all`): for
        a working layer whose generation's users all ended, none of it is anyone's now.
        Returns how many were found; 0 when the host cannot see its processes (gVisor).
        The usual case, nothing left, is one read of its cgroup on the event loop."""
        if not self.host_visible or not reaper.everything(self.cgroups, self.protected):
            return 0
        return await reaper.kill_all(self.cgroups, self.protected, limiter=limiter)
