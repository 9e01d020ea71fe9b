"""The overlay a sandbox sees as `/workspace`: make, swap, observe, tear down.

The working layer's host-side mounts: make, swap, observe and tear down the overlay
that a sandbox sees as `/workspace` (plan and check: `substrate.layer.mounts.plan`).

Theory of operation. Everything is a `mount(2)` / `umount2(2)` system call through
ctypes (no `mount` binary, no shell). `prepare` makes the layer directory a private
self-bind (so nothing under it leaks into the host's peer namespaces) and each sandbox's
base a shared self-bind: the container binds the base `rslave` *before* a generation is
mounted on it, so every later mount and unmount on the base reaches the container.
`mount_generation` mounts the overlay (checkout below, `upper/N` above) on the base, then
every read-only part over it — never the other way round: a mount that lands on the base
hides whatever was mounted under it. `swap` unmounts generation N (never lazily: a lazily
detached layer could still take writes after its change set was read, and they would be
lost) and mounts N+1; each step re-reads mountinfo and `plan.verify`s it.

Paths handed to the kernel: the checkout is named `/proc/self/fd/<n>` of the root fd the
daemon holds, and every mount target beneath the base is opened first without following
a symlink and named by its fd too: nothing is resolved by path after it was checked.

Every function blocks and needs CAP_SYS_ADMIN in the daemon's mount namespace: callers
use worker threads. Linux only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator

from substrate.errors import ConfinementUnmet
from substrate.fs.paths import open_dir
from substrate.layer.mounts import git_plan
from substrate.layer.mounts.git_plan import GitLayerPart
from substrate.layer.mounts.mountinfo import Mount, parse_mountinfo, visible_mounts
from substrate.layer.mounts.plan import (
    FD_PATH_PREFIX,
    LayerPlan,
    PassthroughPart,
    ReadonlyPart,
    merged_options,
    readonly_options,
    verify,
)

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MNT_DETACH = 0x2
CLONE_NEWNS = 0x00020000
#: At most this many rounds of unmounting in `unmount_under` (each removes every mount
#: visible then): a stack deeper than that is left and reported.
MAX_UNMOUNT_ROUNDS = 64
_OVERLAY_FLAGS = MS_NOSUID | MS_NODEV
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    """`mount(2)`. Raises OSError with the kernel's errno."""
    rc = _libc.mount(
        None if source is None else os.fsencode(source),
        os.fsencode(target),
        None if fstype is None else fstype.encode(),
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def umount(target: str, flags: int = 0) -> None:
    """`umount2(2)`. Raises OSError with the kernel's errno (EBUSY: in use)."""
    if _libc.umount2(os.fsencode(target), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def unshare_mount_namespace() -> None:
    """`unshare(CLONE_NEWNS)` for the calling process (tests model a container with it)."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def read_mounts() -> list[Mount]:
    """The daemon's mounts, from /proc/self/mountinfo (about 0.1 ms per 100 mounts)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())


def mounted_under(path: str, mounts: list[Mount] | None = None) -> list[Mount]:
    """Every mount at `path` or beneath it, in mountinfo order (visible or not)."""
    found = read_mounts() if mounts is None else mounts
    return [m for m in found if m.mount_point == path or m.mount_point.startswith(path + "/")]


def prepare(p: LayerPlan) -> None:
    """Make the sandbox's directories (0700) and its base: the layer directory as a
    private self-bind, the base as a shared self-bind with nothing on it yet. Idempotent:
    a mount already in place is kept. Bind the base into the container (`rslave`) after
    this and before `mount_generation`, else the container pins that generation.
    """
    for path in (p.layers_dir, p.sandbox_dir, p.base, p.empty):
        _mkdir(path)
    for name in ("upper", "work", "ro", "pt"):
        _mkdir(f"{p.sandbox_dir}/{name}")
    points = {m.mount_point for m in read_mounts()}
    if p.layers_dir not in points:
        mount(p.layers_dir, p.layers_dir, None, MS_BIND)
        mount(None, p.layers_dir, None, MS_PRIVATE)
    if p.base not in points:
        mount(p.base, p.base, None, MS_BIND)
        mount(None, p.base, None, MS_SHARED)


def mount_generation(p: LayerPlan, root_fd: int) -> None:
    """Mount generation `p.generation` on the prepared base: the overlay of the checkout
    (`root_fd`, held) under a fresh `p.upper`, then each passthrough directory bound
    read-write from the checkout, then each read-only part, then verify.

    Refuses `confinement_unmet` when `p.upper` already exists (a generation is never
    reused: its contents are a change set), when a read-only part's identity is not the
    planned one or it is neither a directory nor a regular file, or when the mounts the
    kernel shows differ from the plan. On any failure every mount this call made is
    undone before the error is raised. Cost: 2 + 1 or 3 per part mount calls.
    """
    try:
        os.mkdir(p.upper, 0o755)
    except FileExistsError:
        raise ConfinementUnmet(
            f"the upper layer of generation {p.generation} already exists",
            required={"layer_upper": "fresh"},
            observed={"layer_upper": "exists"},
        ) from None
    # The merged root takes the upper dir's owner and mode: the checkout root's.
    root = os.fstat(root_fd)
    os.chown(p.upper, root.st_uid, root.st_gid)
    os.chmod(p.upper, stat.S_IMODE(root.st_mode))
    os.mkdir(p.work, 0o700)
    _mount_on_base(p, root_fd)


def _mount_on_base(p: LayerPlan, root_fd: int) -> None:
    """The overlay of `p` on the base, its passthrough binds and read-only parts, then
    `verify`; every mount undone on a failure."""
    mount("overlay", p.base, "overlay", _OVERLAY_FLAGS, merged_options(p, root_fd))
    try:
        for pass_part in p.passthrough:
            _mount_passthrough(p, pass_part, root_fd)
        if p.git is not None:
            _mount_git(p, p.git, root_fd)
        for part in p.readonly:
            _mount_readonly(p, part, root_fd)
        verify(p, read_mounts())
    except BaseException:
        unmount_generation(p)
        raise


def verify_generation(p: LayerPlan) -> None:
    """`plan.verify` of generation `p` against the daemon's mountinfo now: refuses
    `confinement_unmet` when what is mounted on the base is not exactly that."""
    verify(p, read_mounts())


def unmount_generation(p: LayerPlan) -> None:
    """Unmount whatever generation sits on the base (read-only parts first), leaving the
    base's self-bind. Never lazy: raises OSError(EBUSY) when a mount is in use — in the
    container too, through propagation — having unmounted the parts above it; the caller
    remounts (`swap` does) or stops the users first. Idempotent."""
    unmount_under(p.base, keep_base=True)


def swap(old: LayerPlan, new: LayerPlan, root_fd: int) -> None:
    """Replace generation `old` by a fresh `new` on the same base, verified.

    `old.upper` stays on disk, untouched, for its change set. When `old` cannot be
    unmounted (EBUSY: a process in the sandbox holds it), its read-only parts are mounted
    again, `old` is re-verified, and the OSError is raised: the sandbox keeps its layer
    and nothing is writable that was not. Refuses as `mount_generation` does.
    """
    if (old.base, old.sandbox_dir) != (new.base, new.sandbox_dir):
        raise ValueError("swap between two sandboxes' layers")
    unmount_or_restore(old, root_fd)
    mount_generation(new, root_fd)


def unmount_or_restore(old: LayerPlan, root_fd: int) -> None:
    """Unmount generation `old`; when it is busy, mount back what went (its passthrough
    binds and read-only parts), re-verify it and raise the OSError(EBUSY)."""
    try:
        unmount_generation(old)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        present = {m.mount_point for m in visible_mounts(mounted_under(old.base))}
        for pass_part in old.passthrough:
            if pass_part.target not in present:
                _mount_passthrough(old, pass_part, root_fd)
        if old.git is not None and old.git.target not in present:
            _mount_git(old, old.git, root_fd)
        for part in old.readonly:
            if part.target not in present:
                _mount_readonly(old, part, root_fd)
        verify(old, read_mounts())
        raise


def remount(old: LayerPlan, new: LayerPlan, root_fd: int) -> None:
    """Mount generation `old` again, as `new` (the same generation, upper and work dirs;
    the passthrough dirs found again), so that it shows the checkout as it is now: a
    lower changed under a live overlay is undefined, a fresh superblock looks every name
    up again (docs/working-layer.md, "The fresh view"). What `old.upper` holds stays and
    shows over the checkout as before: sound because the overlay keeps no state about
    the lower beyond the upper's own entries (`merged_options`: no index, no metacopy,
    no redirects, no xino; `plan.verify` checks the kernel took them).

    When `old` cannot be unmounted (EBUSY), it is put back and re-verified and the
    OSError raised, as `swap` does. Refuses `confinement_unmet` when the upper or work
    dir is missing or the new mounts do not verify (then nothing is mounted on the base).
    Cost: the unmounts and mounts of a swap, two mountinfo reads."""
    if (old.base, old.upper, old.work) != (new.base, new.upper, new.work):
        raise ValueError("a remount is of the same generation")
    for path in (new.upper, new.work):
        try:
            kept = stat.S_ISDIR(os.lstat(path).st_mode)
        except FileNotFoundError:
            kept = False
        if not kept:
            raise ConfinementUnmet(
                f"the layer of generation {new.generation} lost a directory",
                required={"layer_upper": "directory"},
                observed={"layer_upper": "other"},
            )
    unmount_or_restore(old, root_fd)
    _mount_on_base(new, root_fd)


def teardown(p: LayerPlan) -> None:
    """Unmount everything under the sandbox's directory, innermost first, the base's
    self-bind included; the upper layers stay on disk. Idempotent. Raises OSError(EBUSY)
    when a mount is in use (never detached lazily)."""
    unmount_under(p.sandbox_dir, keep_base=False)


def sweep(layers_dir: str) -> list[str]:
    """Unmount every leftover under `layers_dir` (a dead daemon's layers) and the layer
    directory's own self-bind; only mounts whose mountinfo point is there are touched.
    Returns the mount points unmounted. Run it after the orphaned containers are gone:
    a busy leftover raises OSError(EBUSY) (after every other one was unmounted)."""
    before = [m.mount_point for m in mounted_under(layers_dir)]
    unmount_under(layers_dir, keep_base=False)
    return before


def unmount_under(path: str, *, keep_base: bool) -> None:
    """Unmount every mount at or beneath `path`, deepest first, round after round (a
    stacked or hidden mount becomes reachable when the one above it goes). With
    `keep_base`, the lowest mount at `path` itself stays. Raises the first OSError after
    trying every reachable mount (of the last round: a mount with mounts under it goes
    in the round after them); EINVAL/ENOENT (already gone) are not errors."""
    failed: OSError | None = None
    for _ in range(MAX_UNMOUNT_ROUNDS):
        mounts = read_mounts()  # one read per round: its cost grows with the host's mounts
        found = mounted_under(path, mounts)
        if keep_base:
            found = _without_lowest_at(found, path)
        if not found:
            break
        reachable = visible_mounts(mounts)
        targets = [m for m in reachable if m in found]
        targets.sort(key=lambda m: m.mount_point.count("/"), reverse=True)
        progress = False
        failed = None  # a mount with mounts still under it may go in the next round
        for m in targets:
            try:
                umount(m.mount_point)
                progress = True
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOENT):
                    failed = failed or exc
        if not progress:
            break
    if failed is not None:
        raise failed
    left = mounted_under(path)
    if keep_base:
        left = _without_lowest_at(left, path)
    if left:
        raise OSError(errno.EBUSY, "mounts left under the layer directory", left[0].mount_point)


def _without_lowest_at(found: list[Mount], path: str) -> list[Mount]:
    at = [m for m in found if m.mount_point == path]
    return [m for m in found if not at or m is not at[0]]


def _mount_readonly(p: LayerPlan, part: ReadonlyPart, root_fd: int) -> None:
    """Mount one read-only part over the merged view: a directory as an overlay of
    itself + `p.empty` right at its target; a file (a worktree's `.git`) through its
    parent's read-only overlay at `part.staging`, bound from there onto the target, the
    staging mount then dropped (the bind keeps the read-only superblock)."""
    *parents, name = part.rel.split("/")
    with _fd(open_dir(root_fd, parents, where=part.rel)) as real_parent:
        st = os.lstat(name, dir_fd=real_parent)
        _check_identity(st, part)
        with (
            _fd(os.open(p.base, _DIR_FLAGS)) as merged,
            _fd(open_dir(merged, parents, where=part.rel)) as merged_parent,
        ):
            if stat.S_ISDIR(st.st_mode):
                with (
                    _fd(os.open(name, _DIR_FLAGS, dir_fd=real_parent)) as real,
                    _fd(os.open(name, _DIR_FLAGS, dir_fd=merged_parent)) as target,
                ):
                    _check_identity(os.fstat(real), part)
                    mount(
                        "overlay",
                        _fd_path(target),
                        "overlay",
                        _OVERLAY_FLAGS,
                        readonly_options(p, real),
                    )
            elif stat.S_ISREG(st.st_mode):
                _mkdir(part.staging)
                mount(
                    "overlay",
                    part.staging,
                    "overlay",
                    _OVERLAY_FLAGS,
                    readonly_options(p, real_parent),
                )
                try:
                    with (
                        _fd(os.open(f"{part.staging}/{name}", _PATH_FLAGS)) as source,
                        _fd(os.open(name, _PATH_FLAGS, dir_fd=merged_parent)) as target,
                    ):
                        if not stat.S_ISREG(os.fstat(target).st_mode):
                            raise ConfinementUnmet(
                                f"{part.rel} is not a regular file in the merged view",
                                required={f"readonly:{part.rel}": "file"},
                                observed={f"readonly:{part.rel}": "other"},
                            )
                        mount(_fd_path(source), _fd_path(target), None, MS_BIND)
                finally:
                    umount(part.staging)
            else:
                raise ConfinementUnmet(
                    f"{part.rel} is neither a directory nor a regular file",
                    required={f"readonly:{part.rel}": "directory or file"},
                    observed={f"readonly:{part.rel}": "other"},
                )


def _mount_git(p: LayerPlan, part: GitLayerPart, root_fd: int) -> None:
    """Mount the git layer (`git_plan`) on the merged view's `.git`: the checkout's
    `.git` directory (opened beneath the held root, no symlink followed, identity
    re-checked) under the checkout's persistent git-layer upper dir."""
    with (
        _fd(os.open(git_plan.GIT_REL, _DIR_FLAGS, dir_fd=root_fd)) as real,
        _fd(os.open(p.base, _DIR_FLAGS)) as merged,
        _fd(os.open(git_plan.GIT_REL, _DIR_FLAGS, dir_fd=merged)) as target,
    ):
        st = os.fstat(real)
        if (st.st_dev, st.st_ino) != part.identity:
            dev, ino = part.identity
            raise ConfinementUnmet(
                ".git changed since the workspace was searched",
                required={"workspace_identity:.git": f"{dev}:{ino}"},
                observed={"workspace_identity:.git": f"{st.st_dev}:{st.st_ino}"},
            )
        mount(
            "overlay",
            _fd_path(target),
            "overlay",
            _OVERLAY_FLAGS,
            git_plan.options(part, _fd_path(real)),
        )


def _mount_passthrough(p: LayerPlan, part: PassthroughPart, root_fd: int) -> None:
    """Bind the checkout's directory `part.rel` (opened beneath the held root, no symlink
    followed, identity re-checked) read-write, `nosuid` and `nodev`, onto the same path
    in the merged view (opened beneath the base the same way; the overlay shows the lower
    dir there). The flags are set on a private staging bind first and the target bound
    from it: a bind copies its source mount's flags, and propagation copies the bind,
    whereas a remount of the target would change the daemon's copy only, not the
    container's."""
    *parents, name = part.rel.split("/")
    _mkdir(part.staging)
    with (
        _fd(open_dir(root_fd, parents, where=part.rel)) as real_parent,
        _fd(os.open(name, _DIR_FLAGS, dir_fd=real_parent)) as real,
        _fd(os.open(p.base, _DIR_FLAGS)) as merged,
        _fd(open_dir(merged, parents, where=part.rel)) as merged_parent,
        _fd(os.open(name, _DIR_FLAGS, dir_fd=merged_parent)) as target,
    ):
        _check_identity(os.fstat(real), part)
        mount(_fd_path(real), part.staging, None, MS_BIND)
        try:
            mount(None, part.staging, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
            with _fd(os.open(part.staging, _DIR_FLAGS)) as staged:
                _check_identity(os.fstat(staged), part)
                mount(_fd_path(staged), _fd_path(target), None, MS_BIND)
        finally:
            umount(part.staging)


def _check_identity(st: os.stat_result, part: ReadonlyPart | PassthroughPart) -> None:
    if (st.st_dev, st.st_ino) != part.identity:
        dev, ino = part.identity
        raise ConfinementUnmet(
            f"{part.rel} changed since the workspace was searched",
            required={f"workspace_identity:{part.rel}": f"{dev}:{ino}"},
            observed={f"workspace_identity:{part.rel}": f"{st.st_dev}:{st.st_ino}"},
        )


def _fd_path(fd: int) -> str:
    return f"{FD_PATH_PREFIX}{fd}"


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _mkdir(path: str) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfinementUnmet(
            "a layer directory is not a directory",
            required={"layer_dir": "directory"},
            observed={"layer_dir": "other"},
        )
