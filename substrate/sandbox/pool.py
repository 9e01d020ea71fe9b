"""The warm pool: created, confined sandboxes per profile with no workspace bound yet
(docs/execution.md, "The warm pool").

Theory of operation. `WarmPool.serve` (a task of the execution service's nursery) keeps
`warm_sandboxes[profile]` members per qualifying profile: a container created from the
profile alone, started, its working layer's base bound `rslave` at /workspace with
nothing mounted on it, and, when the daemon keeps homes, an empty *home slot* (a shared
self-bind under the layer's directory) bound `rslave` at /home/agent. Nothing of a
workspace is in it. `Containers.ensure` asks `bind` first, after step 1 (resolve): a
member of the same declared profile, image, security options and user is taken, and
the rest of the pipeline runs on it exactly as for a new container, against *that*
workspace: its home is bound on the slot and the layer's first generation on the base
(both propagate into the container), then every fact is observed from the kernel and
compared with what that workspace requires, its identity and its mounts included.
Nothing observed while the member waited is trusted. Before that, its cgroup must hold
its init and keep-alive only (a process left in it is refused). A member that does not
verify is removed, journalled (`pool.refused`) and replaced; the command then takes
today's path. A pool that cannot be filled (engine down, image missing) logs once per
error, says so in `daemon.status` (`warm_pool`) and retries with a backoff; commands
take today's path meanwhile. A member taken is replaced once its bind is over, and no
member is made while a sandbox is being made on today's path (commands waiting for
containers come first: in a burst larger than the pool, the refill would only compete
with them for the engine and the CPU). Members are labelled `substrate.pool` with the daemon's id
and epoch, so a dead daemon's members are removed at the next start like any orphan
(`Labelled.reap_previous`), their layers by the start-up sweep; `close` removes them on
shutdown.

Who a member runs as: the profile's fixed `UID:GID`, or, for `user = "owner"`, the
owner last seen for that profile (first: the first non-root-owned adopt root's owner).
A workspace owned by someone else simply misses the pool. A supervised member's
supervisor (docs/fast-exec.md) is started while it waits, as that uid:gid
(`supervisor.warm`), and checked again at bind, after the member's facts verified for
the workspace and against that workspace's uid, before anything runs on it: one that
does not hold refuses the member like any other fact.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import trio
import trio.lowlevel

from substrate.config import WARM_SANDBOXES_MAX
from substrate.errors import ConfinementUnmet, Refusal
from substrate.layer.mounts import WorkingLayer, overlay, passthrough, working_layer
from substrate.layer.mounts.plan import plan
from substrate.sandbox import mounts, profiles, reaper, removal
from substrate.sandbox.containers import Containers, Resolved, requirements
from substrate.sandbox.engine import ContainerGone
from substrate.sandbox.profiles import Profile
from substrate.sandbox.sandboxes import Sandbox
from substrate.sandbox.spec import (
    HOME_TARGET,
    LABEL_DAEMON,
    LABEL_EPOCH,
    RunAs,
    container_spec,
    create_request,
)
from substrate.sandbox.supervisor import warm
from substrate.sandbox.supervisor.slot import Slot
from substrate.sandbox.supervisor.supervisors import supervised
from substrate.workspace.registry import Workspace

__all__ = ["LABEL_POOL", "PoolState", "WarmPool", "qualifies"]

log = logging.getLogger("substrate.sandbox.pool")

#: Marks a container as a warm-pool member (with `substrate.daemon` and `substrate.epoch`).
LABEL_POOL = "substrate.pool"
#: The `substrate.workspace` label and name part of a member (no workspace id has a dot).
POOL_WORKSPACE = ".pool"
#: The most members one profile may keep (`warm_sandboxes` is checked against it).
MAX_PER_PROFILE = WARM_SANDBOXES_MAX
#: Seconds between refill attempts after a failure: doubling from the first to the last.
BACKOFF_S = (1.0, 60.0)
#: Seconds between looks, while sandboxes are being made on the usual path (no refill).
DEFER_S = 0.25
#: Seconds between looks at the members (a reloaded profile's, a dead container's go).
PRUNE_S = 30.0


def qualifies(profile: Profile) -> str | None:
    """Why a sandbox of `profile` cannot be bound late (None: it can). Only a working
    layer's base and the home slot are bound at bind time; what else a workspace decides
    (a plain bind of the checkout, read-only binds over it, an egress link) is in the
    create call or needs the container's own namespace set up for that workspace."""
    if profile.workspace != "layer":
        return f'workspace = "{profile.workspace}" binds the checkout at create'
    if profile.runtime != "runc":
        return "only runc sandboxes see mounts propagated from the host"
    if profile.network != "none":
        return "an egress sandbox is linked to the proxy for its workspace"
    return None


@dataclass
class Member:
    """A started container of the pool, waiting for a workspace."""

    container: str
    declared: Profile
    who: RunAs
    image_id: str
    security_opt: list[str]
    layer: WorkingLayer
    home_slot: str | None  # host path bound at /home/agent (None: no homes kept)
    slot: Slot | None  # its supervisor directory
    init_pid: int
    init: Hashable
    cgroups: reaper.CgroupDirs
    protected: frozenset[int]
    made: float = field(default_factory=time.monotonic)


@dataclass
class PoolState:
    """One profile's pool, as `daemon.status` shows it."""

    wanted: int
    ready: list[Member] = field(default_factory=list)
    making: int = 0
    last_error: str | None = None
    failures: int = 0


class WarmPool:
    """The warm pools of `containers`, per profile name → wanted count (`warm_sandboxes`).
    `profiles` is the daemon's profile dict (a reload changes it in place)."""

    def __init__(
        self,
        containers: Containers,
        wanted: Mapping[str, int],
        profiles_now: Mapping[str, Profile],
        *,
        state_dir: str,
        adopt_roots: Sequence[str] = (),
        fs_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._c = containers
        self._profiles = profiles_now
        self._state_dir = state_dir
        self._fs_limiter = fs_limiter
        self.pools: dict[str, PoolState] = {
            name: PoolState(wanted=min(count, MAX_PER_PROFILE))
            for name, count in wanted.items()
            if count > 0
        }
        self._adopt_roots = tuple(adopt_roots)
        self._who: dict[str, RunAs] = {}
        self._wake = trio.Event()
        self._closed = False

    def __bool__(self) -> bool:
        return bool(self.pools)

    # -- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, tuple[int, int, str | None]]:
        """profile → (ready, wanted, last_error), for `daemon.status`."""
        return {n: (len(p.ready), p.wanted, p.last_error) for n, p in self.pools.items()}

    def member_ids(self) -> set[str]:
        return {m.container for p in self.pools.values() for m in p.ready}

    # -- binding --------------------------------------------------------------------------

    async def bind(self, ws: Workspace, run: Resolved) -> Sandbox | None:
        """A member bound to `ws` and verified for it, or None (no member fits, or the one
        taken did not verify: it is removed and replaced). Refuses what steps 2-7 refuse
        for a workspace (`path_denied`, `limit_exceeded`, ...): the member is removed."""
        profile = run.declared
        state = self.pools.get(profile.name)
        if state is None or qualifies(profile) is not None:
            return None
        self._note(profile, run.who)
        member = self._take(state, run)
        if member is None:
            self._wake.set()
            return None
        try:
            return await self._bind(ws, run, member)
        except (ConfinementUnmet, ContainerGone, ProcessLookupError, OSError) as exc:
            reason = exc.message if isinstance(exc, Refusal) else type(exc).__name__
            log.warning("a warm sandbox of profile %s did not verify: %s", profile.name, reason)
            await self._discard(member, "refused", ws.id)
            return None
        except BaseException:
            await self._discard(member, "bind_failed", ws.id)
            raise
        finally:  # refilled once bound: the making does not compete with this bind
            self._wake.set()

    def _take(self, state: PoolState, run: Resolved) -> Member | None:
        for member in state.ready:
            if (
                member.declared == run.declared
                and member.who == run.who
                and member.image_id == run.image_id
                and member.security_opt == run.security_opt
            ):
                state.ready.remove(member)
                return member
        return None

    async def _bind(self, ws: Workspace, run: Resolved, member: Member) -> Sandbox:
        """Steps 2-7 of `Containers.ensure` on `member`, for `ws` (module doc)."""
        c = self._c
        profile = run.declared
        if await trio.to_thread.run_sync(reaper.everything, member.cgroups, member.protected):
            raise ConfinementUnmet(
                "a process is left in the warm sandbox",
                required={"processes": "init and keep-alive"},
                observed={"processes": "more"},
            )
        passthrough.check_policy(ws.policy, profile.passthrough)
        home = await c._home(ws, run)
        layer = member.layer
        # The same sandbox directory and base, now planned with this workspace's parts.
        layer.plan = plan(self._state_dir, _sandbox_id(layer), 0, run.readonly)
        required = requirements(run, home, layered=True)
        await c._labelled.remove_foreign(
            ws.id, profile, required, run.readonly_rels, mine={s.id for s in c.live()}
        )
        layer.required = dict(required)
        if home is not None and member.home_slot is not None:
            await trio.to_thread.run_sync(
                overlay.mount, home.source, member.home_slot, None, overlay.MS_BIND
            )
        await trio.to_thread.run_sync(
            working_layer.mount_first, layer, ws.root_fd, limiter=self._fs_limiter
        )
        required = {**required, **await c.layer_mounts.identities(layer)}
        observed = await c._verifier.observe_started(
            member.container, ws.id, profile, run.readonly_rels, required, []
        )
        await c._verifier.check(member.container, ws.id, profile, required, observed.facts)
        if c._host.identity(observed.init_pid) != member.init:
            raise ContainerGone(member.container)
        sandbox = await c._sandbox(member.container, ws, run, observed, home, [])
        if member.slot is not None:  # its supervisor, if started while it waited
            warm.check(member.slot, sandbox)
        await c._verifier.passed(member.container, ws.id, profile, observed.inspect, sandbox.facts)
        sandbox.layer = layer
        if member.slot is not None and c._supervisors is not None:
            await warm.attach(c._supervisors, member.slot, sandbox)
        await c._journal_async(
            "pool.bound",
            {"container": member.container[:12], "profile": profile.name},
            ws.id,
        )
        return sandbox

    def _note(self, profile: Profile, who: RunAs) -> None:
        if self._who.get(profile.name) != who:
            self._who[profile.name] = who
            state = self.pools.get(profile.name)
            if state is not None:
                state.failures = 0

    # -- filling ----------------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Service task: keep every pool filled until cancelled (one member made at a
        time, per profile in turn; a failure backs off, doubling, up to a minute)."""
        task_status.started()
        retry_at: dict[str, float] = {}
        while True:
            self._wake = trio.Event()
            next_wake = PRUNE_S
            for name, state in self.pools.items():
                await self._prune(name, state)
                if len(state.ready) >= state.wanted:
                    continue
                if self._c.creating:  # commands are waiting for new sandboxes: they first
                    next_wake = min(next_wake, DEFER_S)
                    continue
                wait = retry_at.get(name, 0.0) - time.monotonic()
                if wait > 0:
                    next_wake = min(next_wake, wait)
                    continue
                made = await self._fill_one(name, state)
                if made is None:  # whose it would be is not known yet: wait for a bind
                    continue
                if made:
                    retry_at.pop(name, None)
                    next_wake = 0.0
                else:
                    low, high = BACKOFF_S
                    delay = min(high, low * 2 ** min(state.failures - 1, 8))
                    retry_at[name] = time.monotonic() + delay
                    next_wake = min(next_wake, delay)
            if next_wake > 0:
                with trio.move_on_after(next_wake):
                    await self._wake.wait()
            else:
                await trio.lowlevel.checkpoint()

    async def _prune(self, name: str, state: PoolState) -> None:
        """Members of a profile that changed, or whose container went away, go."""
        current = self._profiles.get(name)
        for member in list(state.ready):
            gone = self._c._host.identity(member.init_pid) != member.init
            link = None if member.slot is None else member.slot.link
            gone = gone or (link is not None and link.problem() is not None)
            if gone or member.declared != current:
                state.ready.remove(member)
                await self._discard(member, "gone" if gone else "profile_changed", None)

    async def _fill_one(self, name: str, state: PoolState) -> bool | None:
        """Make one member of `name`: True made (or nothing to keep), False failed, None
        not known for whom yet."""
        profile = self._profiles.get(name)
        why = "no such profile" if profile is None else qualifies(profile)
        who = None if profile is None else self._who_for(profile)
        if why is None and who is None:
            return None  # nothing to make until a workspace shows whose it would be
        if profile is None or why is not None or who is None:
            self._failed(name, state, f"not pooled: {why}")
            return False
        state.making += 1
        try:
            member = await self._make(profile, who)
        except (Refusal, OSError, ContainerGone, ProcessLookupError) as exc:
            reason = exc.message if isinstance(exc, Refusal) else f"{type(exc).__name__}"
            self._failed(name, state, reason)
            return False
        finally:
            state.making -= 1
        if self._closed or self._profiles.get(name) != profile:
            await self._discard(member, "profile_changed", None)
            return True
        state.ready.append(member)
        if state.last_error is not None:
            log.info("warm pool of profile %s fills again", name)
        state.last_error, state.failures = None, 0
        return True

    def _failed(self, name: str, state: PoolState, reason: str) -> None:
        if state.last_error != reason:
            log.warning(
                "warm pool of profile %s cannot be filled (commands take the usual path): %s",
                name,
                reason,
            )
        state.last_error = reason
        state.failures += 1

    def _who_for(self, profile: Profile) -> RunAs | None:
        if profile.user != "owner":
            uid, _, gid = profile.user.partition(":")
            return RunAs(int(uid), int(gid or uid))
        found = self._who.get(profile.name)
        return found if found is not None else _first_owner(self._adopt_roots)

    async def _make(self, profile: Profile, who: RunAs) -> Member:
        """A started member of `profile` running as `who`: nothing of a workspace in it."""
        c = self._c
        image_id = await c._engine.image_id(profile.image)
        security_opt = await trio.to_thread.run_sync(
            profiles.checked_security_opts, profile, c._seccomp_dir, limiter=self._fs_limiter
        )
        async with contextlib.AsyncExitStack() as undo:
            layer = await c.layer_mounts.open([], list(profile.passthrough), profile.symlinks)
            undo.push_async_callback(c.layer_mounts.close, layer)
            home_slot = None
            if c.environment.homes is not None:
                home_slot = f"{layer.plan.sandbox_dir}/home"
                await trio.to_thread.run_sync(_prepare_slot, home_slot)
            resolv_conf = None
            if c._files_dir is not None:
                resolv_conf = await trio.to_thread.run_sync(
                    mounts.empty_resolv_conf, c._files_dir, limiter=self._fs_limiter
                )
            spec = container_spec(
                profile,
                who=who,
                workspace_source=layer.plan.base,
                readonly_dirs=[],
                security_opt=security_opt,
                resolv_conf=resolv_conf,
                home_source=home_slot,
            )
            for mount in spec["host_config"]["mounts"]:
                if mount.get("Target") == HOME_TARGET:
                    mount["BindOptions"] = {"Propagation": "rslave"}
            request = create_request(
                POOL_WORKSPACE,
                profile.name,
                spec,
                daemon_id=c.daemon_id,
                epoch=c._epoch,
                token=secrets.token_hex(3),
            )
            request.labels[LABEL_POOL] = "1"
            slot = None
            if c._supervisors is not None and supervised(profile):
                slot = await trio.to_thread.run_sync(c._supervisors.prepare, who)
                undo.callback(slot.discard)
                request.spec["host_config"]["mounts"].append(slot.mount)
            container = await c._engine.create_container(
                name=request.name, labels=request.labels, **request.spec
            )
            undo.push_async_callback(_shielded_remove(c), container)
            await c._engine.start(container)
            inspect = await c._engine.inspect(container)
            init_pid = int(inspect["State"]["Pid"] or 0)
            init = c._host.identity(init_pid) if init_pid > 0 else None
            if init is None:
                raise ContainerGone(container)
            cgroups = await trio.to_thread.run_sync(c._host.cgroups, init_pid)
            protected = {init_pid} | await c._keepalive_pids(cgroups, init_pid)
            if slot is not None and c._supervisors is not None:
                # Started now, as the uid:gid the container runs as: checked again for
                # the workspace at bind (`warm.check`) before it serves anything.
                pid = await warm.prestart(
                    c._supervisors, slot, container, init_pid, who, dict(profile.env)
                )
                if pid is not None:
                    protected.add(pid)
            undo.pop_all()
        return Member(
            container=container,
            declared=profile,
            who=who,
            image_id=image_id,
            security_opt=security_opt,
            layer=layer,
            home_slot=home_slot,
            slot=slot,
            init_pid=init_pid,
            init=init,
            cgroups=cgroups,
            protected=frozenset(protected),
        )

    # -- removing ------------------------------------------------------------------------------

    async def _discard(self, member: Member, reason: str, workspace: str | None) -> None:
        c = self._c
        with trio.CancelScope(shield=True):
            try:
                await c._engine.remove(member.container)
            except (Refusal, ContainerGone) as exc:
                log.warning("removing warm sandbox %s: %s", member.container[:12], exc)
            finally:
                await c.layer_mounts.close(member.layer)
                if member.slot is not None:
                    member.slot.discard()
            await c._journal_async(
                "pool.refused" if reason == "refused" else "pool.removed",
                {
                    "container": member.container[:12],
                    "profile": member.declared.name,
                    "reason": reason,
                },
                workspace,
            )
        self._wake.set()

    async def close(self) -> None:
        """At shutdown: remove every member (a dead daemon's go at the next start)."""
        self._closed = True
        members = [m for state in self.pools.values() for m in state.ready]
        for state in self.pools.values():
            state.ready.clear()
        await removal.remove_each(
            members, lambda m: self._discard(m, "shutdown", None), "a warm sandbox"
        )


def _sandbox_id(layer: WorkingLayer) -> str:
    return layer.plan.sandbox_dir.rsplit("/", 1)[1]


def _prepare_slot(path: str) -> None:
    """The home slot: an empty directory made a shared self-bind, so a home bound on it
    later reaches the container that binds it `rslave` (blocking)."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    overlay.mount(path, path, None, overlay.MS_BIND)
    overlay.mount(None, path, None, overlay.MS_SHARED)


def _first_owner(roots: Sequence[str]) -> RunAs | None:
    for root in roots:
        try:
            st = os.stat(root)
        except OSError:
            continue
        if st.st_uid != 0:
            return RunAs(st.st_uid, st.st_gid)
    return None


def _shielded_remove(c: Containers) -> Callable[[str], Awaitable[None]]:
    async def run(container: str) -> None:
        with trio.CancelScope(shield=True):
            await c._engine.remove(container)

    return run


#: Members are found by these labels (`Labelled.reap_previous` finds them by the first two).
POOL_LABELS = (LABEL_DAEMON, LABEL_EPOCH, LABEL_POOL)
