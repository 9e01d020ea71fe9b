"""The working layer's mount plan, and the check of what the kernel shows against it.

Pure: no I/O. `substrate.layer.mounts.overlay` makes the mounts this plans and hands back the
parsed `/proc/self/mountinfo` for `verify`. Layout, for sandbox `S` and generation `N`
(docs/working-layer.md, "Layout and what a generation mounts"):

    <state>/layers/                 the layer directory (a private self-bind: nothing
                                    mounted under it leaks to the host's peer namespaces)
    <state>/layers/S/merged         the base: a self-bind made shared, bound `rslave`
                                    into the container; generation N's overlay sits on it
    <state>/layers/S/upper/N        generation N's upper layer (every sandbox write)
    <state>/layers/S/work/N         overlayfs' work dir for N
    <state>/layers/S/empty          the empty second lower dir of each read-only part
    <state>/layers/S/ro/<i>         staging point of read-only part i when it is a file
    <state>/layers/S/pt/<i>         staging point of passthrough bind i (made nosuid,nodev)

The lower layer is the checkout itself, named at mount time as `/proc/self/fd/<n>` of the
root fd the daemon holds (never a path resolved earlier). Each read-only part (every
`.git`, the policy's whole-directory denies) is an overlay of the real directory plus
`empty` with no upper dir: the kernel makes such a superblock read-only, so it stays
read-only wherever propagation copies it (a `-o ro` bind would not).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from substrate.errors import ConfinementUnmet
from substrate.fs.state import ENTRIES
from substrate.layer.mounts import git_plan
from substrate.layer.mounts.git_plan import GitLayerPart
from substrate.layer.mounts.mountinfo import Mount, visible_mounts

#: The directory under the state dir holding every sandbox's layers.
LAYERS_DIRNAME = ENTRIES.layers.name
#: What a sandbox id may be: it names a directory, and overlayfs' option string and
#: mountinfo must carry every path unescaped.
_SANDBOX_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
#: Characters overlayfs' option parser or mountinfo would split or escape.
_UNSAFE_PATH_CHARS = frozenset(",:=\\ \t\n")
#: The prefix of a lower dir named by a held fd.
FD_PATH_PREFIX = "/proc/self/fd/"


class ReadonlyPart(msgspec.Struct, frozen=True, kw_only=True):
    """One sub-path made read-only at the superblock over the merged view."""

    rel: str  # workspace-relative, as `substrate.sandbox.mounts.readonly_paths` gives it
    identity: tuple[int, int]  # (st_dev, st_ino) the walk found: re-checked at mount time
    target: str  # base + rel: where it is mounted (opened beneath the base, no symlinks)
    staging: str  # where its read-only overlay goes first when the part is a file


#: The per-mount options of every passthrough bind, as mountinfo shows them: a set-id
#: file or a device node the sandbox leaves there is inert to the host through it.
PASSTHROUGH_OPTIONS = ("rw", "nosuid", "nodev")


class PassthroughPart(msgspec.Struct, frozen=True, kw_only=True):
    """One checkout directory bound read-write over the merged view (profile
    `passthrough`): writes under it go straight to the checkout, never to the upper."""

    rel: str  # workspace-relative, validated by `substrate.layer.mounts.passthrough`
    identity: tuple[int, int]  # (st_dev, st_ino) found: re-checked at mount time
    target: str  # base + rel
    #: Where the bind is made nosuid,nodev first (private: never propagated), then bound
    #: onto `target` from there (a remount would not reach the container's copy).
    staging: str = ""


class LayerPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Every path of one sandbox's layer at one generation."""

    layers_dir: str
    sandbox_dir: str
    base: str
    empty: str
    generation: int
    upper: str
    work: str
    readonly: tuple[ReadonlyPart, ...]
    #: Bound read-write before the read-only parts (a `.git` beneath one stays read-only).
    passthrough: tuple[PassthroughPart, ...] = ()
    #: The checkout's `.git` as a writable overlay of its own (`git_plan`); None: none.
    git: GitLayerPart | None = None


def layers_dir(state_dir: str) -> str:
    """The layer directory under `state_dir` (absolute, no trailing slash)."""
    return _join(state_dir.rstrip("/") or "/", LAYERS_DIRNAME)


def plan(
    state_dir: str,
    sandbox_id: str,
    generation: int,
    readonly: Sequence[tuple[str, tuple[int, int]]],
    passthrough: Sequence[tuple[str, tuple[int, int]]] = (),
    git: GitLayerPart | None = None,
) -> LayerPlan:
    """The mount plan of `sandbox_id`'s generation `generation` (pure).

    `readonly` is (workspace-relative path, (st_dev, st_ino)) of each part to make
    read-only: every `.git` and the policy's read-only dirs (`mounts.readonly_paths`).
    Refuses `confinement_unmet` for a state dir that is not absolute or holds a character
    overlayfs' options cannot carry, a sandbox id that is not a plain name, a negative
    generation, or a read-only or passthrough path that is empty, absolute or climbs
    (`..`). `passthrough` is (path, identity) of each existing passthrough directory;
    `git` the git layer mounted on the merged `.git` (its upper and work dirs must carry
    no character overlayfs' options cannot).
    """
    if not state_dir.startswith("/") or _UNSAFE_PATH_CHARS & set(state_dir):
        raise _unmet("state dir", "an absolute path without , : = \\ or blanks", state_dir)
    if not _SANDBOX_ID_RE.fullmatch(sandbox_id):
        raise _unmet("sandbox id", "a plain name ([A-Za-z0-9_.-])", sandbox_id)
    if generation < 0:
        raise _unmet("generation", "a generation >= 0", str(generation))
    if git is not None and _UNSAFE_PATH_CHARS & set(git.upper + git.work):
        raise _unmet("git layer dir", "a path without , : = \\ or blanks", git.upper)
    top = layers_dir(state_dir)
    sandbox_dir = _join(top, sandbox_id)
    base = _join(sandbox_dir, "merged")
    parts = []
    if git is not None:  # the git layer replaces the read-only `.git`
        readonly = [(rel, ident) for rel, ident in readonly if rel != git_plan.GIT_REL]
    for index, (rel, identity) in enumerate(sorted(readonly)):
        _check_rel("readonly path", rel)
        parts.append(
            ReadonlyPart(
                rel=rel,
                identity=identity,
                target=_join(base, rel),
                staging=_join(sandbox_dir, f"ro/{index}"),
            )
        )
    return LayerPlan(
        layers_dir=top,
        sandbox_dir=sandbox_dir,
        base=base,
        empty=_join(sandbox_dir, "empty"),
        generation=generation,
        upper=_join(sandbox_dir, f"upper/{generation}"),
        work=_join(sandbox_dir, f"work/{generation}"),
        readonly=tuple(parts),
        passthrough=tuple(
            PassthroughPart(
                rel=rel,
                identity=identity,
                target=_join(base, rel),
                staging=_join(sandbox_dir, f"pt/{index}"),
            )
            for index, (rel, identity) in enumerate(sorted(passthrough))
            if _check_rel("passthrough path", rel)
        ),
        git=None if git is None else msgspec.structs.replace(git, target=_join(base, ".git")),
    )


def _check_rel(what: str, rel: str) -> bool:
    pieces = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in pieces):
        raise _unmet(what, "a relative path without . or ..", rel)
    return True


#: The merged overlay's features that keep state about the lower layer in the upper or
#: work dir (an index of lower inodes, metadata-only copy-ups whose data stays below,
#: renamed directories redirected to lower paths, inode numbers composed with the lower
#: file system's): all off, whatever the module's defaults, so an upper dir is only ever
#: its own entries and may be mounted again over a lower that changed
#: (`overlay.remount`). Each value is what mountinfo may show for it (nothing when it
#: is the module's default too).
MERGED_FEATURES = {
    "index": "off",
    "metacopy": "off",
    "redirect_dir": "nofollow",
    "xino": "off",
}


def merged_options(p: LayerPlan, lower_fd: int) -> str:
    """The merged overlay's option string: the checkout (held fd) under `p.upper`, with
    `MERGED_FEATURES`."""
    features = ",".join(f"{k}={v}" for k, v in MERGED_FEATURES.items())
    return f"lowerdir={FD_PATH_PREFIX}{lower_fd},upperdir={p.upper},workdir={p.work},{features}"


def readonly_options(p: LayerPlan, real_fd: int) -> str:
    """A read-only part's option string: the real directory (held fd) over `p.empty`,
    no upper dir, so the kernel makes the superblock read-only."""
    return f"lowerdir={FD_PATH_PREFIX}{real_fd}:{p.empty}"


def verify(p: LayerPlan, mounts: Sequence[Mount]) -> None:
    """Check the mounts the kernel shows (`parse_mountinfo` of the daemon's own
    mountinfo) against generation `p.generation` of the plan (pure).

    Required: on the base, visible, an overlay whose one lower dir is a held fd, whose
    upper and work dirs are this generation's and with none of `MERGED_FEATURES` on; at each read-only part's target, visible,
    an overlay superblock that is read-only; at each passthrough target, visible, a
    read-write bind that is not an overlay, `nosuid` and `nodev` (`PASSTHROUGH_OPTIONS`);
    nothing else visible at or under the base.
    Refuses `confinement_unmet` with the required and observed mount facts otherwise.
    """
    visible = visible_mounts(mounts)
    required: dict[str, str] = {p.base: f"overlay upperdir={p.upper} workdir={p.work}"}
    for part in p.readonly:
        required[part.target] = "overlay ro superblock"
    for pass_part in p.passthrough:
        required[pass_part.target] = "bind " + " ".join(PASSTHROUGH_OPTIONS)
    if p.git is not None:
        required[p.git.target] = git_plan.required(p.git)
    observed: dict[str, str] = {}
    for m in visible:
        if m.mount_point == p.base or m.mount_point.startswith(p.base + "/"):
            observed[m.mount_point] = _describe(m, p)
    if observed != required:
        raise ConfinementUnmet(
            f"the working layer of generation {p.generation} is not mounted as planned",
            required={"layer_mounts": _facts(required)},
            observed={"layer_mounts": _facts(observed)},
        )


def _describe(m: Mount, p: LayerPlan) -> str:
    """A mount as `verify` compares it: what it is, not its ids."""
    if m.fstype != "overlay":
        if any(m.mount_point == part.target for part in p.passthrough) and not m.read_only:
            return "bind " + " ".join(o for o in PASSTHROUGH_OPTIONS if o in m.options)
        return f"{m.fstype} {m.source}"
    opts = dict(o.partition("=")[::2] for o in m.super_options)
    lower = opts.get("lowerdir", "").split(":")
    if p.git is not None and m.mount_point == p.git.target:
        git = git_plan.describe(opts, FD_PATH_PREFIX)
        if git is not None:
            return git
    if m.mount_point == p.base:
        plain = all(opts.get(k, v) == v for k, v in MERGED_FEATURES.items())
        if "upperdir" in opts and len(lower) == 1 and lower[0].startswith(FD_PATH_PREFIX):
            if not plain:
                features = " ".join(f"{k}={opts.get(k, '')}" for k in MERGED_FEATURES)
                return f"overlay upperdir={opts['upperdir']} {features}"
            return f"overlay upperdir={opts['upperdir']} workdir={opts.get('workdir')}"
        return f"overlay lowerdir={opts.get('lowerdir')} upperdir={opts.get('upperdir')}"
    ro = "ro" in m.super_options and "upperdir" not in opts
    if ro and len(lower) == 2 and lower[0].startswith(FD_PATH_PREFIX) and lower[1] == p.empty:
        return "overlay ro superblock"
    return f"overlay {'ro' if ro else 'rw'} superblock lowerdir={opts.get('lowerdir')}"


def _facts(found: dict[str, str]) -> list[str]:
    return sorted(f"{point}: {what}" for point, what in found.items())


def _join(parent: str, rel: str) -> str:
    return f"{parent.rstrip('/')}/{rel}"


def _unmet(what: str, required: str, observed: str) -> ConfinementUnmet:
    return ConfinementUnmet(
        f"the working layer cannot be planned: invalid {what}",
        required={"layer_plan": required},
        observed={"layer_plan": observed[:200]},
    )
