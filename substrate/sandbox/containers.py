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
denies) and the empty resolver file are `substrate.sandbox.mounts`'; the persistent home
(bound at /home/agent, its `home_identity` required) and the secrets (in
`Sandbox.profile.env` only, per exec) are `substrate.sandbox.environment`'s. What the host kernel
shows of a started container comes through a `SandboxHost` (`substrate.sandbox.host`);
tests of this logic give it `substrate.sandbox.fake_engine`'s fakes.

A profile reload retires the sandboxes of changed profiles (`retire`): their commands
go on, new ones get a sandbox of the new profile. On a cache hit the only check is that
the container's init is still the same process
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

import functools
import logging
import os
import secrets
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from substrate.errors import ConfinementUnmet, Refusal, RuntimeUnavailable
from substrate.layer.mounts import LayerMounts, WorkingLayer, passthrough, working_layer
from substrate.sandbox import facts as factlib
from substrate.sandbox import mounts, profiles, proxy_link, reaper
from substrate.sandbox.engine import ContainerGone, Engine
from substrate.sandbox.environment import SandboxEnvironment
from substrate.sandbox.facts import Fact, FactValue
from substrate.sandbox.host import HostKernel, SandboxHost
from substrate.sandbox.profiles import Profile
from substrate.sandbox.proxy_link import ProxyLink, ProxyLinks
from substrate.sandbox.sandboxes import Sandbox
from substrate.sandbox.spec import (
    HOST_VISIBLE_RUNTIMES,
    LABEL_CONFIG,
    LABEL_DAEMON,
    LABEL_EPOCH,
    LABEL_PROFILE,
    LABEL_WORKSPACE,
    RunAs,
    container_spec,
    daemon_id_for,
    run_as,
    spec_digest,
)
from substrate.sandbox.supervisor.supervisors import Supervisors, supervised
from substrate.secrets import SecretStore
from substrate.store.journal import Journal
from substrate.workspace.homes import Home, Homes
from substrate.workspace.registry import Workspace

__all__ = ["LABEL_DAEMON", "LABEL_EPOCH", "Containers", "Sandbox", "daemon_id_for"]

log = logging.getLogger("substrate.sandbox.containers")


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
        egress: ProxyLinks | None = None,
        homes: Homes | None = None,
        secrets: SecretStore | None = None,
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
        #: Sandboxes of a profile that changed (`retire`): no new command enters them;
        #: the commands they run keep running, and each goes once nothing runs in it.
        self._retired: list[Sandbox] = []
        self._locks: dict[tuple[str, str], trio.Lock] = {}
        # Working layers live under the state dir; None: "layer" profiles are refused.
        self.layer_mounts = LayerMounts(state_dir, fs_limiter, self._journal_async)
        self._egress = egress  # links egress sandboxes to the proxy; None: they are refused
        #: Secrets and persistent homes (either None: see `SandboxEnvironment`).
        self.environment = SandboxEnvironment(homes, secrets, fs_limiter)
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
        """Every sandbox this daemon holds, retired ones included."""
        return [*self._live.values(), *self._retired]

    async def ensure(self, ws: Workspace, profile: Profile) -> Sandbox:
        """The verified sandbox for (ws, profile), created and verified on first use.

        Refuses `confinement_unmet` (root owner without allow_root; a fact that does not
        hold; a labelled container with weaker settings), `runtime_unavailable`,
        `image_missing`, `secret_unknown` (a secret the profile names is not set),
        `limit_exceeded` (its home is over `home_quota_bytes`). A warm
        call costs one procfs read (and one lstat per secret of the profile); a cold one a
        container start and a fact check (a few hundred milliseconds).
        """
        key = (ws.id, profile.name)
        found = self._live.get(key)
        if found is None or found.declared != profile or not self._alive(found):
            async with self._locks.setdefault(key, trio.Lock()):
                found = self._live.get(key)
                if found is not None and found.declared != profile:
                    await self._retire(found)  # reloaded: nothing new runs under the old one
                    found = None
                if found is not None and not self._alive(found):
                    await self._drop(found, "init_changed")
                    found = None
                if found is None:
                    found = self._live[key] = await self._create_verified(ws, profile)
                    return found
        found.last_used = time.monotonic()
        if self.environment.secrets_changed(profile, found.secrets_version):
            # Set again or removed since they were read (`secret_unknown` once removed).
            found.profile, found.secrets_version = await self.environment.load_secrets(profile)
        await self.environment.check_home(found.home)
        return found

    def _alive(self, sandbox: Sandbox) -> bool:
        """Is the container's init still the process we verified? (procfs, microseconds)"""
        return self._host.identity(sandbox.init_pid) == sandbox.init

    async def forget(self, sandbox: Sandbox, reason: str) -> None:
        """Remove a sandbox that stopped working (its container went away under us)."""
        async with self._locks.setdefault((sandbox.workspace, sandbox.profile.name), trio.Lock()):
            key = (sandbox.workspace, sandbox.profile.name)
            if self._live.get(key) is sandbox or sandbox in self._retired:
                await self._drop(sandbox, reason)

    async def retire(self, profile_names: Collection[str]) -> int:
        """After a profile reload: `profile_names`' sandboxes take no new command; idle ones
        go now, busy ones once idle (`reap_idle`). Returns how many; waits for any being made."""
        keys = {k for k in (*self._live, *self._locks) if k[1] in set(profile_names)}
        retired = 0
        for key in sorted(keys):
            async with self._locks.setdefault(key, trio.Lock()):
                if (found := self._live.get(key)) is not None:
                    await self._retire(found)
                    retired += 1
        return retired

    async def _retire(self, sandbox: Sandbox) -> None:
        self._live.pop((sandbox.workspace, sandbox.profile.name), None)
        if sandbox.running == 0:
            await self._drop(sandbox, "profile_changed")
        elif sandbox not in self._retired:
            self._retired.append(sandbox)

    async def _drop(self, sandbox: Sandbox, reason: str) -> None:
        if self._live.get(key := (sandbox.workspace, sandbox.profile.name)) is sandbox:
            del self._live[key]
        if sandbox in self._retired:
            self._retired.remove(sandbox)
        try:
            await self._engine.remove(sandbox.id)
        finally:
            if sandbox.egress is not None:
                await sandbox.egress.aclose()
            if sandbox.layer is not None:
                await self.layer_mounts.close(sandbox.layer)
            if self._supervisors is not None:
                await self._supervisors.detach(sandbox.id)
        await self._journal_async(
            "container.removed",
            {"container": sandbox.id[:12], "profile": sandbox.profile.name, "reason": reason},
            sandbox.workspace,
        )

    # -- creation and verification -----------------------------------------------------------

    async def _create_verified(self, ws: Workspace, profile: Profile) -> Sandbox:
        # First: a missing secret refuses before anything is made.
        exec_profile, secrets_version = await self.environment.load_secrets(profile)
        owner = await trio.to_thread.run_sync(os.fstat, ws.root_fd, limiter=self._fs_limiter)
        who = run_as(profile, owner.st_uid, owner.st_gid)
        if profile.runtime != "runc":
            await self._engine.require_runtime(profile.runtime)
        image_id = await self._engine.image_id(profile.image)
        security_opt = await trio.to_thread.run_sync(
            profiles.checked_security_opts, profile, self._seccomp_dir, limiter=self._fs_limiter
        )
        ro_dirs = await trio.to_thread.run_sync(
            mounts.readonly_paths, ws, profile, limiter=self._fs_limiter
        )
        home = await self.environment.prepare_home(ws, who, profile)
        await self.environment.check_home(home)  # over its quota: nothing is made
        layer = None
        if profile.workspace == "layer":
            passthrough.check_policy(ws.policy, profile.passthrough)
            layer = await self.layer_mounts.open(ro_dirs, profile.passthrough)
        try:
            sandbox = await self._create_in(
                ws, profile, owner, who, image_id, security_opt, ro_dirs, layer, home
            )
        except BaseException:
            if layer is not None:
                await self.layer_mounts.close(layer)
            raise
        sandbox.profile, sandbox.secrets_version = exec_profile, secrets_version
        return sandbox

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
        home: Home | None,
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
        ro_rels = [rel for rel, _ in ro_dirs]
        if home is not None:
            required["home_identity"] = f"{home.identity[0]}:{home.identity[1]}"
        if layer is None:
            required.update(mounts.identity_required(profile, ro_dirs, owner))
        await self._remove_foreign(ws, profile, required, ro_rels)
        ca_bundle, egress_required = await proxy_link.prepare(self._egress, profile)
        required.update(egress_required)
        if layer is not None:
            layer.required = dict(required)
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
            ca_bundle=ca_bundle,
            home_source=None if home is None else home.source,
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
        links: list[ProxyLink] = []  # an egress sandbox's, closed if it does not verify
        try:
            try:
                await self._engine.start(container)
                if layer is not None:
                    # Only now: the container bound the base with nothing on it, so every
                    # generation mounted from here on reaches it (docs/working-layer-mounts.md).
                    await trio.to_thread.run_sync(
                        working_layer.mount_first, layer, ws.root_fd, limiter=self._fs_limiter
                    )
                    required = {**required, **await self.layer_mounts.identities(layer)}
                sandbox = await self._verify(
                    container, ws, profile, who, required, dict(ro_dirs), home, links
                )
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
                for link in links:
                    await link.aclose()
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
        home: Home | None,
        links: list[ProxyLink],  # gets an egress sandbox's link (closed by the caller)
    ) -> Sandbox:
        inspect = await self._engine.inspect(container)
        init_pid = int(inspect["State"]["Pid"] or 0)
        if not inspect["State"].get("Running") or init_pid <= 0:
            raise ContainerGone(container)
        observed = await self._observe(init_pid, inspect, profile, list(readonly))
        observed += await proxy_link.link(
            self._egress, links, container, ws.id, profile, init_pid, required
        )
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
            declared=profile,
            who=who,
            init_pid=init_pid,
            init=init,
            protected=frozenset(protected),
            cgroups=cgroups,
            facts=observed,
            host_visible=host_visible,
            readonly=readonly,
            egress=links[0] if links else None,
            home=home,
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
        # Every sandbox of a daemon keeping homes has one: its identity is a fact.
        observe = self._host.observe
        if self.environment.homes is not None:
            observe = functools.partial(observe, home=True)
        return await trio.to_thread.run_sync(
            observe, init_pid, inspect, profile, ro_rels, limiter=self._fs_limiter
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
        mine = {s.id for s in self.live()}
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

    async def reverify_layer(self, sandbox: Sandbox, ws: Workspace) -> None:
        """After a swap: observe again what a swap can change — the mount facts and the
        workspace identities (`SandboxHost.observe_mounts`) — and require the identities
        of the generation mounted now. Every other fact is the process's, its network
        namespace's or the engine's, which a swap does not touch (and every command's own
        process is checked on the fast path). Refuses `confinement_unmet` (journalled) on
        a mismatch; the caller then drops the sandbox. Cost: one mountinfo read and an
        lstat per identity (well under a millisecond), no engine call."""
        layer = sandbox.layer
        if layer is None:
            return
        required = {**layer.required, **await self.layer_mounts.identities(layer)}
        engine_ok = any(f.name == "docker_socket_absent" and f.value is True for f in sandbox.facts)
        fresh = await trio.to_thread.run_sync(
            functools.partial(
                self._host.observe_mounts,
                sandbox.init_pid,
                list(sandbox.readonly),
                engine_ok=engine_ok,
            ),
            limiter=self._fs_limiter,
        )
        names = {f.name for f in fresh}
        observed = [f for f in sandbox.facts if f.name not in names] + fresh
        await self._check(sandbox.id, ws, sandbox.profile, required, observed)
        sandbox.facts = observed

    async def sweep_layers(self) -> None:
        """At start, after `reap_previous`, and at shutdown, after `remove_all`
        (`LayerMounts.sweep`)."""
        await self.layer_mounts.sweep()

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
        """Remove sandboxes unused for `idle_s` with nothing running in them, and retired
        ones (`retire`) as soon as nothing runs in them."""
        now = time.monotonic() if now is None else now
        removed = 0
        for sandbox in list(self._retired):
            if sandbox.running == 0:
                await self.forget(sandbox, "profile_changed")
                removed += 1
        for sandbox in list(self._live.values()):
            if sandbox.running == 0 and now - sandbox.last_used >= self.idle_s:
                await self.forget(sandbox, "idle")
                removed += 1
        return removed

    async def release_workspace(self, workspace: str) -> None:
        """Remove every sandbox of `workspace` (its commands die with it)."""
        for sandbox in self.live():
            if sandbox.workspace == workspace:
                await self.forget(sandbox, "released")

    async def remove_all(self, reason: str) -> None:
        for sandbox in self.live():
            await self.forget(sandbox, reason)

    async def _journal_async(self, kind: str, data: dict[str, Any], workspace: str | None) -> None:
        await trio.to_thread.run_sync(lambda: self._journal.append(kind, data, workspace=workspace))
