"""The end of a command on a `workspace = "layer"` sandbox: unmount, scan, apply, mount
the next (docs/working-layer.md).

Theory of operation. Commands and terminals on one layer sandbox that overlap share its
generation (`layer.users`, `layer.generation`): none waits for another, and the
generation concludes once, when the last of them ends (a newcomer waits only while that
conclusion runs, then joins the next generation), so every change belongs to exactly one
generation and is applied once. When the last user has ended — also killed, timed out or
cancelled, under the runner's shielded conclusion — `conclude`, given the last user's
request with the users' combined mode and the actor of the last that ran:

0. looks whether anything changed at all (`_changed`): a generation whose upper dir
   holds nothing (a `true`, a read-only `grep`, a test run writing only under /tmp)
   and whose passthrough dirs are still the checkout's stays mounted as it is, with no
   swap, re-verification, scan or change set (`changes {generation, mode}` and zero
   counts); its next user joins it as it is, since-time and all — unless the checkout
   changed meanwhile: then `layer.users` mounts it again first (docs/working-layer.md,
   "The fresh view"). That is most commands, and it saves the swap's mount calls and
   the observation (about 10 ms of a warm command);
1. unmounts the generation (`working_layer.unmount_current`, the first half of a swap);
   its upper dir stays on disk, untouched, until the set settles (step 2) or is
   discarded;
2. scans the old upper dir against the checkout and, by the request's `changes` mode:
   "apply" applies the change set through the guarded path (`layer.changes.scan` /
   `apply`), as the command's actor; "review" applies nothing; both keep the set by id
   (`layer.changes.Changesets`, `applied` or `pending`) for `changes.get/apply/
   discard`; "discard" scans nothing, removes the old upper (and work) dir and keeps
   nothing. A change the host overtook during the generation (a file it edited,
   replaced, removed or renamed away, a directory it removed:
   `layer.changes.host_edits`) is kept in the set as blocked (`host_changed`): no
   later `changes.apply` overwrites or re-creates it. Each conflict's version
   (the command's bytes) is kept as an artifact (`Changesets.keep_versions`,
   `layer.keep`); an applied set with nothing pending and every version kept
   is settled: its upper and work dirs are removed (`Changesets.finish`);
3. mounts the next generation (`working_layer.mount_next`: after the apply, so it shows
   the set, and the apply's own changes to the checkout are in the watch's drain before
   it) and observes the sandbox's facts again (`Sandboxes.reverify_layer`): a failure
   or a mismatch drops the sandbox (`layer_failed`, `layer_unverified`);
4. returns a bounded summary (`schema.proc.ProcChanges`), each conflict naming the
   artifact of its version.

Before any of this, nothing of the generation's users may still run: every user ended,
so whatever unprotected process is left in the sandbox (a straggler a command's own
kill could not end, or one that belongs to no command) is killed (`_sweep`). A
generation still in use after that (EBUSY: something else holds it, such as a process
of the host with a descriptor on it) is kept: nothing is applied now (`layer_busy`) and
its changes go, whole, with the next conclusion's (in a mode that counts its users':
`Users.concluded(kept=True)`). Busy again at that next conclusion, it is not kept once
more: the sandbox is removed (the engine ends everything in it; the next command gets a
fresh one, journaled `container.removed` with reason `layer_busy`) and the generation
is concluded as it is (`_swap_or_settle`): a generation is never busy forever.
The reactive write gate never runs for a layer sandbox: the layer never writes the
checkout.

The sandbox layer sits above this package: what a conclusion needs of it is two small
Protocols, `LayerSandbox` (its id, its layer, `kill_left`) and `Sandboxes` (re-verify,
remove), which `substrate.sandbox`'s `Sandbox` and `Containers` satisfy.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from typing import Literal, Protocol, TypeVar

import msgspec
import trio

from substrate.errors import ConfinementUnmet, Refusal
from substrate.layer import git_conclusion, keep
from substrate.layer.changes import (
    ApplyResult,
    Blocked,
    Change,
    ChangeSet,
    Changesets,
    Outcomes,
    apply,
    git_refs,
    host_edits,
    remove_layer,
    scan,
    upper_holds_changes,
)
from substrate.layer.changes.blocked import drafts as blocked_drafts
from substrate.layer.changes.versions import Versions
from substrate.layer.mounts import passthrough, passthrough_scan, working_layer
from substrate.layer.mounts.plan import LayerPlan
from substrate.metrics import METRICS
from substrate.schema.proc import ChangeCounts, ChangeEntry, ChangesMode, ProcChanges
from substrate.workspace.policy import GlobSet
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer

log = logging.getLogger("substrate.layer.conclusion")

#: At most this many entries per list of a result's `changes` (`counts` has the totals).
MAX_CHANGE_ENTRIES = 1000
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """What a conclusion is asked: the workspace, the actor its applied set is journaled
    as, and what is done with the changes (a `proc.run`'s `changes`, combined over the
    generation's users)."""

    ws: Workspace
    actor: str
    changes: ChangesMode = "apply"


class LayerSandbox(Protocol):
    """A layer sandbox as its generation's users and conclusion see it (the sandbox
    layer's `Sandbox` is one)."""

    @property
    def id(self) -> str: ...

    @property
    def layer(self) -> working_layer.WorkingLayer | None: ...

    async def kill_left(self, limiter: trio.CapacityLimiter | None = None) -> int:
        """Kill every unprotected process left in the sandbox; how many there were."""
        ...


S = TypeVar("S", bound=LayerSandbox)
S_contra = TypeVar("S_contra", bound=LayerSandbox, contravariant=True)


class Sandboxes(Protocol[S_contra]):
    """What a conclusion asks of whoever owns the sandboxes (the sandbox layer's
    `Containers`): the layer never removes or observes a container itself."""

    async def reverify_layer(self, sandbox: S_contra, ws: Workspace) -> None:
        """Observe again what a swap can change; `confinement_unmet` on a mismatch."""
        ...

    async def forget(self, sandbox: S_contra, reason: str) -> None:
        """Remove the sandbox (journaled `container.removed` with `reason`)."""
        ...


async def conclude(
    containers: Sandboxes[S],
    writer: Writer,
    sandbox: S,
    req: Request,
    changesets: Changesets | None,
    limiter: trio.CapacityLimiter | None = None,
) -> ProcChanges | None:
    """Swap, re-verify, scan and apply, keep or discard the ended command's layer (see
    the module doc); None for a sandbox with no layer. Never raises a refusal: each
    failure is the summary's `error`. Call it shielded. Cost: two to four mount calls,
    one observation, and the scan and apply (a read and hash per changed file, two
    fsyncs per applied file) or the removal; with passthrough dirs bound, their walk
    (`passthrough_scan.inspect`), whose findings join `blocked` (`rule: "passthrough"`)
    and are journaled `changes.blocked`, in a transaction after the set's."""
    layer = sandbox.layer
    found: list[passthrough_scan.Finding] = []
    if layer is not None and layer.plan.passthrough:
        found = await trio.to_thread.run_sync(_inspect_passthrough, layer, req.ws, limiter=limiter)
    changes = await _conclude(containers, writer, sandbox, req, changesets, limiter)
    if changes is not None and layer is not None and changesets is not None:
        changes = await _conclude_git(layer, req, changes, changesets, limiter)
    if changes is None or not found:
        return changes
    log.warning("passthrough dirs of %s: %d findings", sandbox.id[:12], len(found))
    extra = [
        ChangeEntry(path=f.path, reason=f.reason, rule="passthrough", mode=f.mode) for f in found
    ]
    counts = msgspec.structs.replace(changes.counts, blocked=changes.counts.blocked + len(found))
    listed = (changes.blocked + extra)[:MAX_CHANGE_ENTRIES]
    if changesets is not None:  # named in the journal too, after the set's own entries
        ws = req.ws
        named = blocked_drafts(
            ws.root_id,
            ws.id,
            req.actor,
            changes.changeset,
            changes.generation,
            ApplyResult(),
            found=[(f.path, f.reason) for f in found],
        )
        await trio.to_thread.run_sync(changesets.append_named, named, limiter=limiter)
    return msgspec.structs.replace(changes, blocked=listed, counts=counts)


async def _conclude_git(
    layer: working_layer.WorkingLayer,
    req: Request,
    changes: ProcChanges,
    changesets: Changesets,
    limiter: trio.CapacityLimiter | None,
) -> ProcChanges:
    """The git layer's part of a conclusion (`git_refs.conclude`): its ref entries join
    the result's lists and the set (a set of their own when no file changed). Not for a
    generation carried busy (it goes with the next) nor a layer torn down meanwhile (its
    refs are reported by the next sandbox's first conclusion: the baseline stays). Not
    even a thread hop when nothing it reads changed (`git_conclusion.quiet`)."""
    part = layer.plan.git
    if part is None or layer.closed or changes.error == "layer_busy" or changes.deferred:
        return changes
    if git_conclusion.quiet(layer, part, req.changes, git_conclusion.QUIET_LOOP_ENTRIES):
        return changes
    try:
        refs = await trio.to_thread.run_sync(
            git_conclusion.refs,
            req.ws,
            req.changes,
            req.actor,
            layer,
            part,
            GlobSet.of(layer.git_refs_allow),
            changes,
            changesets,
            limiter=limiter,
        )
    except (Refusal, OSError) as exc:
        log.error("concluding the git layer of %s failed: %s", req.ws.id, exc)
        return changes
    if refs is None:
        return changes
    cs_id, found = refs
    lists = git_refs.ref_lists(found)
    counts = changes.counts
    counts = msgspec.structs.replace(
        counts,
        applied=counts.applied + len(lists["applied"]),
        unchanged=counts.unchanged + len(lists["unchanged"]),
        blocked=counts.blocked + len(lists["blocked"]),
        pending=counts.pending + len(lists["pending"]),
        conflicts=counts.conflicts + len(lists["conflicts"]),
    )
    return msgspec.structs.replace(
        changes,
        changeset=cs_id,
        applied=(changes.applied + lists["applied"])[:MAX_CHANGE_ENTRIES],
        blocked=(changes.blocked + lists["blocked"])[:MAX_CHANGE_ENTRIES],
        pending=(changes.pending + lists["pending"])[:MAX_CHANGE_ENTRIES],
        conflicts=(changes.conflicts + lists["conflicts"])[:MAX_CHANGE_ENTRIES],
        counts=counts,
    )


def _inspect_passthrough(
    layer: working_layer.WorkingLayer, ws: Workspace
) -> list[passthrough_scan.Finding]:
    """What the generation's users left in its passthrough dirs (`passthrough_scan`):
    changes since the generation began count as theirs; with no start known, nothing is
    neutralised (a person's file is never touched on a guess)."""
    generation, began = layer.began
    since = began if generation == layer.plan.generation else 1 << 62
    readonly = {part.rel for part in layer.plan.readonly}
    dirs = [part.rel for part in layer.plan.passthrough]
    try:
        with ws.use():
            return passthrough_scan.inspect(ws.root_fd, dirs, since, readonly)
    except Refusal:  # the workspace was released meanwhile: the conclusion says so
        return []


async def _conclude(
    containers: Sandboxes[S],
    writer: Writer,
    sandbox: S,
    req: Request,
    changesets: Changesets | None,
    limiter: trio.CapacityLimiter | None,
) -> ProcChanges | None:
    layer = sandbox.layer
    if layer is None:
        return None
    ws, mode = req.ws, req.changes
    error: str | None = None
    await _sweep(sandbox, limiter)
    try:
        if not await _needs_swap(layer, ws, limiter):
            return ProcChanges(generation=layer.plan.generation, mode=mode)
        old = await _swap_or_settle(containers, sandbox, layer, ws, limiter)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            log.error("swapping the layer of %s failed: %s", sandbox.id[:12], exc)
            await containers.forget(sandbox, "layer_failed")
            return ProcChanges(generation=layer.plan.generation, error="layer_failed")
        return ProcChanges(generation=layer.plan.generation, error="layer_busy")
    except ConfinementUnmet:
        # The busy generation put back did not verify: nothing runs here again.
        old = layer.plan
        error = "layer_unverified"
        await containers.forget(sandbox, "layer_unverified")
    except Refusal as exc:  # the workspace was released meanwhile: so is the sandbox
        return ProcChanges(generation=layer.plan.generation, error=exc.name)
    if old is None:  # the sandbox was torn down meanwhile: its last layer is still whole
        old = layer.plan
    unmounted: str | None = None
    try:
        changes = await _settle(writer, ws, old, req, layer, changesets, error, limiter)
    finally:  # mounted after the apply (it shows the set), whatever became of it
        if layer.awaiting_mount:
            unmounted = await _mount_next(containers, sandbox, layer, ws, limiter)
    if unmounted is not None and changes.error is None:
        changes = msgspec.structs.replace(changes, error=unmounted)
    return changes


async def _mount_next(
    containers: Sandboxes[S],
    sandbox: S,
    layer: working_layer.WorkingLayer,
    ws: Workspace,
    limiter: trio.CapacityLimiter | None,
) -> str | None:
    """Mount the next generation (`working_layer.mount_next`, after the apply) and
    observe the sandbox again; on any failure the sandbox is dropped and the reason
    returned (`layer_failed`, `layer_unverified`)."""
    try:
        mounted = await trio.to_thread.run_sync(_mount, layer, ws, limiter=limiter)
    except ConfinementUnmet as exc:
        log.error("the next layer of %s did not verify: %s", sandbox.id[:12], exc)
        await containers.forget(sandbox, "layer_unverified")
        return "layer_unverified"
    except (Refusal, OSError) as exc:
        log.error("mounting the next layer of %s failed: %s", sandbox.id[:12], exc)
        await containers.forget(sandbox, "layer_failed")
        return "layer_failed"
    if not mounted:
        return None
    try:
        await containers.reverify_layer(sandbox, ws)
    except Exception as exc:  # any failure to verify it: nothing runs there again
        log.error("the layer of %s did not verify after a swap: %s", sandbox.id[:12], exc)
        await containers.forget(sandbox, "layer_unverified")
        return "layer_unverified"
    return None


async def _settle(
    writer: Writer,
    ws: Workspace,
    old: LayerPlan,
    req: Request,
    layer: working_layer.WorkingLayer,
    changesets: Changesets | None,
    error: str | None,
    limiter: trio.CapacityLimiter | None,
) -> ProcChanges:
    """Discard, keep or apply the unmounted generation `old` (see the module doc)."""
    actor, mode = req.actor, req.changes
    try:
        if mode == "discard":
            await trio.to_thread.run_sync(remove_layer, old.upper, old.work, limiter=limiter)
            return ProcChanges(generation=old.generation, mode="discard", error=error)
        review = mode == "review"
        t0 = trio.current_time()
        result, scanned, kept, changeset_id, versions = await trio.to_thread.run_sync(
            _scan_apply, writer, ws, old, actor, layer, review, changesets, limiter=limiter
        )
        METRICS.change_outcomes(
            trio.current_time() - t0,
            {
                "applied": len(result.applied),
                "unchanged": len(result.unchanged),
                "blocked": len(result.blocked),
                "pending": len(kept.changes) if review else len(result.pending),
                "conflict": len(result.conflicts),
            },
        )
    except (Refusal, OSError) as exc:
        name = exc.name if isinstance(exc, Refusal) else "layer_failed"
        log.error("concluding generation %d failed: %s", old.generation, exc)
        return ProcChanges(generation=old.generation, mode=mode, error=error or name)
    return summary(
        old.generation,
        scanned,
        result,
        error,
        changeset_id=changeset_id,
        mode=mode,
        review=kept.changes if review else (),
        versions=versions,
    )


async def _sweep(sandbox: LayerSandbox, limiter: trio.CapacityLimiter | None) -> int:
    """Kill every unprotected process left in the sandbox (its generation's users all
    ended: none of it is anyone's now; `kill_left`). The usual case, nothing left, is one
    read of the container's cgroup on the event loop. Returns how many were found."""
    found = await sandbox.kill_left(limiter)
    if found:
        log.warning("%s: %d process(es) outlived their commands: killed", sandbox.id[:12], found)
    return found


async def _swap_or_settle(
    containers: Sandboxes[S],
    sandbox: S,
    layer: working_layer.WorkingLayer,
    ws: Workspace,
    limiter: trio.CapacityLimiter | None,
) -> LayerPlan | None:
    """`_swap`; when busy, the sandbox is swept once more (a straggler that was still
    dying) and the swap tried again. Busy still: raises the EBUSY when the generation was
    not busy before (it is carried: `layer_busy`), else removes the sandbox and returns
    None (the caller concludes the layer as it is)."""
    try:
        return await trio.to_thread.run_sync(_swap, layer, ws, limiter=limiter)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
    await _sweep(sandbox, limiter)
    try:
        return await trio.to_thread.run_sync(_swap, layer, ws, limiter=limiter)
    except OSError as exc:
        if exc.errno != errno.EBUSY or not layer.users.carried:
            raise
    log.error(
        "the layer of %s stayed busy over two conclusions: the sandbox is removed and "
        "generation %d concluded as it is",
        sandbox.id[:12],
        layer.plan.generation,
    )
    await containers.forget(sandbox, "layer_busy")
    return None


async def _needs_swap(
    layer: working_layer.WorkingLayer, ws: Workspace, limiter: trio.CapacityLimiter | None
) -> bool:
    """`_changed`, on the event loop when that is a few system calls on the state dir's
    own disk (no passthrough dir to look up in the checkout, and the layer's lock free of
    mount calls): a thread hop costs more than the look. Else in a worker thread."""
    if not layer.passthrough and layer.mounting.acquire(blocking=False):
        try:
            changed = _upper_changed(layer)
        finally:
            layer.mounting.release()
        return changed
    return await trio.to_thread.run_sync(_changed, layer, ws, limiter=limiter)


def _changed(layer: working_layer.WorkingLayer, ws: Workspace) -> bool:
    """Does the generation need a swap? Not when its upper layer holds nothing and the
    passthrough dirs bound are still those the checkout has: then no user changed
    anything and the same generation serves the next users (with its `began`: its
    overlay's view may date from then); a write by a straggler after this look lands in
    it and goes with its next conclusion. True for a closed layer (the swap path handles
    it)."""
    with ws.use(), layer.mounting:
        if _upper_changed(layer):
            return True
        bound = [(part.rel, part.identity) for part in layer.plan.passthrough]
        if passthrough.existing(ws.root_fd, layer.passthrough) != bound:
            return True
    return False


def _upper_changed(layer: working_layer.WorkingLayer) -> bool:
    """Has the current generation's upper dir anything in it (or is the layer closed,
    or its upper gone: the swap path says what then)? The caller holds `mounting`."""
    return layer.closed or upper_holds_changes(layer.plan.upper) is not False


def _mount(layer: working_layer.WorkingLayer, ws: Workspace) -> bool:
    with ws.use():
        return working_layer.mount_next(layer, ws.root_fd)


def _swap(layer: working_layer.WorkingLayer, ws: Workspace) -> LayerPlan | None:
    with ws.use():
        return working_layer.unmount_current(layer, ws.root_fd)


def _scan_apply(
    writer: Writer,
    ws: Workspace,
    old: LayerPlan,
    actor: str,
    layer: working_layer.WorkingLayer,
    review: bool,
    changesets: Changesets | None,
) -> tuple[ApplyResult, ChangeSet, ChangeSet, str | None, Versions]:
    """Scan `old`'s upper dir; keep the set (`pending` when `review`), or apply it.
    Returns the outcomes, the set as scanned, the set kept, its id and its conflicts'
    versions. The set kept has the host's edits (`host_edits.overtaken`) moved to its
    `blocked` as `host_changed`. An applied set is recorded `applying` before its first change and
    marked `applied` with its summary entry after its last (`Changesets.finish`, which
    also removes a settled set's layer): a crash between leaves it for the next start
    to apply whole (docs/working-layer.md, "Crash and cancel"). The conflicts' versions
    are copied before it is marked: the host's edits' are recorded with the set, so a
    crash never lets its layer go before they are copied."""
    upper_fd = os.open(old.upper, _DIR_FLAGS)
    try:
        with ws.use():
            changeset = scan(
                upper_fd,
                ws.root_fd,
                max_bytes=writer.max_changeset_bytes,
                max_file_bytes=writer.batch.max_file_bytes,
                symlinks=layer.symlinks,
            )
            # After the scan: a host change made while it read the checkout is named too.
            names = working_layer.host_names(layer, ws.root_fd)
            kept, host_changed = host_edits.overtaken(
                ws.root_fd,
                upper_fd,
                changeset,
                layer.began[1],
                layer.landed,
                layer.landed_dirs,
                names=names,
            )
            held = (
                *kept.blocked,
                *(Blocked(path=o.path, kind=o.kind, reason="host_changed") for o in host_changed),
            )
            to_keep = msgspec.structs.replace(kept, blocked=held)
            cs_id = None
            versions = Versions()
            if changesets is not None:
                state: Literal["pending", "applying"] = "pending" if review else "applying"
                versioned = [o.path for o in host_changed if o.kept is not None]
                cs_id = changesets.record(
                    ws, old.generation, old.upper, old.work, to_keep, state, versioned, actor
                )
            result = ApplyResult() if review else apply(writer, ws, upper_fd, kept, actor)
            if changesets is not None and cs_id is not None:
                row = changesets.keep_versions(cs_id, upper_fd, result.conflicts)
                versions = row.versions
                if not review:
                    changesets.finish(
                        cs_id, ws, old.generation, result, "changes.applied", actor=actor
                    )
        done = {o.path for o in (*result.applied, *result.unchanged)}
        landed = [c for c in kept.changes if c.path in done]
        layer.landed = {c.path: c.new_sha256 for c in landed if c.new_sha256 is not None}
        with ws.use():
            layer.landed_dirs = host_edits.dir_stamps(ws.root_fd, landed)
        conflicts = (*result.conflicts, *host_changed)
        result = msgspec.structs.replace(result, conflicts=conflicts)
        return result, changeset, to_keep, cs_id, versions
    finally:
        os.close(upper_fd)


def entries(
    outcomes: tuple[Outcomes, ...],
    changes: Mapping[str, Change] | None = None,
    versions: Versions | None = None,
) -> list[ChangeEntry]:
    """The wire entries of outcomes, at most `MAX_CHANGE_ENTRIES` (`keep.entries`:
    `size`/`mode` from `changes`, a conflict's artifact from `versions`)."""
    return keep.entries(outcomes[:MAX_CHANGE_ENTRIES], changes, versions)


def summary(
    generation: int,
    changeset: ChangeSet,
    result: ApplyResult,
    error: str | None = None,
    *,
    changeset_id: str | None = None,
    mode: ChangesMode = "apply",
    review: tuple[Change, ...] = (),
    versions: Versions | None = None,
) -> ProcChanges:
    """The bounded `changes` of a result: the apply's lists plus what the scan blocked
    (and, kept for review, the changes awaiting `changes.apply`); `size`/`mode` of each
    change, never its diff (`changes.get` has that), and a conflict's artifact."""
    scan_blocked = [
        ChangeEntry(path=b.path, reason=b.reason, kind="symlink" if b.kind == "symlink" else None)
        for b in changeset.blocked[:MAX_CHANGE_ENTRIES]
    ]
    by_path = {c.path: c for c in changeset.changes}
    blocked = (entries(result.blocked, by_path) + scan_blocked)[:MAX_CHANGE_ENTRIES]
    return ProcChanges(
        generation=generation,
        changeset=changeset_id,
        mode=mode,
        review=[keep.change_entry(c) for c in review[:MAX_CHANGE_ENTRIES]],
        applied=entries(result.applied, by_path),
        blocked=blocked,
        pending=entries(result.pending, by_path),
        conflicts=entries(result.conflicts, by_path, versions),
        counts=ChangeCounts(
            applied=len(result.applied),
            unchanged=len(result.unchanged),
            blocked=len(result.blocked) + len(changeset.blocked),
            pending=len(result.pending),
            conflicts=len(result.conflicts),
            review=len(review),
        ),
        error=error,
    )
