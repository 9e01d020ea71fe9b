"""Commands and terminals sharing a `workspace = "layer"` sandbox's generation, and the
conclusion that applies it once (docs/working-layer.md, "Per command").

Theory of operation. `join` counts a command (`Processes.run`, before its exec is made)
or a terminal session (`pty.docker`, before its TTY exec) as a user of the generation
mounted now (`layer.generation.Users`), waiting only while a conclusion runs. `end`
(its process ended, called shielded) answers, for a user others still share the
generation with, `ProcChanges {generation, deferred: true}` at once; for the last user
it concludes the generation (`conclusion.conclude`: swap, re-verify, scan, apply) in the
most conservative mode its users asked, as the actor of the last user that ran, and
returns the set's summary. `abandon` is for a user whose process never ran (it wrote
nothing): it concludes only when others' changes wait. A generation shared by more than
one user is journaled `changes.shared {generation, changeset, mode, procs, sessions}`
(ids only) with the set, under the concluding actor.

A conclusion that finds the generation busy (`layer_busy`) keeps its users: their
changes go with the generation's next conclusion (`Users.concluded(kept=True)`).

The fresh view: the first user to join a generation nobody uses, when its checkout
changed since it was mounted (`WorkingLayer.stale`: one `poll(2)` of the checkout's
watch), mounts it again (`working_layer.refresh`) and has the container re-verified
before it joins, so it sees the checkout as it is (docs/working-layer.md, "The fresh
view"). A user beside others shares the generation as it is.

Shutdown (`process.service.Execution.shutdown`), in this order: `quiet` waits (bounded
by the caller) until every user has ended and every conclusion is over — terminals and
cut-off commands end concurrently and conclude normally, against their still-running
containers; `stop` refuses newcomers, turns every later conclusion into a no-op (its
users are carried) and waits for the conclusions still running; the caller then removes
the containers and tears the layers down; `keep_left` keeps, as a `pending` set, each
generation still holding changes (users that did not end in time, or a `layer_busy`
generation's carried users): scanned once nothing can write it, nothing applied,
journaled `changes.kept` and `changes.stopped`, so the next start's recovery (which drops
generations without a set) never loses them. Only then may the layers' directory be
swept: a conclusion holds fds beneath it.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, Protocol

import msgspec
import trio

from substrate.errors import ConfinementUnmet, RuntimeUnavailable
from substrate.layer import conclusion
from substrate.layer.changes import Changesets, upper_holds_changes
from substrate.layer.changes.reclaim import RECLAIMER
from substrate.layer.conclusion import Request, S, Sandboxes
from substrate.layer.generation import Conclusion, Deferred, User, combined
from substrate.layer.mounts import working_layer
from substrate.schema.proc import ChangesMode, ProcChanges
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer

log = logging.getLogger("substrate.layer.users")

#: Terminal session ids start so (`pty.terminals`); every other user is a process.
SESSION_PREFIX = "t-"
#: The longest a shutdown waits for settled layers' background removal, seconds.
RECLAIM_WAIT_S = 30.0
#: Conclusions remembered by user, at most (`conclusion_of`: a deferred user's set).
MAX_REMEMBERED = 1024
#: `changes.error` of a user whose generation the daemon stopped before it concluded:
#: its set is kept pending (`keep_left`), nothing applied.
STOPPED = "daemon_stopped"


class LayerClosed(Exception):
    """`join` found the sandbox's layer torn down (its container is going): the caller
    forgets the sandbox and tries again with a fresh one, as after `ContainerGone`."""


class Asked(Protocol):
    """What a joining user asked (a `process.requests.RunRequest` is one)."""

    @property
    def ws(self) -> Workspace: ...

    @property
    def actor(self) -> str: ...

    @property
    def changes(self) -> ChangesMode: ...


@dataclass
class Use(Generic[S]):
    """One user's hold on a sandbox's generation, from `join` to `end`/`abandon`."""

    sandbox: S
    user: User
    req: Request  # what it asked: its workspace, actor and mode
    left: bool = False


class LayerUsers(Generic[S]):
    """Joins and conclusions of every layer sandbox of this daemon: the one interface
    the runner and the terminals use the layer through."""

    def __init__(
        self,
        containers: Sandboxes[S],
        writer: Writer | None,
        changesets: Changesets | None,
        journal: Journal,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._containers = containers
        self._writer = writer
        if writer is not None:
            writer.on_landed = self.note_landed
        self._changesets = changesets
        self._journal = journal
        self._limiter = limiter
        self._joined = 0  # users joined and not yet left
        self._concluding = 0  # conclusions running
        self._changed = trio.Event()  # set (and replaced) when either count drops
        self._stopping = False
        #: sandbox id → the layer sandbox and the last request joined on it: what
        #: `keep_left` needs (its workspace). Pruned of torn-down layers holding nothing.
        self._layers: dict[str, tuple[S, Request]] = {}
        #: sandbox id → the set `keep_left` kept for it (a late user's result names it).
        self._kept: dict[str, ProcChanges] = {}
        #: user id → the conclusion that held its changes (the last `MAX_REMEMBERED`).
        self._by_user: OrderedDict[str, ProcChanges] = OrderedDict()
        self._remembered = trio.Event()  # set (and replaced) when one is remembered

    async def join(self, sandbox: S, user_id: str, asked: Asked) -> Use[S]:
        """Count `user_id` (a process id, or a terminal session id), asking `asked`, on the
        sandbox's current generation (waiting while one concludes: at most its apply).
        Raises `LayerClosed` when the layer was torn down meanwhile (the caller retries
        with a fresh sandbox); refuses `runtime_unavailable` once the daemon stops."""
        req = Request(ws=asked.ws, actor=asked.actor, changes=asked.changes)
        user = User(id=user_id, actor=req.actor, mode=req.changes)
        layer = sandbox.layer
        if layer is None:
            raise ValueError("joining a sandbox without a working layer")
        await layer.users.wait_joinable()
        if self._stopping:
            raise RuntimeUnavailable("the daemon is stopping")
        if layer.closed or layer.awaiting_mount:  # awaiting: its conclusion failed to mount
            raise LayerClosed(sandbox.id)
        if not layer.users.active and layer.stale():
            # The first user of the generation: it sees the checkout as it is now.
            await self._refresh(sandbox, req.ws)
            if layer.closed:  # torn down meanwhile (its container is going)
                raise LayerClosed(sandbox.id)
        # No await from the wait (or the refresh) to here: nothing concludes in between.
        layer.users.join(user, layer.plan.generation)
        working_layer.begin(layer)
        self._joined += 1
        self._prune()
        self._layers[sandbox.id] = (sandbox, req)
        return Use(sandbox, user, req)

    async def _refresh(self, sandbox: S, ws: Workspace) -> None:
        """Mount the generation again when its checkout changed (`working_layer.refresh`),
        then re-verify the container's view (docs/working-layer.md, "The fresh view").
        Newcomers wait meanwhile. A generation still busy (EBUSY) while changes of earlier
        users wait in it (carried) is joined as it is: those changes must conclude with
        it; with nothing waiting, the sandbox is dropped instead (`LayerClosed`: the
        caller retries with a fresh one, whose mount is fresh). Any other failure drops
        the sandbox too. Cost when the checkout did not change: one drain; when it did: a
        swap's mount calls and one observation of the container's mounts."""
        layer = sandbox.layer
        assert layer is not None
        layer.users.refreshing_begins()
        try:
            with trio.CancelScope(shield=True):
                reason = await self._remount(sandbox, layer, ws)
                if reason is not None:
                    await self._containers.forget(sandbox, reason)
                    raise LayerClosed(sandbox.id)
        finally:
            layer.users.refreshed()

    async def _remount(
        self, sandbox: S, layer: working_layer.WorkingLayer, ws: Workspace
    ) -> str | None:
        """`_refresh`'s mount and re-verification; the reason to drop the sandbox, if any."""
        try:
            if not await trio.to_thread.run_sync(_refresh, layer, ws, limiter=self._limiter):
                return None
        except OSError as exc:
            waiting = bool(layer.users.carried or layer.users.ended)
            if exc.errno == errno.EBUSY and waiting:
                log.warning(
                    "the layer of %s is busy: its changed checkout is not mounted again "
                    "while changes wait in it",
                    sandbox.id[:12],
                )
                return None
            log.error("mounting the layer of %s again failed: %s", sandbox.id[:12], exc)
            return "layer_busy" if exc.errno == errno.EBUSY else "layer_failed"
        except ConfinementUnmet as exc:
            log.error("the layer of %s did not verify when mounted again: %s", sandbox.id[:12], exc)
            return "layer_unverified"
        try:
            await self._containers.reverify_layer(sandbox, ws)
        except Exception as exc:  # any failure to verify it: nothing runs there again
            log.error("the layer of %s did not verify after a remount: %s", sandbox.id[:12], exc)
            return "layer_unverified"
        return None

    async def end(self, use: Use[S]) -> ProcChanges | None:
        """`use`'s process ran and ended: deferred while others share its generation, else
        the generation's conclusion (see the module doc). Never raises a refusal (a
        failure is the summary's `error`); None when this daemon applies nothing
        (no writer). Call it shielded; costs what `conclusion.conclude` costs when it
        concludes, nothing otherwise."""
        return await self._leave(use, ran=True)

    def note_landed(self, workspace: str, path: str, sha256: str | None) -> None:
        """A guarded write (`fs.write`, `fs.patch`, `fs.delete`) landed `path` in
        `workspace`'s checkout: each live layer sandbox of it takes the file as
        substrate's, as it takes what its last change set applied (`landed`), so a
        command's change to it right after is no `host_changed` conflict (the ctime
        rule's slack would count it as the host's). A host edit after it still is: the
        checkout's digest then differs. Called from the writing thread (`Writer.on_landed`)."""
        for sandbox, req in list(self._layers.values()):
            layer = sandbox.layer
            if layer is None or layer.closed or req.ws.id != workspace:
                continue
            if sha256 is None:
                layer.landed.pop(path, None)
            else:
                layer.landed[path] = sha256

    async def conclusion_of(self, user_id: str) -> ProcChanges:
        """The conclusion that held `user_id`'s changes: at once when it happened already
        (among the last `MAX_REMEMBERED`), else when it does — for a user whose `end`
        was deferred (an agent turn's gate, `substrate.agents.turns`). Unbounded: the
        caller bounds the wait."""
        while user_id not in self._by_user:
            await self._remembered.wait()
        return self._by_user[user_id]

    def _remember(self, users: tuple[str, ...], changes: ProcChanges) -> None:
        for user_id in users:
            self._by_user[user_id] = changes
            self._by_user.move_to_end(user_id)
        while len(self._by_user) > MAX_REMEMBERED:
            self._by_user.popitem(last=False)
        self._remembered.set()
        self._remembered = trio.Event()

    async def abandon(self, use: Use[S]) -> None:
        """`use` is over without `end` (its process never ran, or its conclusion failed
        before): leave, concluding only if others' changes wait. Idempotent; shielded."""
        if use.left:
            return
        with trio.CancelScope(shield=True):
            changes = await self._leave(use, ran=False)
        if changes is not None and changes.error is not None:
            log.warning("a layer concluded without its last user: %s", changes.error)

    async def _leave(self, use: Use[S], *, ran: bool) -> ProcChanges | None:
        if use.left:
            return None
        use.left = True
        self._joined -= 1
        self._wake()
        layer = use.sandbox.layer
        assert layer is not None
        step = layer.users.leave(use.user.id, ran=ran)
        if step is None:
            return None
        if isinstance(step, Deferred):
            return ProcChanges(generation=step.generation, deferred=True, mode=use.user.mode)
        if self._stopping:
            # The sandbox is being removed: concluding now would race its teardown.
            # Its users are carried; `keep_left` keeps the generation once nothing runs.
            layer.users.concluded(kept=True)
            kept = self._kept.get(use.sandbox.id)
            if kept is not None:
                return msgspec.structs.replace(kept, error=STOPPED)
            mode: ChangesMode = "discard" if step.mode == "discard" else "review"
            return ProcChanges(generation=step.generation, mode=mode, error=STOPPED)
        busy = False
        self._concluding += 1
        try:
            changes = await self._conclude(use, step)
            busy = changes is not None and changes.error == "layer_busy"
            return changes
        finally:
            layer.users.concluded(kept=busy)
            self._concluding -= 1
            self._wake()

    # -- shutdown ----------------------------------------------------------------------

    async def quiet(self) -> None:
        """Wait until no user is joined and no conclusion runs (every generation of every
        layer sandbox concluded, or carried when busy). Unbounded: the caller bounds it."""
        while self._joined or self._concluding:
            await self._changed.wait()

    async def stop(self) -> None:
        """The daemon stops: refuse every newcomer (`runtime_unavailable`), conclude
        nothing more (a last user's generation is carried for `keep_left`), and wait for
        the conclusions running now (each bounded by its engine calls and its apply).
        Then the containers may be removed: nothing swaps or scans a layer any more."""
        self._stopping = True
        while self._concluding:
            await self._changed.wait()

    async def keep_left(self) -> list[ProcChanges]:
        """After `stop` and the containers' removal: keep each torn-down layer's
        generation that still holds changes (users that did not end, or carried ones) as
        a `pending` set — scanned, nothing applied (a generation all of whose users asked
        "discard" is discarded) — journaled `changes.kept` and `changes.stopped
        {generation, changeset, mode, procs, sessions}` (the mode its users asked, ids
        only) as the last user's actor. A layer not unmounted (its container could not
        be removed: something may still write it) is left for the next start's
        recovery, logged. Then waits (at most `RECLAIM_WAIT_S`) for the background removal of
        settled layers. Returns the summaries. Costs a scan per generation kept."""
        kept: list[ProcChanges] = []
        for sandbox_id, (sandbox, req) in list(self._layers.items()):
            layer = sandbox.layer
            assert layer is not None
            users = layer.users
            holders = [*users.carried, *users.ended, *users.active.values()]
            if not holders or sandbox_id in self._kept:
                continue
            if not layer.unmounted:
                log.error(
                    "the layer of %s is still mounted at shutdown: its generation %d is "
                    "left for the next start",
                    sandbox_id[:12],
                    layer.plan.generation,
                )
                continue
            try:
                changes = await self._keep(sandbox, req, holders)
            except Exception:  # one layer's failure must not leave the others unkept
                log.exception("keeping the layer of %s at shutdown failed", sandbox_id[:12])
                continue
            if changes is not None:
                self._kept[sandbox_id] = changes
                kept.append(changes)
        # The settled layers' background removal holds fds beneath the layers' directory:
        # done (bounded; what is left, the next start sweeps) before its bind is swept.
        if not await trio.to_thread.run_sync(RECLAIMER.wait_idle, RECLAIM_WAIT_S):
            log.warning(
                "settled layers still being removed at shutdown: the next start sweeps them"
            )
        return kept

    async def _keep(self, sandbox: S, req: Request, holders: list[User]) -> ProcChanges | None:
        layer = sandbox.layer
        assert layer is not None
        if self._writer is None:
            return None
        if not await trio.to_thread.run_sync(upper_holds_changes, layer.plan.upper):
            return None  # nothing written: the next start removes the empty generation
        asked = combined(u.mode for u in holders)
        actor = holders[-1].actor
        keep = msgspec.structs.replace(
            req, actor=actor, changes="discard" if asked == "discard" else "review"
        )
        try:
            with trio.CancelScope(shield=True):
                changes = await conclusion.conclude(
                    self._containers, self._writer, sandbox, keep, self._changesets, self._limiter
                )
        finally:
            # Whatever it held is in the set now (or its error says why not); nobody can
            # join a stopping daemon's layer, and nothing writes a torn-down one.
            layer.users.concluded(kept=False)
        if changes is None:
            return None
        ids = list(dict.fromkeys(u.id for u in holders))
        data = {
            "generation": changes.generation,
            "changeset": changes.changeset,
            "mode": asked,
            "procs": [u for u in ids if not u.startswith(SESSION_PREFIX)],
            "sessions": [u for u in ids if u.startswith(SESSION_PREFIX)],
        }
        if changes.error is not None:
            data["error"] = changes.error
        await self._append("changes.stopped", data, req.ws.id, actor)
        return changes

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _prune(self) -> None:
        """Forget torn-down layers whose generation holds nothing (bounded by the
        sandboxes made since the last join)."""
        for sandbox_id, (sandbox, _req) in list(self._layers.items()):
            layer = sandbox.layer
            if layer is None or (
                layer.closed
                and not (layer.users.active or layer.users.ended or layer.users.carried)
            ):
                del self._layers[sandbox_id]

    async def _conclude(self, use: Use[S], step: Conclusion) -> ProcChanges | None:
        if self._writer is None:
            return None
        req = msgspec.structs.replace(use.req, actor=step.actor, changes=step.mode)
        changes = await conclusion.conclude(
            self._containers, self._writer, use.sandbox, req, self._changesets, self._limiter
        )
        if changes is not None and changes.error != "layer_busy":
            self._remember(step.users, changes)
        if changes is not None and len(step.users) > 1 and changes.error != "layer_busy":
            data = {
                "generation": changes.generation,
                "changeset": changes.changeset,
                "mode": step.mode,
                "procs": [u for u in step.users if not u.startswith(SESSION_PREFIX)],
                "sessions": [u for u in step.users if u.startswith(SESSION_PREFIX)],
            }
            await self._append("changes.shared", data, req.ws.id, step.actor)
        return changes

    async def _append(self, kind: str, data: dict[str, Any], workspace: str, actor: str) -> None:
        try:
            await trio.to_thread.run_sync(
                functools.partial(
                    self._journal.append, kind, data, workspace=workspace, actor=actor
                ),
                limiter=self._limiter,
            )
        except Exception:  # the set is applied (or kept) and journaled already
            log.exception("journaling %s failed", kind)


def _refresh(layer: working_layer.WorkingLayer, ws: Workspace) -> bool:
    """`working_layer.refresh` (in a worker thread); when it mounted the generation again
    with nothing waiting in its upper dir, the generation's start is forgotten, so the
    next user's start is the time since which a checkout change is the host's
    (`working_layer.begin`): it sees everything before it."""
    with ws.use():
        done = working_layer.refresh(layer, ws.root_fd)
    if done and upper_holds_changes(layer.plan.upper) is False:
        layer.began = (-1, 0)
    elif done and layer.watch is not None:
        layer.watch.forget_names()  # the since-time is older than this mount
    return done


def journal_summary(changes: ProcChanges) -> dict[str, Any]:
    """`changes` for a journal entry: generation, mode, counts, and the changeset,
    `deferred` and `error` when set; no per-file lists."""
    summary: dict[str, Any] = {
        "generation": changes.generation,
        "mode": changes.mode,
        "counts": msgspec.to_builtins(changes.counts),
    }
    if changes.changeset is not None:
        summary["changeset"] = changes.changeset
    if changes.deferred:
        summary["deferred"] = True
    if changes.error is not None:
        summary["error"] = changes.error
    return summary
