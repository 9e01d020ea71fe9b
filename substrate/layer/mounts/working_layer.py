"""One sandbox's `WorkingLayer`: its current generation and its identity facts.

The working layer of one `workspace = "layer"` sandbox: its current generation, and
the facts that tie the container's `/workspace` to the overlay the daemon mounted.

`substrate.sandbox.containers` makes one at sandbox creation (`open_layer`, then the
container binds the base `rslave`, then `mount_first`), re-checks it after every swap
(`identity_required` against what the container shows) and tears it down with the
container (`close`). `substrate.layer.conclusion` swaps it when a generation concludes:
when the last of the commands and terminals sharing it ends (`users`,
`substrate.layer.generation`).

Facts: the container's `/workspace` must be the very overlay mounted on the host's base
(`workspace_identity`: its st_dev:st_ino, which is the overlay superblock's), and each
read-only part the very read-only overlay mounted over it (`workspace_identity:<rel>`).
A propagated mount that did not reach the container, or reached it late, shows other
identities: `confinement_unmet`.

Every function here blocks (mount calls, lstat): callers use worker threads.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from substrate.fs.paths import open_dir
from substrate.layer.generation import Users
from substrate.layer.git_baseline import Settled
from substrate.layer.mounts import overlay, passthrough
from substrate.layer.mounts.git_plan import GIT_REL, GitLayerPart
from substrate.layer.mounts.lower_watch import LowerWatch
from substrate.layer.mounts.plan import PASSTHROUGH_OPTIONS, LayerPlan, plan
from substrate.schema.facts import FactValue
from substrate.schema.journal import FreshViewStatus
from substrate.schema.profile import SymlinkMode

log = logging.getLogger("substrate.layer.mounts.working_layer")

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class WorkingLayer:
    """One sandbox's layer. `users` counts the commands and terminals sharing its current
    generation (it concludes when the last ends); `mounting` guards the mounts against a
    teardown racing a swap (a thread lock: both run in worker threads)."""

    plan: LayerPlan  # the generation mounted now
    #: The profile's passthrough dirs; each generation binds those that exist then.
    passthrough: tuple[str, ...] = ()
    #: The profile's `symlinks`: which links its generations' change sets apply.
    symlinks: SymlinkMode = "any"
    #: The facts every generation must show, apart from its identities.
    required: Mapping[str, FactValue] = field(default_factory=dict)
    closed: bool = False  # torn down: nothing may be mounted on the base again
    #: The teardown unmounted everything (`close` succeeded): nothing can write the
    #: generation any more, so it may be scanned without its container.
    unmounted: bool = False
    #: (generation, ns): when its first user (command or terminal) started, less
    #: `CTIME_SLACK_NS`; kept while the generation stays mounted with nothing in it (its
    #: overlay may still show what the checkout held then). A checkout change since
    #: (ctime) was not the layer's: the change set never undoes it
    #: (`layer.changes.host_edits`).
    began: tuple[int, int] = (-1, 0)
    #: path → sha256 of what the last change set put in the checkout: those files are
    #: newer than `began` because the layer wrote them, not the host.
    landed: dict[str, str] = field(default_factory=dict)
    #: path → ctime (ns) of each checkout directory the last change set changed, as its
    #: apply left it: still so, it is the layer's change, not the host's.
    landed_dirs: dict[str, int] = field(default_factory=dict)
    users: Users = field(default_factory=Users)
    mounting: threading.Lock = field(default_factory=threading.Lock)
    #: The profile's `git_refs_allow`: the refs a conclusion applies from the git layer.
    git_refs_allow: tuple[str, ...] = ()
    #: The checkout's watch (`lower_watch`): did it change since the generation was
    #: mounted? None until `mount_first`: unknown, so changed.
    watch: LowerWatch | None = None
    #: How many times a generation was mounted again because its checkout changed.
    remounts: int = 0
    #: Between `unmount_current` and `mount_next`: nothing is mounted on the base.
    awaiting_mount: bool = False
    #: What the git layer's last conclusion left (`changes.git_quiet`), or None.
    git_settled: Settled | None = None

    def stale(self) -> bool:
        """Might the checkout have changed since the generation was mounted? One `poll(2)`
        (`LowerWatch.pending`); true when that cannot be asked without waiting (a mount
        call holds the lock: the caller then asks `refresh`, which waits for it)."""
        if self.watch is None or not self.mounting.acquire(blocking=False):
            return True
        try:
            return self.watch.pending()
        finally:
            self.mounting.release()


#: File ctimes come from a coarse clock that lags the real one by up to a tick; a host
#: edit right after a command started must not look older than it (a false conflict is
#: safe, a missed one loses the edit).
CTIME_SLACK_NS = 50_000_000


def begin(layer: WorkingLayer) -> int:
    """Note that a command starts on the current generation; return the time (ns) since
    which a checkout change is the host's, not this generation's base: set by the
    generation's first user, kept by every later one (also after a conclusion that
    found nothing and left it mounted)."""
    if layer.began[0] != layer.plan.generation:
        layer.began = (layer.plan.generation, time.time_ns() - CTIME_SLACK_NS)
    return layer.began[1]


def open_layer(
    state_dir: str,
    readonly: Sequence[tuple[str, tuple[int, int]]],
    passthrough_dirs: Sequence[str] = (),
    symlinks: SymlinkMode = "any",
    git: GitLayerPart | None = None,
) -> WorkingLayer:
    """Plan generation 0 of a new layer (a fresh random id) and `overlay.prepare` it: the
    base exists, shared, with nothing mounted on it. `git`: the checkout's git layer,
    mounted on `.git` by every generation (`git_plan`). Refuses as `plan.plan` does."""
    p = plan(state_dir, "s" + secrets.token_hex(8), 0, readonly, (), git)
    overlay.prepare(p)
    return WorkingLayer(plan=p, passthrough=tuple(passthrough_dirs), symlinks=symlinks)


def mount_first(layer: WorkingLayer, root_fd: int) -> None:
    """Mount generation 0 (after the container bound the base), binding the passthrough
    dirs that exist now. Refuses as `overlay.mount_generation` does."""
    with layer.mounting:
        # The watch first: every change after its walk queues an event, so nothing made
        # before a mount can be missed by the next command's `refresh`.
        if layer.watch is None:
            layer.watch = LowerWatch.open(root_fd, skip=layer.passthrough)
        layer.watch.drain(root_fd)
        first = _with_passthrough(layer.plan, passthrough.existing(root_fd, layer.passthrough))
        overlay.mount_generation(first, root_fd)
        layer.plan = first
        layer.watch.mounted()


def next_plan(
    p: LayerPlan, passthrough_dirs: Sequence[tuple[str, tuple[int, int]]] = ()
) -> LayerPlan:
    """The plan of the generation after `p`: same read-only parts, and the passthrough
    dirs (path, identity) given (those that exist now)."""
    readonly = [(part.rel, part.identity) for part in p.readonly]
    sandbox_id = p.sandbox_dir.rsplit("/", 1)[1]
    state_dir = p.layers_dir.rsplit("/", 1)[0]
    return plan(state_dir, sandbox_id, p.generation + 1, readonly, passthrough_dirs, p.git)


def _with_passthrough(p: LayerPlan, found: Sequence[tuple[str, tuple[int, int]]]) -> LayerPlan:
    readonly = [(part.rel, part.identity) for part in p.readonly]
    sandbox_id = p.sandbox_dir.rsplit("/", 1)[1]
    state_dir = p.layers_dir.rsplit("/", 1)[0]
    return plan(state_dir, sandbox_id, p.generation, readonly, found, p.git)


def unmount_current(layer: WorkingLayer, root_fd: int) -> LayerPlan | None:
    """The first half of a swap: unmount the generation that concludes and plan the next
    (`layer.plan`, not mounted yet: `mount_next` mounts it once the change set is
    applied, so it shows the checkout with it). Returns the old plan (its upper dir holds
    the users' changes), or None when the layer was closed meanwhile. Raises OSError
    (EBUSY) when the generation is in use: it stays mounted and verified
    (`overlay.unmount_or_restore`)."""
    with layer.mounting:
        if layer.closed:
            return None
        old = layer.plan
        overlay.unmount_or_restore(old, root_fd)
        layer.plan = next_plan(old)
        layer.awaiting_mount = True
        return old


def mount_next(layer: WorkingLayer, root_fd: int) -> bool:
    """The second half of a swap: mount the planned generation, binding the passthrough
    dirs that exist now, after draining the checkout's watch (the apply's own changes
    are in the drain: the new mount shows them, so they cost the next command nothing).
    False when there is nothing to mount (the layer closed). Refuses as
    `overlay.mount_generation` does (then nothing is mounted: the caller drops the
    sandbox)."""
    with layer.mounting:
        if layer.closed or not layer.awaiting_mount:
            return False
        if layer.watch is not None:
            layer.watch.drain(root_fd)
        new = _with_passthrough(layer.plan, passthrough.existing(root_fd, layer.passthrough))
        overlay.mount_generation(new, root_fd)
        layer.plan = new
        layer.awaiting_mount = False
        if layer.watch is not None:
            layer.watch.mounted()
        return True


def host_names(layer: WorkingLayer, root_fd: int) -> dict[str, frozenset[str]] | None:
    """At a conclusion, with the generation unmounted: drain the checkout's watch and
    return the names the host changed in each watched directory since the generation
    was mounted (`LowerWatch.host_names`), or None when that is not known."""
    with layer.mounting:
        if layer.watch is None:
            return None
        layer.watch.drain(root_fd)
        return layer.watch.host_names()


def refresh(layer: WorkingLayer, root_fd: int) -> bool:
    """Before a command starts a generation (no other user on it): when the checkout
    changed since the generation was mounted (`LowerWatch.drain`), mount it again
    (`overlay.remount`: same upper dir, the passthrough dirs found again) so the command
    sees the checkout as it is now (docs/working-layer.md, "The fresh view"). Returns
    whether it did; the caller then re-verifies the container's view (and forgets the
    generation's `began` when nothing waits in its upper dir). False for a closed layer.
    Raises as `overlay.remount` does (OSError(EBUSY): the generation stays, verified)."""
    with layer.mounting:
        if layer.closed:
            return False
        watch = layer.watch
        if watch is not None and not watch.drain(root_fd):
            return False
        old = layer.plan
        new = _with_passthrough(old, passthrough.existing(root_fd, layer.passthrough))
        overlay.remount(old, new, root_fd)
        layer.plan = new
        layer.remounts += 1
        if watch is not None:
            watch.mounted()
        return True


def identity_required(layer: WorkingLayer) -> dict[str, FactValue]:
    """`workspace_identity` facts of the generation mounted now, read on the host: the
    overlay on the base, the git layer's on `.git`, each read-only part over it (opened
    beneath the base without following a symlink); and `passthrough`, the dirs this generation binds read-write
    (the container's mountinfo must show exactly those as writable non-overlay mounts)."""
    p = layer.plan
    base_fd = os.open(p.base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(base_fd)
        found: dict[str, FactValue] = {
            "workspace_identity": f"{st.st_dev}:{st.st_ino}",
            "passthrough": sorted(part.rel for part in p.passthrough),
            "passthrough_options": sorted(
                f"{part.rel}: {','.join(PASSTHROUGH_OPTIONS)}" for part in p.passthrough
            ),
        }
        if p.git is not None:  # the git layer's overlay, seen through the base
            gst = os.lstat(GIT_REL, dir_fd=base_fd)
            found[f"workspace_identity:{GIT_REL}"] = f"{gst.st_dev}:{gst.st_ino}"
        for part in p.readonly:
            *parents, name = part.rel.split("/")
            parent = open_dir(base_fd, parents, where=part.rel)
            try:
                pst = os.lstat(name, dir_fd=parent)
            finally:
                os.close(parent)
            found[f"workspace_identity:{part.rel}"] = f"{pst.st_dev}:{pst.st_ino}"
        return found
    finally:
        os.close(base_fd)


def close(layer: WorkingLayer) -> None:
    """Unmount the layer (after its container is gone); the upper dirs stay on disk.
    A failure is logged: the start-up sweep unmounts what is left."""
    with layer.mounting:
        layer.closed = True
        if layer.watch is not None:
            layer.watch.close()
        try:
            overlay.teardown(layer.plan)
        except OSError as exc:
            log.error("tearing down layer %s failed: %s", layer.plan.sandbox_dir, exc)
        else:
            layer.unmounted = True


def fresh_view(layers: Iterable[WorkingLayer]) -> FreshViewStatus:
    """`daemon.status`'s `fresh_view` over `layers` (the live ones): on the event loop,
    no system call."""
    found = [layer for layer in layers if not layer.closed]
    reasons = {
        layer.watch.degraded
        for layer in found
        if layer.watch is not None and layer.watch.degraded is not None
    }
    return FreshViewStatus(
        layers=len(found),
        watched_dirs=sum(layer.watch.dirs for layer in found if layer.watch is not None),
        remounts=sum(layer.remounts for layer in found),
        degraded=sum(
            1 for layer in found if layer.watch is None or layer.watch.degraded is not None
        ),
        reasons=sorted(reasons),
    )
