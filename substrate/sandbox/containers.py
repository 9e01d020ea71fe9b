"""Sandbox containers: one per (workspace, profile), made from the profile only, verified
from the kernel before anything runs in it.

Theory of operation. `Containers.ensure(ws, profile)` returns a `Sandbox`, a container
this daemon created and verified, cached until it is idle for `container_idle_s`, its
workspace is released, or the daemon stops. A cache hit checks only that the container's
init is the same process (pid and start time, from procfs: microseconds), re-reads
secrets whose files changed and checks the home's quota. A miss is one pipeline,
`_create_verified`, read top to bottom: each step a method or pure function with typed
inputs and outputs; what a step made is undone, last first, if a later one fails.

1. Resolve (`_resolve` → `Resolved`; nothing made): the secrets
   (`SandboxEnvironment.load_secrets`: `secret_unknown` first), who runs
   (docs/protocol.md §5 "Who runs": the held root's owner or the profile's `UID:GID`;
   root only with `allow_root`), runtime and image (never pulled), security options,
   what is read-only over the workspace (`mounts.readonly_paths`: every `.git`, the
   policy's whole-directory denies).
2. Environment: the persistent home (`SandboxEnvironment.prepare_home`, its quota) and a
   `layer` profile's working layer (`LayerMounts.open`, its passthrough policy-checked).
3. Require (`requirements`, pure: `facts.required_facts`, the home's and workspace's
   identities); labelled containers of the pair this run did not make are checked and
   removed (`labelled.Labelled.remove_foreign`: weaker settings are `confinement_unmet`);
   an egress profile's CA bundle and facts (`proxy_link.prepare`).
4. Create (`_request` → `spec.CreateRequest`: `spec.container_spec` and
   `spec.create_request`, pure; `Engine.create_container`, `_start`): kept alive by the
   engine's init and `sleep infinity`, a runc sandbox's supervisor directory bound in
   (docs/fast-exec.md), a working layer's first generation mounted once it runs.
5. Observe (`verification.Verifier.observe_started` → `Observed`): inspect, the facts
   from outside (procfs, cgroups, netns, the identities of `/workspace`, each read-only
   path and the home against the held fds), an egress sandbox's link to the proxy.
6. Verify (`Verifier.check`: `facts.compare`): a mismatch removes the container and
   refuses `confinement_unmet` with what was required and seen (journalled); then
   `_sandbox` → `Sandbox` (its init's identity, cgroups, protected pids).
7. Journal (`Verifier.passed`): `proc.facts`; the facts go with every command's result.

A `proc.run` enters here once (`ensure`) and walks down: nothing here calls back into the
process layer. Secrets' values are in `Sandbox.profile.env` only (given per exec); the
container is created from the declared profile. The host kernel is read through a
`SandboxHost` (`substrate.sandbox.host`; tests give `fake_engine`'s fakes). A profile
reload retires the sandboxes of changed profiles (`retire`): their commands go on, new
ones get a new sandbox. Settings changed through the engine (`docker update`) are not
re-observed per command: that needs engine access, root-equivalent anyway
(docs/execution.md). Labels and an earlier run's containers: `substrate.sandbox.labelled`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from substrate.errors import RuntimeUnavailable
from substrate.layer.mounts import LayerMounts, WorkingLayer, passthrough, working_layer
from substrate.layer.mounts.git_plan import GIT_REL
from substrate.sandbox import facts as factlib
from substrate.sandbox import mounts, profiles, proxy_link, reaper, removal
from substrate.sandbox.engine import ContainerGone, Engine
from substrate.sandbox.environment import SandboxEnvironment, SecretsVersion
from substrate.sandbox.facts import FactValue
from substrate.sandbox.host import HostKernel, SandboxHost
from substrate.sandbox.labelled import Labelled
from substrate.sandbox.profiles import Profile
from substrate.sandbox.proxy_link import ProxyLink, ProxyLinks
from substrate.sandbox.sandboxes import Sandbox
from substrate.sandbox.spec import (
    HOST_VISIBLE_RUNTIMES,
    LABEL_DAEMON,
    LABEL_EPOCH,
    CreateRequest,
    RunAs,
    container_spec,
    create_request,
    daemon_id_for,
    run_as,
)
from substrate.sandbox.supervisor.slot import Slot
from substrate.sandbox.supervisor.supervisors import Supervisors, supervised
from substrate.sandbox.verification import Observed, Verifier
from substrate.secrets import SecretStore
from substrate.store.journal import Journal
from substrate.workspace.homes import Home, Homes
from substrate.workspace.registry import Workspace

__all__ = ["LABEL_DAEMON", "LABEL_EPOCH", "Containers", "Sandbox", "daemon_id_for"]

log = logging.getLogger("substrate.sandbox.containers")


@dataclass(frozen=True)
class Resolved:
    """Step 1: what a sandbox of `declared` will be, read before anything is made."""

    declared: Profile
    #: `declared` with its secrets' values in `env` (`profiles.with_secrets`): never
    #: serialized, never given to the engine's create.
    profile: Profile
    secrets_version: SecretsVersion
    owner: os.stat_result  # the held workspace root's fstat
    who: RunAs
    image_id: str
    security_opt: list[str]
    #: Workspace-relative paths mounted read-only over the workspace → (st_dev, st_ino).
    readonly: list[tuple[str, tuple[int, int]]]

    @property
    def readonly_rels(self) -> list[str]:
        return [rel for rel, _ in self.readonly]


def requirements(
    run: Resolved, home: Home | None, *, layered: bool, git_layer: bool = False
) -> dict[str, FactValue]:
    """Step 3 (pure): every fact a sandbox of `run` must show before an egress link's:
    the profile's (`facts.required_facts`), the home's identity, and, without a working
    layer, the identities of the workspace and its read-only paths (a layer's are its
    own: `LayerMounts.identities`, once it is mounted). With a `git_layer`, `.git` is
    not read-only: it is the git layer's overlay (its identity is the layer's too)."""
    profile = run.declared
    readonly_dirs = [rel for rel in run.readonly_rels if not (git_layer and rel == GIT_REL)]
    required = factlib.required_facts(
        profile,
        run_uid=run.who.uid,
        run_gid=run.who.gid,
        workspace_mode=profile.workspace,
        readonly_dirs=readonly_dirs,
        seccomp_expected=profile.seccomp != "engine-default",
        image_id=run.image_id,
        security_opt=run.security_opt,
    )
    if home is not None:
        required["home_identity"] = f"{home.identity[0]}:{home.identity[1]}"
    if not layered:
        required.update(mounts.identity_required(profile, run.readonly, run.owner))
    return required


class LateBinder(Protocol):
    """Binds a ready-made sandbox to a workspace (`substrate.sandbox.pool.WarmPool`)."""

    async def bind(self, ws: Workspace, run: Resolved) -> Sandbox | None: ...


@contextlib.contextmanager
def _stays_up(profile: Profile) -> Iterator[None]:
    """A container that went away while it was started and verified: `runtime_unavailable`."""
    try:
        yield
    except (ContainerGone, ProcessLookupError):
        raise RuntimeUnavailable(
            f"the sandbox of profile {profile.name!r} did not stay up (its image "
            "needs `sleep` accepting `infinity`)"
        ) from None


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
        #: Observes, checks and journals each container's facts (steps 5-7).
        self._verifier = Verifier(engine, self._host, journal, egress, fs_limiter=fs_limiter)
        #: Our labels; an earlier run's containers, and the ones this run did not create.
        self._labelled = Labelled(engine, journal, self._verifier, daemon_id=daemon_id, epoch=epoch)
        # Working layers live under the state dir; None: "layer" profiles are refused.
        self.layer_mounts = LayerMounts(state_dir, fs_limiter, self._journal_async)
        self._egress = egress  # links egress sandboxes to the proxy; None: they are refused
        #: Secrets and persistent homes (either None: see `SandboxEnvironment`).
        self.environment = SandboxEnvironment(homes, secrets, fs_limiter)
        # Each runc sandbox's supervisor directory is bound in (docs/fast-exec.md).
        self._supervisors = supervisors
        #: The warm pool (docs/execution.md, "The warm pool"); None: every sandbox is new.
        self.pool: LateBinder | None = None
        #: New sandboxes being made on the usual path now (the pool waits for none).
        self.creating = 0

    # -- lookup --------------------------------------------------------------------------

    def labels_for(self, workspace: str, profile: str) -> dict[str, str]:
        """The labels that mark a container as this daemon's, for one (workspace, profile)."""
        return self._labelled.of_pair(workspace, profile)

    def cached(self, workspace: str, profile: str) -> Sandbox | None:
        return self._live.get((workspace, profile))

    def live(self) -> list[Sandbox]:
        """Every sandbox this daemon holds, retired ones included."""
        return [*self._live.values(), *self._retired]

    def count(self) -> int:
        """How many sandboxes `live` would list; safe from any thread (two `len`s)."""
        return len(self._live) + len(self._retired)

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

    # -- a new sandbox: the pipeline (module doc, steps 1-7) ------------------------------

    async def _create_verified(self, ws: Workspace, profile: Profile) -> Sandbox:
        """A new, verified sandbox for (ws, profile). Refuses as `ensure`."""
        run = await self._resolve(ws, profile)  # 1. resolve
        if self.pool is not None and (bound := await self.pool.bind(ws, run)) is not None:
            return bound  # steps 2-7 on a warm sandbox, for this workspace
        self.creating += 1
        try:
            return await self._create_new(ws, run)
        finally:
            self.creating -= 1

    async def _create_new(self, ws: Workspace, run: Resolved) -> Sandbox:
        """Steps 2-7 on a new container (`_create_verified`)."""
        profile = run.declared
        async with contextlib.AsyncExitStack() as undo:
            home = await self._home(ws, run)  # 2. the environment
            layer = await self._layer(ws, run)
            if layer is not None:
                undo.push_async_callback(self.layer_mounts.close, layer)
            git_layer = layer is not None and layer.plan.git is not None
            required = requirements(run, home, layered=layer is not None, git_layer=git_layer)
            await self._labelled.remove_foreign(
                ws.id, profile, required, run.readonly_rels, mine={s.id for s in self.live()}
            )
            ca_bundle, egress_required = await proxy_link.prepare(self._egress, profile)
            required |= egress_required
            if layer is not None:
                layer.required = dict(required)  # what every later generation must show too
            request = await self._request(ws, run, home, layer, ca_bundle)  # 4. create
            slot = await self._supervisor_slot(run, request)
            if slot is not None:
                undo.callback(slot.discard)
            container = await self._engine.create_container(
                name=request.name, labels=request.labels, **request.spec
            )
            undo.push_async_callback(_shielded(self._engine.remove), container)
            links: list[ProxyLink] = []  # an egress sandbox's, closed if it does not verify
            undo.push_async_callback(_shielded(_close_links), links)
            with _stays_up(profile):
                required = await self._start(container, ws, layer, required)
                observed = await self._verifier.observe_started(  # 5. observe
                    container, ws.id, profile, run.readonly_rels, required, links
                )
                await self._verifier.check(  # 6. verify
                    container, ws.id, profile, required, observed.facts
                )
                sandbox = await self._sandbox(container, ws, run, observed, home, links)
                await self._verifier.passed(  # 7. journal
                    container, ws.id, profile, observed.inspect, sandbox.facts
                )
            sandbox.layer = layer
            if slot is not None and self._supervisors is not None:
                self._supervisors.attach(slot, sandbox)
            undo.pop_all()  # verified: everything made is the sandbox's now
        return sandbox

    async def _resolve(self, ws: Workspace, profile: Profile) -> Resolved:
        """Step 1. Refuses, in this order: `secret_unknown`, `confinement_unmet` (root),
        `runtime_unavailable`, `image_missing`, the security options' refusals."""
        # First: a missing secret refuses before anything is read or made.
        exec_profile, secrets_version = await self.environment.load_secrets(profile)
        owner = await trio.to_thread.run_sync(os.fstat, ws.root_fd, limiter=self._fs_limiter)
        who = run_as(profile, owner.st_uid, owner.st_gid)
        if profile.runtime != "runc":
            await self._engine.require_runtime(profile.runtime)
        image_id = await self._engine.image_id(profile.image)
        security_opt = await trio.to_thread.run_sync(
            profiles.checked_security_opts, profile, self._seccomp_dir, limiter=self._fs_limiter
        )
        readonly = await trio.to_thread.run_sync(
            mounts.readonly_paths, ws, profile, limiter=self._fs_limiter
        )
        return Resolved(
            declared=profile,
            profile=exec_profile,
            secrets_version=secrets_version,
            owner=owner,
            who=who,
            image_id=image_id,
            security_opt=security_opt,
            readonly=readonly,
        )

    async def _home(self, ws: Workspace, run: Resolved) -> Home | None:
        """Step 2: the persistent home (None: this daemon keeps none). Refuses
        `runtime_unavailable` (it cannot be made) and `limit_exceeded` (over its quota:
        nothing else is made)."""
        home = await self.environment.prepare_home(ws, run.who, run.declared)
        await self.environment.check_home(home)
        return home

    async def _layer(self, ws: Workspace, run: Resolved) -> WorkingLayer | None:
        """Step 2: a `layer` profile's working layer, opened (not mounted yet). Refuses
        `path_denied` (a passthrough the policy does not let be written) and
        `runtime_unavailable` (this daemon keeps no layers)."""
        profile = run.declared
        if profile.workspace != "layer":
            return None
        passthrough.check_policy(ws.policy, profile.passthrough)
        layer = await self.layer_mounts.open(
            run.readonly, profile.passthrough, profile.symlinks, (ws.checkout, ws.root_fd)
        )
        layer.git_refs_allow = tuple(profile.git_refs_allow)
        return layer

    async def _request(
        self,
        ws: Workspace,
        run: Resolved,
        home: Home | None,
        layer: WorkingLayer | None,
        ca_bundle: str | None,
    ) -> CreateRequest:
        """Step 4: the create call, from the profile alone (`spec.container_spec`); the
        empty resolver file it binds is made first when this daemon binds one."""
        resolv_conf = None
        if self._files_dir is not None:
            resolv_conf = await trio.to_thread.run_sync(
                mounts.empty_resolv_conf, self._files_dir, limiter=self._fs_limiter
            )
        profile = run.declared
        spec = container_spec(
            profile,
            who=run.who,
            workspace_source=ws.host_path if layer is None else layer.plan.base,
            readonly_dirs=run.readonly_rels if layer is None else [],
            security_opt=run.security_opt,
            resolv_conf=resolv_conf,
            ca_bundle=ca_bundle,
            home_source=None if home is None else home.source,
        )
        return create_request(
            ws.id,
            profile.name,
            spec,
            daemon_id=self.daemon_id,
            epoch=self._epoch,
            token=secrets.token_hex(3),
        )

    async def _supervisor_slot(self, run: Resolved, request: CreateRequest) -> Slot | None:
        """Step 4: a supervised sandbox's supervisor directory (docs/fast-exec.md), bound
        into `request` after its digest was taken (a fresh directory each time)."""
        if self._supervisors is None or not supervised(run.declared):
            return None
        slot = await trio.to_thread.run_sync(self._supervisors.prepare, run.who)
        request.spec["host_config"]["mounts"].append(slot.mount)
        return slot

    async def _start(
        self,
        container: str,
        ws: Workspace,
        layer: WorkingLayer | None,
        required: dict[str, FactValue],
    ) -> dict[str, FactValue]:
        """Step 4: start the container; for a working layer, mount its first generation
        and return `required` with that generation's identities."""
        await self._engine.start(container)
        if layer is None:
            return required
        # Only now: the container bound the base with nothing on it, so every generation
        # mounted from here on reaches it (docs/working-layer.md, "Propagation and the order
        # of things").
        await trio.to_thread.run_sync(
            working_layer.mount_first, layer, ws.root_fd, limiter=self._fs_limiter
        )
        return {**required, **await self.layer_mounts.identities(layer)}

    async def _sandbox(
        self,
        container: str,
        ws: Workspace,
        run: Resolved,
        observed: Observed,
        home: Home | None,
        links: list[ProxyLink],
    ) -> Sandbox:
        """Step 6: the verified container as a `Sandbox`: its init's identity, its
        cgroups, the pids the reaper never signals (the init and its keep-alive)."""
        init_pid = observed.init_pid
        init = self._host.identity(init_pid)
        if init is None:
            raise ContainerGone(container)
        host_visible = run.declared.runtime in HOST_VISIBLE_RUNTIMES
        cgroups = await trio.to_thread.run_sync(self._host.cgroups, init_pid)
        protected = {init_pid}
        if host_visible:
            protected |= await self._keepalive_pids(cgroups, init_pid)
        return Sandbox(
            id=container,
            workspace=ws.id,
            profile=run.profile,
            declared=run.declared,
            who=run.who,
            init_pid=init_pid,
            init=init,
            protected=frozenset(protected),
            cgroups=cgroups,
            facts=observed.facts,
            host_visible=host_visible,
            readonly=dict(run.readonly),
            egress=links[0] if links else None,
            home=home,
            secrets_version=run.secrets_version,
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
        sandbox.facts = await self._verifier.recheck_mounts(sandbox, ws.id, required)

    async def sweep_layers(self) -> None:
        """At start, after `reap_previous`, and at shutdown, after `remove_all`
        (`LayerMounts.sweep`)."""
        await self.layer_mounts.sweep()

    # -- lifecycle -----------------------------------------------------------------------------

    async def reap_previous(self) -> int:
        """At start: remove every container of an earlier run of this daemon (its epoch;
        `Labelled.reap_previous`)."""
        return await self._labelled.reap_previous()

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
        """Remove every sandbox, several at once (`removal.remove_each`)."""
        await removal.remove_each(self.live(), lambda s: self.forget(s, reason), "a sandbox")

    async def _journal_async(self, kind: str, data: dict[str, Any], workspace: str | None) -> None:
        await trio.to_thread.run_sync(lambda: self._journal.append(kind, data, workspace=workspace))


def _shielded(
    fn: Callable[[Any], Awaitable[None]],
) -> Callable[[Any], Awaitable[None]]:
    """`fn`, shielded from cancellation: the undo of a cancelled creation runs to its end."""

    async def run(arg: Any) -> None:
        with trio.CancelScope(shield=True):
            await fn(arg)

    return run


async def _close_links(links: list[ProxyLink]) -> None:
    for link in links:
        await link.aclose()
