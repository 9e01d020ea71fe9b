"""Sandbox containers: one per (workspace, profile), made from the profile only, verified
from the kernel before anything runs in it.

Theory of operation. `Containers.ensure(ws, profile)` returns a `Sandbox`, a container
this daemon created and verified, cached until it is idle for `container_idle_s`, its
workspace is released, or the daemon stops. On a cache miss it:

1. decides who runs (docs/protocol.md §5 "Who runs"): the uid:gid owning the workspace root (read
   now from the held root fd) or the profile's `UID:GID`; root only with `allow_root`;
2. checks the runtime is registered and the image is present (never pulled);
3. removes any container carrying this daemon's labels for the same pair that it did not
   create itself: one with weaker settings is reported as `confinement_unmet` (and
   removed, so the next call starts clean); one that looks right is still never reused;
4. creates the container from the profile alone (`container_spec`, pure), keeps it alive
   with the engine's init and `sleep infinity`, and starts it;
5. observes the confinement facts from outside (`substrate.sandbox.observe`: procfs,
   cgroups, netns, inspect) plus the identity (st_dev, st_ino) of `/workspace` and of every
   read-only directory as the container's own root sees them, against the held fds, and
   compares them with the required facts (`substrate.sandbox.facts`). Any mismatch removes the
   container and raises `confinement_unmet` with what was required and what was seen.
   The facts are journalled (`proc.facts`) and returned with every command's result.

What is mounted read-only over the workspace (every `.git`, the policy's whole-directory
denies) and the empty resolver file are `substrate.sandbox.mounts`'. What the host kernel
shows of a started container comes through a `SandboxHost` (`substrate.sandbox.host`);
tests of this logic give it `substrate.sandbox.fake_engine`'s fakes.

On a cache hit the only check is that the container's init is still the same process
(its pid and start time, from procfs: tens of microseconds): a restarted or replaced
container is verified again from scratch. Settings changed on a running container through the
engine (`docker update`) are not re-observed per command; that needs engine access,
which is root-equivalent anyway (docs/execution.md).

Labels: `substrate.daemon` (this state dir's daemon id), `substrate.epoch`,
`substrate.workspace`, `substrate.profile`, `substrate.config` (SHA-256 of the create
request, labels aside). At start, every container labelled with our daemon id is
removed: it belongs to a previous run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from substrate.errors import ConfinementUnmet, Refusal, RuntimeUnavailable
from substrate.sandbox import facts as factlib
from substrate.sandbox import (
    layers,
    mounts,
    passthrough,
    profiles,
    reaper,
    seccomp,
    working_layer,
)
from substrate.sandbox.engine import ContainerGone, Engine
from substrate.sandbox.facts import Fact, FactValue
from substrate.sandbox.host import HostKernel, SandboxHost
from substrate.sandbox.layer_plan import layers_dir
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import (
    HOST_VISIBLE_RUNTIMES,
    LABEL_CONFIG,
    LABEL_DAEMON,
    LABEL_EPOCH,
    LABEL_PROFILE,
    LABEL_WORKSPACE,
    RunAs,
    container_spec,
    run_as,
    spec_digest,
)
from substrate.sandbox.supervisor.supervisors import Supervisors, supervised
from substrate.sandbox.working_layer import WorkingLayer
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace

__all__ = ["LABEL_DAEMON", "LABEL_EPOCH", "Containers", "Sandbox", "daemon_id_for"]

log = logging.getLogger("substrate.sandbox.containers")


@dataclass
class Sandbox:
    """A verified container. `running` counts commands (and terminals) using it now."""

    id: str
    workspace: str
    profile: Profile
    who: RunAs
    init_pid: int
    init: Hashable  # the init's identity (`reaper.ProcInfo.ident`): pid reuse aside
    protected: frozenset[int]
    cgroups: reaper.CgroupDirs
    facts: list[Fact]
    host_visible: bool
    running: int = 0
    last_used: float = field(default_factory=time.monotonic)
    #: Workspace-relative paths mounted read-only over the workspace → (st_dev, st_ino).
    readonly: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: The working layer of a `workspace = "layer"` sandbox (None for the others).
    layer: WorkingLayer | None = None

    def acquire(self) -> None:
        """Count a user (a command, a terminal): never idle-reaped, never `alone`."""
        self.running += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.running -= 1
        self.last_used = time.monotonic()


class Containers:
    """The live sandboxes of this daemon, keyed by (workspace, profile)."""

    def __init__(
        self,
        engine: Engine,
        journal: Journal,
        *,
        daemon_id: str,
        epoch: int,
        seccomp_dir: Path,
        idle_s: float,
        fs_limiter: trio.CapacityLimiter | None = None,
        files_dir: Path | None = None,
        host: SandboxHost | None = None,
        state_dir: str | None = None,
        supervisors: Supervisors | None = None,
    ) -> None:
        self._engine = engine
        self._host: SandboxHost = host if host is not None else HostKernel()
        self._journal = journal
        self.daemon_id = daemon_id
        self._epoch = epoch
        self._seccomp_dir = seccomp_dir
        # Files the daemon binds into sandboxes (the empty resolv.conf); None: none bound.
        self._files_dir = files_dir
        self.idle_s = idle_s
        self._fs_limiter = fs_limiter
        self._live: dict[tuple[str, str], Sandbox] = {}
        self._locks: dict[tuple[str, str], trio.Lock] = {}
        # Working layers live under the state dir; None: "layer" profiles are refused.
        self._state_dir = state_dir
        # Set once a previous run's layer mounts are swept: no layer is made before.
        self._layers_swept = trio.Event()
        # Each runc sandbox's supervisor directory is bound in (docs/fast-exec.md).
        self._supervisors = supervisors

    # -- lookup --------------------------------------------------------------------------

    def labels_for(self, workspace: str, profile: str) -> dict[str, str]:
        """The labels that mark a container as this daemon's, for one (workspace, profile)."""
        return {
            LABEL_DAEMON: self.daemon_id,
            LABEL_WORKSPACE: workspace,
            LABEL_PROFILE: profile,
        }

    def cached(self, workspace: str, profile: str) -> Sandbox | None:
        return self._live.get((workspace, profile))

    def live(self) -> list[Sandbox]:
        return list(self._live.values())

    async def ensure(self, ws: Workspace, profile: Profile) -> Sandbox:
        """The verified sandbox for (ws, profile), created and verified on first use.

        Refuses `confinement_unmet` (root owner without allow_root; a fact that does not
        hold; a labelled container with weaker settings), `runtime_unavailable`,
        `image_missing`. A warm call costs one procfs read; a cold one a container start
        and a fact check (a few hundred milliseconds).
        """
        key = (ws.id, profile.name)
        found = self._live.get(key)
        if found is not None and self._alive(found):
            found.last_used = time.monotonic()
            return found
        lock = self._locks.setdefault(key, trio.Lock())
        async with lock:
            found = self._live.get(key)
            if found is not None:
                if self._alive(found):
                    return found
                await self._drop(found, "init_changed")
            sandbox = await self._create_verified(ws, profile)
            self._live[key] = sandbox
            return sandbox

    def _alive(self, sandbox: Sandbox) -> bool:
        """Is the container's init still the process we verified? (procfs, microseconds)"""
        return self._host.identity(sandbox.init_pid) == sandbox.init

    async def forget(self, sandbox: Sandbox, reason: str) -> None:
        """Remove a sandbox that stopped working (its container went away under us)."""
        async with self._locks.setdefault((sandbox.workspace, sandbox.profile.name), trio.Lock()):
            if self._live.get((sandbox.workspace, sandbox.profile.name)) is sandbox:
                await self._drop(sandbox, reason)

    async def _drop(self, sandbox: Sandbox, reason: str) -> None:
        self._live.pop((sandbox.workspace, sandbox.profile.name), None)
        try:
            await self._engine.remove(sandbox.id)
        finally:
            if sandbox.layer is not None:
                await self._close_layer(sandbox.layer)
            if self._supervisors is not None:
                await self._supervisors.detach(sandbox.id)
        await self._journal_async(
            "container.removed",
            {"container": sandbox.id[:12], "profile": sandbox.profile.name, "reason": reason},
            sandbox.workspace,
        )

    # -- creation and verification -----------------------------------------------------------

    async def _create_verified(self, ws: Workspace, profile: Profile) -> Sandbox:
        owner = await trio.to_thread.run_sync(os.fstat, ws.root_fd, limiter=self._fs_limiter)
        who = run_as(profile, owner.st_uid, owner.st_gid)
        if profile.runtime != "runc":
            await self._engine.require_runtime(profile.runtime)
        image_id = await self._engine.image_id(profile.image)
        security_opt = await trio.to_thread.run_sync(
            _security_opts, profile, self._seccomp_dir, limiter=self._fs_limiter
        )
        ro_dirs = await trio.to_thread.run_sync(
            mounts.readonly_paths, ws, profile, limiter=self._fs_limiter
        )
        layer = None
        if profile.workspace == "layer":
            passthrough.check_policy(ws.policy, profile.passthrough)
            layer = await self._open_layer(ro_dirs, profile.passthrough)
        try:
            return await self._create_in(
                ws, profile, owner, who, image_id, security_opt, ro_dirs, layer
            )
        except BaseException:
            if layer is not None:
                await self._close_layer(layer)
            raise

    async def _create_in(
        self,
        ws: Workspace,
        profile: Profile,
        owner: os.stat_result,
        who: RunAs,
        image_id: str,
        security_opt: list[str],
        ro_dirs: list[tuple[str, tuple[int, int]]],
        layer: WorkingLayer | None,
    ) -> Sandbox:
        required = factlib.required_facts(
            profile,
            run_uid=who.uid,
            run_gid=who.gid,
            workspace_mode=profile.workspace,
            readonly_dirs=[rel for rel, _ in ro_dirs],
            seccomp_expected=profile.seccomp != "engine-default",
            image_id=image_id,
            security_opt=security_opt,
        )
        if layer is None:
            required.update(mounts.identity_required(profile, ro_dirs, owner))
        else:
            layer.required = dict(required)
        ro_rels = [rel for rel, _ in ro_dirs]
        await self._remove_foreign(ws, profile, required, ro_rels)
        resolv_conf = None
        if self._files_dir is not None:
            resolv_conf = await trio.to_thread.run_sync(
                mounts.empty_resolv_conf, self._files_dir, limiter=self._fs_limiter
            )

        spec = container_spec(
            profile,
            who=who,
            workspace_source=ws.host_path if layer is None else layer.plan.base,
            readonly_dirs=ro_rels if layer is None else [],
            security_opt=security_opt,
            resolv_conf=resolv_conf,
        )
        labels = {
            **self.labels_for(ws.id, profile.name),
            LABEL_EPOCH: str(self._epoch),
            LABEL_CONFIG: spec_digest(spec),
        }
        name = f"substrate-{ws.id}-{profile.name}-{secrets.token_hex(3)}"
        slot = None
        if self._supervisors is not None and supervised(profile):
            slot = await trio.to_thread.run_sync(self._supervisors.prepare, who)
            spec["host_config"]["mounts"].append(slot.mount)  # after the digest: a fresh dir
        try:
            container = await self._engine.create_container(name=name, labels=labels, **spec)
        except BaseException:
            if slot is not None:
                slot.discard()
            raise
        try:
            try:
                await self._engine.start(container)
                if layer is not None:
                    # Only now: the container bound the base with nothing on it, so every
                    # generation mounted from here on reaches it (docs/working-layer-mounts.md).
                    await trio.to_thread.run_sync(
                        working_layer.mount_first, layer, ws.root_fd, limiter=self._fs_limiter
                    )
                    required = {**required, **await self._layer_identities(layer)}
                sandbox = await self._verify(container, ws, profile, who, required, dict(ro_dirs))
                sandbox.layer = layer
                if slot is not None and self._supervisors is not None:
                    self._supervisors.attach(slot, sandbox)
                return sandbox
            except (ContainerGone, ProcessLookupError):
                raise RuntimeUnavailable(
                    f"the sandbox of profile {profile.name!r} did not stay up (its image "
                    "needs `sleep` accepting `infinity`)"
                ) from None
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._engine.remove(container)
                if slot is not None:
                    slot.discard()
            raise

    async def _verify(
        self,
        container: str,
        ws: Workspace,
        profile: Profile,
        who: RunAs,
        required: Mapping[str, FactValue],
        readonly: dict[str, tuple[int, int]],
    ) -> Sandbox:
        inspect = await self._engine.inspect(container)
        init_pid = int(inspect["State"]["Pid"] or 0)
        if not inspect["State"].get("Running") or init_pid <= 0:
            raise ContainerGone(container)
        observed = await self._observe(init_pid, inspect, profile, list(readonly))
        await self._check(container, ws, profile, required, observed)
        init = self._host.identity(init_pid)
        if init is None:
            raise ContainerGone(container)
        host_visible = profile.runtime in HOST_VISIBLE_RUNTIMES
        cgroups = await trio.to_thread.run_sync(self._host.cgroups, init_pid)
        protected = {init_pid}
        if host_visible:
            protected |= await self._keepalive_pids(cgroups, init_pid)
        sandbox = Sandbox(
            id=container,
            workspace=ws.id,
            profile=profile,
            who=who,
            init_pid=init_pid,
            init=init,
            protected=frozenset(protected),
            cgroups=cgroups,
            facts=observed,
            host_visible=host_visible,
            readonly=readonly,
        )
        await self._journal_async(
            "proc.facts",
            {
                "container": container[:12],
                "profile": profile.name,
                "image": str(inspect.get("Image", "")),
                "ok": True,
                "facts": [msgspec.to_builtins(f) for f in observed],
            },
            ws.id,
        )
        return sandbox

    async def _observe(
        self, init_pid: int, inspect: dict[str, Any], profile: Profile, ro_rels: Sequence[str]
    ) -> list[Fact]:
        return await trio.to_thread.run_sync(
            self._host.observe, init_pid, inspect, profile, ro_rels, limiter=self._fs_limiter
        )

    async def _keepalive_pids(self, cgroups: reaper.CgroupDirs, init_pid: int) -> set[int]:
        """The init's keep-alive child (it may take a moment to appear after start)."""
        with trio.move_on_after(2.0):
            while True:
                found = await trio.to_thread.run_sync(self._host.children_in, cgroups, init_pid)
                if found:
                    return found
                await trio.sleep(0.005)
        return set()

    async def _check(
        self,
        container: str,
        ws: Workspace,
        profile: Profile,
        required: Mapping[str, FactValue],
        observed: list[Fact],
    ) -> None:
        """Raise `confinement_unmet` (journalled) when an observed fact is not the required one."""
        mismatches = factlib.compare(required, observed)
        if not mismatches:
            return
        data = {
            "container": container[:12],
            "profile": profile.name,
            "ok": False,
            "mismatches": [msgspec.to_builtins(m) for m in mismatches],
        }
        await self._journal_async("proc.facts", data, ws.id)
        raise ConfinementUnmet(
            f"the sandbox for profile {profile.name!r} does not meet "
            f"{len(mismatches)} required fact(s): "
            + ", ".join(factlib.mismatch_name(m) for m in mismatches[:8]),
            **factlib.mismatch_report(mismatches),
        )

    async def _remove_foreign(
        self,
        ws: Workspace,
        profile: Profile,
        required: Mapping[str, FactValue],
        ro_rels: Sequence[str],
    ) -> None:
        """Containers labelled as ours for this pair that we did not create: never reused."""
        mine = {s.id for s in self._live.values()}
        for entry in await self._engine.list_labelled(self.labels_for(ws.id, profile.name)):
            container = str(entry["Id"])
            if container in mine:
                continue
            refusal: Refusal | None = None
            if entry.get("State") == "running":
                try:
                    inspect = await self._engine.inspect(container)
                    pid = int(inspect["State"]["Pid"] or 0)
                    observed = await self._observe(pid, inspect, profile, ro_rels)
                    await self._check(container, ws, profile, required, observed)
                except ConfinementUnmet as exc:
                    refusal = exc
                except (ContainerGone, OSError):
                    pass
            await self._engine.remove(container)
            await self._journal_async(
                "container.removed",
                {
                    "container": container[:12],
                    "profile": profile.name,
                    "reason": "weaker" if refusal is not None else "foreign",
                },
                ws.id,
            )
            if refusal is not None:
                raise refusal

    # -- working layers ------------------------------------------------------------------------

    async def _open_layer(
        self, ro_dirs: list[tuple[str, tuple[int, int]]], passthrough_dirs: list[str]
    ) -> WorkingLayer:
        if self._state_dir is None:
            raise RuntimeUnavailable("this daemon keeps no working layers")
        await self._layers_swept.wait()
        return await trio.to_thread.run_sync(
            working_layer.open_layer,
            self._state_dir,
            ro_dirs,
            passthrough_dirs,
            limiter=self._fs_limiter,
        )

    async def _close_layer(self, layer: WorkingLayer) -> None:
        # Shielded: a layer left mounted would outlive its sandbox until the next start.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(working_layer.close, layer, limiter=self._fs_limiter)

    async def _layer_identities(self, layer: WorkingLayer) -> dict[str, FactValue]:
        return await trio.to_thread.run_sync(
            working_layer.identity_required, layer, limiter=self._fs_limiter
        )

    async def reverify_layer(self, sandbox: Sandbox, ws: Workspace) -> None:
        """After a swap: observe the sandbox's facts again and require the identities of
        the generation mounted now. Refuses `confinement_unmet` (journalled) on a
        mismatch; the caller then drops the sandbox. Cost: an engine inspect and one
        observation (a few milliseconds)."""
        layer = sandbox.layer
        if layer is None:
            return
        required = {**layer.required, **await self._layer_identities(layer)}
        inspect = await self._engine.inspect(sandbox.id)
        observed = await self._observe(
            sandbox.init_pid, inspect, sandbox.profile, list(sandbox.readonly)
        )
        await self._check(sandbox.id, ws, sandbox.profile, required, observed)
        sandbox.facts = observed

    async def sweep_layers(self) -> None:
        """At start, after `reap_previous`: unmount every layer mount a previous run left
        (`layers.sweep`); until this ran, no layer sandbox is made. Also at shutdown,
        after `remove_all` (the layer directory's own self-bind goes too). A failure is
        logged (a leftover still in use stays mounted; new layers get new directories)."""
        try:
            if self._state_dir is not None:
                gone = await trio.to_thread.run_sync(
                    layers.sweep, layers_dir(self._state_dir), limiter=self._fs_limiter
                )
                if gone:
                    await self._journal_async("layer.swept", {"mounts": len(gone)}, None)
        except OSError as exc:
            log.error("sweeping a previous run's layer mounts failed: %s", exc)
        finally:
            self._layers_swept.set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def reap_previous(self) -> int:
        """At start: remove every container of an earlier run of this daemon (its epoch)."""
        gone = 0
        for entry in await self._engine.list_labelled({LABEL_DAEMON: self.daemon_id}):
            # Only earlier epochs: one of ours may be being created right now.
            if (entry.get("Labels") or {}).get(LABEL_EPOCH) == str(self._epoch):
                continue
            await self._engine.remove(str(entry["Id"]))
            gone += 1
        if gone:
            await self._journal_async("container.reaped", {"containers": gone}, None)
        return gone

    async def reap_idle(self, now: float | None = None) -> int:
        """Remove sandboxes unused for `idle_s` with nothing running in them."""
        now = time.monotonic() if now is None else now
        removed = 0
        for sandbox in list(self._live.values()):
            if sandbox.running == 0 and now - sandbox.last_used >= self.idle_s:
                await self.forget(sandbox, "idle")
                removed += 1
        return removed

    async def release_workspace(self, workspace: str) -> None:
        """Remove every sandbox of `workspace` (its commands die with it)."""
        for sandbox in list(self._live.values()):
            if sandbox.workspace == workspace:
                await self.forget(sandbox, "released")

    async def remove_all(self, reason: str) -> None:
        for sandbox in list(self._live.values()):
            await self.forget(sandbox, reason)

    async def _journal_async(self, kind: str, data: dict[str, Any], workspace: str | None) -> None:
        await trio.to_thread.run_sync(lambda: self._journal.append(kind, data, workspace=workspace))


def _security_opts(profile: Profile, seccomp_dir: Path) -> list[str]:
    try:
        return profiles.security_opts(profile, seccomp_dir)
    except seccomp.SeccompError as exc:
        # The policy file went bad since the profile was loaded: nothing may run under it.
        # The reason names a host path: it goes to the log, not to the client.
        log.error("profile %s: seccomp policy no longer loads: %s", profile.name, exc)
        raise ConfinementUnmet(
            f"the seccomp policy of profile {profile.name!r} no longer loads (see the log)",
            required={"seccomp": profile.seccomp},
            observed={"seccomp": "invalid"},
        ) from None


def daemon_id_for(state_dir: os.PathLike[str] | str) -> str:
    """A stable id for the daemon owning `state_dir` (device, inode and path)."""
    st = os.stat(state_dir)
    raw = f"{st.st_dev}:{st.st_ino}:{os.fspath(state_dir)}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]
