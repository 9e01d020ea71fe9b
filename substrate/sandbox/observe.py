"""Observe a container's confinement from outside: procfs, cgroups, its network namespace
(pyroute2) and the engine's inspect dict. The only kernel reader of `substrate.sandbox.facts`.

`observe(pid, inspect)` returns `Fact`s named as `facts.required_facts` names them. It
never calls the engine (the caller passes the inspect dict it already holds), never runs a
subprocess and never sends a packet: the network namespace is read with two rtnetlink
dumps (links, routes) over a netlink socket opened inside it.

Theory of operation. `/proc/<pid>` is opened once as a directory fd and every procfs file
is read relative to it, so all kernel facts come from the same process (if it exits, the
reads fail instead of landing on a reused pid). The network namespace is read by
`substrate.sandbox.netns` (a netlink socket made inside it on a throwaway thread).

Which process is observed: the container's init (inspect `State.Pid`) or an exec's pid.
Under runsc that pid is gVisor's sandbox process (the Sentry), and what the host can see
of it is read by `substrate.sandbox.observe_gvisor`: under runsc the command's
credentials, capabilities and bind mounts come from the engine, the Sentry's own are
`sandbox_*` facts, and the read-only root and the workspace identities are read through
the gofer, the host process that opens the container's files (docs/confinement.md).

Failure: a source that cannot be read yields its facts with value None (a mismatch for
any required fact) and the reason in `source`; only a pid that does not exist raises
(ProcessLookupError). Cost: about 2 ms of CPU, half of it the namespace switch and the
two dumps; see docs/confinement.md for measurements.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from substrate.layer.mounts import mountinfo
from substrate.layer.mounts.plan import PASSTHROUGH_OPTIONS
from substrate.sandbox import facts as F
from substrate.sandbox import observe_gvisor
from substrate.sandbox import parsers as P
from substrate.sandbox.facts import Fact, FactValue
from substrate.sandbox.netns import read_netns
from substrate.sandbox.readings import facts, failed, read_at, read_path, why

log = logging.getLogger("substrate.sandbox.observe")

#: The engine's default capability set (moby `oci/caps/defaults.go`), for engine-side facts.
ENGINE_DEFAULT_CAPS = frozenset(
    [
        "CHOWN",
        "DAC_OVERRIDE",
        "FSETID",
        "FOWNER",
        "MKNOD",
        "NET_RAW",
        "SETGID",
        "SETUID",
        "SETFCAP",
        "SETPCAP",
        "NET_BIND_SERVICE",
        "SYS_CHROOT",
        "KILL",
        "AUDIT_WRITE",
    ]
)
#: The host paths of the engine's API socket; binding them (or a parent) exposes the engine.
DOCKER_SOCKETS = ("/run/docker.sock", "/var/run/docker.sock")


def observe(
    pid: int,
    inspect: Mapping[str, Any],
    *,
    workspace_target: str = "/workspace",
    layer: bool = False,
) -> list[Fact]:
    """Every confinement fact of the container whose process is `pid` (a host pid).

    `inspect` is the engine's container inspect dict (HostConfig, Config, Mounts, Image).
    Raises ProcessLookupError when `pid` does not exist; every other failure becomes facts
    with value None. Blocking (procfs, cgroupfs, netlink, a thread): call it from a worker
    thread. Cost: about 2 ms of CPU, no subprocess (docs/confinement.md). `layer`: the
    workspace should be a working layer; `workspace_mount` is then "layer" when the mount
    on the target is a writable overlay with an upper dir, and only read-only
    superblocks count as `readonly_dirs`.
    """
    host_config: Mapping[str, Any] = inspect.get("HostConfig") or {}
    sandboxed = host_config.get("Runtime") == "runsc"
    try:
        proc_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}") from None
    try:
        found = _engine_facts(inspect, workspace_target, sandboxed)
        found += _status_facts(proc_fd, pid, sandboxed)
        if sandboxed:
            found += observe_gvisor.sandbox_facts(proc_fd)
            found = observe_gvisor.gofer_rootfs(found, pid)
        else:
            found += _mount_facts(
                proc_fd, pid, workspace_target, engine_socket_absent(inspect), layer
            )
        found += _cgroup_facts(proc_fd, pid)
        found += _net_facts(proc_fd, pid)
    finally:
        os.close(proc_fd)
    return found


def observe_mounts(
    pid: int, *, engine_ok: bool, workspace_target: str = "/workspace", layer: bool = False
) -> list[Fact]:
    """Only the facts `observe` reads from the container's mountinfo (runc): what a
    working layer's swap can change (`rootfs_readonly`, `workspace_mount`,
    `readonly_dirs`, `tmpfs`, `docker_socket_absent`, and `passthrough` with `layer`).
    `engine_ok`: the engine's binds had no engine socket when the container was made
    (its `inspect` does not change). Raises ProcessLookupError when `pid` is gone.
    Blocking: one procfs read and parse (well under a millisecond)."""
    try:
        proc_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}") from None
    try:
        return _mount_facts(proc_fd, pid, workspace_target, engine_ok, layer)
    finally:
        os.close(proc_fd)


def identities(
    pid: int,
    readonly_dirs: Sequence[str],
    *,
    runtime: str,
    workspace_target: str | None = "/workspace",
    home_target: str | None = None,
) -> list[Fact]:
    """`workspace_identity` facts: (st_dev, st_ino) of the workspace mount and of each
    read-only path over it (`workspace_identity:<rel>`), as the container sees them; with
    `home_target`, `home_identity` of the persistent home mounted there. No workspace
    facts when `workspace_target` is None (a profile that mounts none).

    Read through `/proc/<p>/root` of the process whose root shows the container's mounts:
    `pid` (the init) under runc, its gofer under runsc (`observe_gvisor.gofer_pid`); with
    no gofer found every identity is "absent", a mismatch (fail closed). Never follows a
    symlink at the last component. Blocking: one lstat per path, plus the gofer lookup.
    """
    fs_pid = pid
    if runtime == "runsc":
        gofer = observe_gvisor.gofer_pid(pid)
        fs_pid = -1 if gofer is None else gofer
    found: list[Fact] = []
    targets: list[tuple[str, str]] = []
    if workspace_target is not None:
        targets.append(("workspace_identity", workspace_target))
        targets += [
            (f"workspace_identity:{rel}", f"{workspace_target}/{rel}") for rel in readonly_dirs
        ]
    if home_target is not None:
        targets.append(("home_identity", home_target))
    for name, target in targets:
        path = f"/proc/{fs_pid}/root{target}"
        try:
            st = os.lstat(path)
            plain = stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)
            value = f"{st.st_dev}:{st.st_ino}" if plain else "not-a-directory-or-file"
        except OSError:
            value = "absent"
        found.append(F.make_fact(name, value, source="kernel:lstat", observed_at=time.time()))
    return found


# -- engine -------------------------------------------------------------------------------


def _engine_facts(inspect: Mapping[str, Any], target: str, sandboxed: bool) -> list[Fact]:
    host_config: Mapping[str, Any] = inspect.get("HostConfig") or {}
    config: Mapping[str, Any] = inspect.get("Config") or {}
    mounts: Sequence[Mapping[str, Any]] = inspect.get("Mounts") or ()
    env = [str(e) for e in config.get("Env") or ()]
    values: dict[str, FactValue] = {
        "runtime": str(host_config.get("Runtime") or ""),
        "privileged": bool(host_config.get("Privileged")),
        "network_mode": str(host_config.get("NetworkMode") or ""),
        "image_id": str(inspect.get("Image") or ""),
        "docker_host_unset": not any(e.startswith("DOCKER_HOST=") for e in env),
        "seccomp_policy": F.seccomp_policy_of(str(o) for o in host_config.get("SecurityOpt") or ()),
    }
    if sandboxed:
        values["docker_socket_absent"] = engine_socket_absent(inspect)
        # What runsc was told; the Sentry enforces it where the host kernel cannot see.
        security_opt = [str(o) for o in host_config.get("SecurityOpt") or ()]
        uid, gid = engine_user(str(config.get("User") or ""))
        # The engine lists mounts in no particular order (a Go map); it mounts them
        # shallowest first, so that is the order that says which one is on top.
        binds = sorted(
            ((str(m.get("Destination") or ""), not m.get("RW", True)) for m in mounts),
            key=lambda b: b[0].rstrip("/").count("/"),
        )
        mode, ro_dirs = P.workspace_view(binds, target)
        values |= {
            "no_new_privs": _engine_nnp(security_opt),
            "cap_bnd": engine_kept_caps(host_config),
            "uid": uid,
            "gid": gid,
            "rootfs_readonly": bool(host_config.get("ReadonlyRootfs")),
            "workspace_mount": mode,
            "readonly_dirs": ro_dirs,
            "tmpfs": engine_tmpfs(host_config),
        }
    return facts(values, "engine:inspect")


def _engine_nnp(security_opt: Sequence[str]) -> bool:
    nnp = False
    for opt in security_opt:
        key, _, value = opt.replace("=", ":", 1).partition(":")
        if key == "no-new-privileges":
            nnp = value in ("", "true")
    return nnp


# -- procfs -------------------------------------------------------------------------------


def _status_facts(proc_fd: int, pid: int, sandboxed: bool) -> list[Fact]:
    source = "kernel:proc-status"
    prefix = "sandbox_" if sandboxed else ""
    names = ["no_new_privs", "seccomp_mode", "cap_eff", "cap_prm", "cap_bnd", "cap_amb"]
    names = [prefix + n for n in names] + [prefix + "uid", prefix + "gid"]
    try:
        status = P.parse_status(read_at(proc_fd, "status"))
    except ProcessLookupError:
        raise
    except (OSError, ValueError) as exc:
        return failed(names, source, exc)
    values: list[FactValue] = [
        status.no_new_privs,
        status.seccomp_mode,
        status.cap_eff,
        status.cap_prm,
        status.cap_bnd,
        status.cap_amb,
        P.one_id(status.uids),
        P.one_id(status.gids),
    ]
    return facts(dict(zip(names, values, strict=True)), source)


#: What `observe_mounts` reads (`passthrough` only of a working layer).
MOUNT_FACTS = (
    "rootfs_readonly",
    "workspace_mount",
    "readonly_dirs",
    "tmpfs",
    "docker_socket_absent",
    "passthrough",
    "passthrough_options",
)


def _mount_facts(
    proc_fd: int, pid: int, target: str, engine_ok: bool, layer: bool = False
) -> list[Fact]:
    source = "kernel:mountinfo"
    names = ["rootfs_readonly", "workspace_mount", "readonly_dirs", "tmpfs", "docker_socket_absent"]
    if layer:
        names += ["passthrough", "passthrough_options"]
    try:
        mounts = mountinfo.parse_mountinfo(read_at(proc_fd, "mountinfo"))
    except (OSError, ValueError) as exc:
        return failed(names, source, exc)
    visible = mountinfo.visible_mounts(mounts)
    mode, ro_dirs = P.workspace_view(((m.mount_point, m.read_only) for m in visible), target)
    if layer and _is_layer(visible, target):
        # A working layer: only a read-only *superblock* counts (a per-mount `ro` made on
        # the host does not propagate; an overlay with no upper dir is read-only itself).
        _, ro_dirs = P.workspace_view(
            ((m.mount_point, "ro" in m.super_options) for m in visible), target
        )
        mode = "layer"
    found = facts(
        {
            "rootfs_readonly": P.rootfs_readonly(mounts),
            "workspace_mount": mode,
            "readonly_dirs": ro_dirs,
            "tmpfs": P.tmpfs_facts(mounts),
        },
        source,
    )
    if layer:
        binds = _passthrough_mounts(visible, target)
        found += facts(
            {
                "passthrough": sorted(binds),
                "passthrough_options": sorted(f"{rel}: {opts}" for rel, opts in binds.items()),
            },
            source,
        )
    # The engine's list of binds, checked again against what the kernel mounted.
    in_kernel = any(
        m.root.endswith("/docker.sock") or m.mount_point.endswith("/docker.sock") for m in mounts
    )
    found += facts(
        {"docker_socket_absent": engine_ok and not in_kernel},
        "engine:inspect+kernel:mountinfo",
    )
    return found


def _passthrough_mounts(visible: Sequence[mountinfo.Mount], target: str) -> dict[str, str]:
    """The workspace-relative paths where a writable mount that is not an overlay sits
    over a working layer — its passthrough binds (the read-only parts are overlays) —
    each with which of `PASSTHROUGH_OPTIONS` its per-mount options hold (`rw,nosuid,nodev`
    required: a set-id file or device node left there is inert to the host)."""
    top = target.rstrip("/") + "/"
    return {
        m.mount_point[len(top) :]: ",".join(o for o in PASSTHROUGH_OPTIONS if o in m.options)
        for m in visible
        if m.mount_point.startswith(top) and m.fstype != "overlay" and not m.read_only
    }


def _is_layer(visible: Sequence[mountinfo.Mount], target: str) -> bool:
    """Is the mount on `target` a writable overlay with an upper dir (a working layer)?"""
    on_target = [m for m in visible if m.mount_point == target.rstrip("/")]
    return bool(on_target) and (
        on_target[-1].fstype == "overlay"
        and not on_target[-1].read_only
        and any(o.startswith("upperdir=") for o in on_target[-1].super_options)
    )


# -- cgroups ------------------------------------------------------------------------------


def _cgroup_facts(proc_fd: int, pid: int) -> list[Fact]:
    source = "kernel:proc-cgroup"
    try:
        groups = P.parse_cgroup(read_at(proc_fd, "cgroup"))
        # Only the hierarchies matter; skipping the other lines halves the parse.
        mine = read_path("/proc/self/mountinfo").splitlines()
        host_mounts = mountinfo.parse_mountinfo("\n".join(m for m in mine if " - cgroup" in m))
    except (OSError, ValueError) as exc:
        return failed(["memory_limit", "pids_limit", "cpu_quota"], source, exc)
    found: list[Fact] = []
    # (fact, controller, {version: (the file it is read from, reader)})
    readers: list[tuple[str, str, dict[str, tuple[str, Callable[[str], FactValue]]]]] = [
        (
            "memory_limit",
            "memory",
            {
                "v1": (
                    "memory.limit_in_bytes",
                    lambda d: P.parse_memory_limit_v1(read_path(f"{d}/memory.limit_in_bytes")),
                ),
                "v2": ("memory.max", lambda d: P.parse_max(read_path(f"{d}/memory.max"))),
            },
        ),
        (
            "pids_limit",
            "pids",
            {
                "v1": ("pids.max", lambda d: P.parse_max(read_path(f"{d}/pids.max"))),
                "v2": ("pids.max", lambda d: P.parse_max(read_path(f"{d}/pids.max"))),
            },
        ),
        (
            "cpu_quota",
            "cpu",
            {
                "v1": (
                    "cpu.cfs_quota_us",
                    lambda d: P.parse_cpu_v1(
                        read_path(f"{d}/cpu.cfs_quota_us"), read_path(f"{d}/cpu.cfs_period_us")
                    ),
                ),
                "v2": ("cpu.max", lambda d: P.parse_cpu_max(read_path(f"{d}/cpu.max"))),
            },
        ),
    ]
    for name, controller, read in readers:
        where = P.cgroup_dir(controller, groups, host_mounts)
        if where is None:
            found += facts({name: None}, f"{source} (no {controller} hierarchy)")
            continue
        version, directory = where
        filename, reader = read[version]
        # The kind of source and the file, never the host directory (docs/protocol.md §5: results
        # carry no host paths); the log names the directory when a read fails.
        src = f"cgroup:{filename}"
        try:
            found += facts({name: reader(directory)}, src)
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s in %s: %s", filename, directory, exc)
            found += facts({name: None}, f"{src} ({why(exc)})")
    return found


# -- network namespace --------------------------------------------------------------------


def _net_facts(proc_fd: int, pid: int) -> list[Fact]:
    source = "netns:rtnetlink"
    try:
        links, routes = read_netns(proc_fd)
    except (OSError, ValueError) as exc:
        return failed(["net_links", "net_routes"], source, exc)
    return facts(
        {"net_links": sorted(links.values()), "net_routes": P.outside_routes(routes)}, source
    )


# -- engine (pure readers of the inspect dict) ----------------------------------------


def engine_kept_caps(host_config: Mapping[str, Any]) -> list[str]:
    """The capability set the engine was asked for: defaults - CapDrop + CapAdd, sorted."""
    if host_config.get("Privileged"):
        return list(P.CAP_NAMES)

    def norm(names: Any) -> set[str]:
        return {str(n).upper().removeprefix("CAP_") for n in names or ()}

    drop, add = norm(host_config.get("CapDrop")), norm(host_config.get("CapAdd"))
    base = set() if "ALL" in drop else set(ENGINE_DEFAULT_CAPS) - drop
    if "ALL" in add:
        return list(P.CAP_NAMES)
    return sorted(base | add)


def engine_user(user: str) -> tuple[int | str, int | str]:
    """(uid, gid) of an engine `Config.User` ("1000:1000", "1000", "" = root).

    A name that is not numeric stays a string: resolving it needs the image's passwd.
    """
    name, _, group = user.partition(":")
    uid: int | str = int(name) if name.isdigit() else (0 if name == "" else name)
    if group:
        gid: int | str = int(group) if group.isdigit() else group
    else:
        gid = uid if isinstance(uid, int) else f"{uid}:<primary group>"
    return uid, gid


def engine_tmpfs(host_config: Mapping[str, Any]) -> list[str]:
    """The tmpfs mounts the engine was asked for, as sorted "path=bytes"."""
    out = []
    for path, opts in (host_config.get("Tmpfs") or {}).items():
        size = next((o[5:] for o in str(opts).split(",") if o.startswith("size=")), None)
        out.append(f"{path}={F.tmpfs_pages(P.size_option_bytes(size)) if size else 'unlimited'}")
    for m in host_config.get("Mounts") or ():
        if m.get("Type") == "tmpfs":
            size_bytes = (m.get("TmpfsOptions") or {}).get("SizeBytes")
            size_text = F.tmpfs_pages(int(size_bytes)) if size_bytes else "unlimited"
            out.append(f"{m.get('Target')}={size_text}")
    return sorted(out)


def engine_socket_absent(inspect: Mapping[str, Any]) -> bool:
    """No bind in the engine's mount list exposes the engine's socket (pure)."""
    mounts: Sequence[Mapping[str, Any]] = inspect.get("Mounts") or ()
    return not docker_socket_mounted(str(m.get("Source") or "") for m in mounts) and not any(
        str(m.get("Destination") or "").endswith("/docker.sock") for m in mounts
    )


def docker_socket_mounted(sources: Iterable[str]) -> bool:
    """Does any bind source expose the engine's socket (the socket, or a directory above)?"""
    for src in sources:
        path = "/" + "/".join(p for p in src.split("/") if p)
        if path.rsplit("/", 1)[-1] == "docker.sock":
            return True
        if any(sock == path or sock.startswith(path.rstrip("/") + "/") for sock in DOCKER_SOCKETS):
            return True
    return False
