"""Observe a container's confinement from outside: procfs, cgroups, its network namespace
(pyroute2) and the engine's inspect dict. The only kernel reader of `substrate.sandbox.facts`.

`observe(pid, inspect)` returns `Fact`s named as `facts.required_facts` names them. It
never calls the engine (the caller passes the inspect dict it already holds), never runs a
subprocess and never sends a packet: the network namespace is read with two rtnetlink
dumps (links, routes) over a netlink socket opened inside it.

Theory of operation. `/proc/<pid>` is opened once as a directory fd and every procfs file
is read relative to it, so all kernel facts come from the same process (if it exits, the
reads fail instead of landing on a reused pid). The netlink socket is created by a
short-lived dedicated thread that `setns(CLONE_NEWNET)`s into the container's namespace,
creates the socket, and switches back: a network-namespace switch affects only the calling
thread, and a socket stays in the namespace it was created in. The thread is thrown away
after, so even a failed switch back cannot leave a pooled worker thread (trio's) inside a
container's namespace. pyroute2's own `IPRoute(netns=...)` forks a helper process per
socket (about 13 ms); this costs about 1 ms, and pyroute2 still encodes and decodes the
messages.

Which process is observed: the container's init (inspect `State.Pid`) or an exec's pid.
Under runsc that pid is gVisor's sandbox process (the Sentry): its status shows the
Sentry's own seccomp filter and credentials, not the command's, so under runsc the
command's credentials, capabilities and bind mounts come from the engine, the kernel view
of the Sentry is reported as `sandbox_*` facts, and the read-only root is read from the
gofer's mounts (`gofer_pid`), the host process that opens the container's files
(docs/confinement.md).

Failure: a source that cannot be read yields its facts with value None (a mismatch for
any required fact) and the reason in `source`; only a pid that does not exist raises
(ProcessLookupError). Cost: about 2 ms of CPU, half of it the namespace switch and the
two dumps; see docs/confinement.md for measurements.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pyroute2.netlink import NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR
from pyroute2.netlink.rtnl import RTM_GETLINK, RTM_GETROUTE
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.marshal import MarshalRtnl
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from substrate.sandbox import facts as F
from substrate.sandbox.facts import Fact, FactValue

log = logging.getLogger("substrate.sandbox.observe")

CLONE_NEWNET = 0x40000000
#: Longest wait for one netlink reply: the kernel answers dumps at once; this is a guard.
NETLINK_TIMEOUT_S = 2.0
#: Largest procfs/cgroup file read (mountinfo of a container is a few KiB).
MAX_READ = 1 << 20
_NETLINK_ROUTE = 0

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
_libc: ctypes.CDLL | None = None


def observe(
    pid: int, inspect: Mapping[str, Any], *, workspace_target: str = "/workspace"
) -> list[Fact]:
    """Every confinement fact of the container whose process is `pid` (a host pid).

    `inspect` is the engine's container inspect dict (HostConfig, Config, Mounts, Image).
    Raises ProcessLookupError when `pid` does not exist; every other failure becomes facts
    with value None. Blocking (procfs, cgroupfs, netlink, a thread): call it from a worker
    thread. Cost: about 2 ms of CPU, no subprocess (docs/confinement.md).
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
            found += _sandbox_facts(proc_fd, pid)
            found = _gofer_rootfs(found, pid)
        else:
            found += _mount_facts(proc_fd, pid, workspace_target, engine_socket_absent(inspect))
        found += _cgroup_facts(proc_fd, pid)
        found += _net_facts(proc_fd, pid)
    finally:
        os.close(proc_fd)
    return found


# -- reading ------------------------------------------------------------------------------


def _read_at(dir_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_path(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_fd(fd: int) -> str:
    chunks = []
    total = 0
    while total <= MAX_READ:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks).decode("utf-8", "surrogateescape")


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def _facts(names_values: Mapping[str, FactValue], source: str) -> list[Fact]:
    now = time.time()
    return [Fact(name=n, value=v, source=source, observed_at=now) for n, v in names_values.items()]


def _failed(names: Sequence[str], source: str, exc: BaseException) -> list[Fact]:
    log.warning("cannot observe %s from %s: %s", ", ".join(names), source, exc)
    return _facts(dict.fromkeys(names), f"{source} ({_why(exc)})")


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
        mode, ro_dirs = F.workspace_view(binds, target)
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
    return _facts(values, "engine:inspect")


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
        status = F.parse_status(_read_at(proc_fd, "status"))
    except ProcessLookupError:
        raise
    except (OSError, ValueError) as exc:
        return _failed(names, source, exc)
    values: list[FactValue] = [
        status.no_new_privs,
        status.seccomp_mode,
        status.cap_eff,
        status.cap_prm,
        status.cap_bnd,
        status.cap_amb,
        F.one_id(status.uids),
        F.one_id(status.gids),
    ]
    return _facts(dict(zip(names, values, strict=True)), source)


def _mount_facts(proc_fd: int, pid: int, target: str, engine_ok: bool) -> list[Fact]:
    source = "kernel:mountinfo"
    names = ["rootfs_readonly", "workspace_mount", "readonly_dirs", "tmpfs", "docker_socket_absent"]
    try:
        mounts = F.parse_mountinfo(_read_at(proc_fd, "mountinfo"))
    except (OSError, ValueError) as exc:
        return _failed(names, source, exc)
    visible = F.visible_mounts(mounts)
    mode, ro_dirs = F.workspace_view(((m.mount_point, m.read_only) for m in visible), target)
    found = _facts(
        {
            "rootfs_readonly": F.rootfs_readonly(mounts),
            "workspace_mount": mode,
            "readonly_dirs": ro_dirs,
            "tmpfs": F.tmpfs_facts(mounts),
        },
        source,
    )
    # The engine's list of binds, checked again against what the kernel mounted.
    in_kernel = any(
        m.root.endswith("/docker.sock") or m.mount_point.endswith("/docker.sock") for m in mounts
    )
    found += _facts(
        {"docker_socket_absent": engine_ok and not in_kernel},
        "engine:inspect+kernel:mountinfo",
    )
    return found


def _sandbox_facts(proc_fd: int, pid: int) -> list[Fact]:
    """The gVisor sandbox process: its user namespace and runsc's flags."""
    found: list[Fact] = []
    source = "kernel:proc-ns-user"
    try:
        theirs = os.stat("ns/user", dir_fd=proc_fd)
        ours = os.stat("/proc/self/ns/user")
        found += _facts(
            {"sandbox_userns": (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino)},
            source,
        )
    except OSError as exc:
        found += _failed(["sandbox_userns"], source, exc)
    source = "kernel:proc-cmdline"
    try:
        argv = _read_at(proc_fd, "cmdline").split("\0")
    except OSError as exc:
        return found + _failed(["sandbox_network", "sandbox_oci_seccomp"], source, exc)
    flags = runsc_flags(argv)
    if not flags or "boot" not in argv:
        return found + _facts(dict.fromkeys(["sandbox_network", "sandbox_oci_seccomp"]), source)
    found += _facts(
        {
            # runsc's own default network is "sandbox" (gVisor's netstack on the host's).
            "sandbox_network": flags.get("network", "sandbox"),
            "sandbox_oci_seccomp": flags.get("oci-seccomp") in ("", "true"),
        },
        source,
    )
    return found


def gofer_pid(sandbox_pid: int) -> int | None:
    """The host pid of the runsc gofer serving the sandbox `sandbox_pid`, or None.

    The gofer is the sandbox's sibling (same parent, the shim), named `runsc-gofer`, in
    the same cgroups. It is the process that opens the container's files on the host, so
    `/proc/<gofer>/root` is the container's root filesystem as the host kernel sees it
    (the Sentry's own root is an empty tmpfs). Cost: a few small procfs reads.
    """
    try:
        status = F.parse_status_field(_read_path(f"/proc/{sandbox_pid}/status"), "PPid")
        if status is None:
            return None
        parent = int(status)
        groups = _read_path(f"/proc/{sandbox_pid}/cgroup")
        children: list[int] = []
        for task in os.listdir(f"/proc/{parent}/task"):
            children += [int(c) for c in _read_path(f"/proc/{parent}/task/{task}/children").split()]
    except (OSError, ValueError):
        return None
    for child in children:
        if child == sandbox_pid:
            continue
        try:
            argv0 = _read_path(f"/proc/{child}/cmdline").split("\0", 1)[0]
            same = _read_path(f"/proc/{child}/cgroup") == groups
        except OSError:
            continue
        if argv0.rsplit("/", 1)[-1] == "runsc-gofer" and same:
            return child
    return None


def _gofer_rootfs(found: list[Fact], sandbox_pid: int) -> list[Fact]:
    """Replace the engine's `rootfs_readonly` with the gofer's mount when it can be seen.

    Only the root filesystem: runsc (20221219) mounts binds read-write in the gofer and
    enforces read-only binds in the Sentry, so the gofer's view of them proves nothing.
    """
    gofer = gofer_pid(sandbox_pid)
    if gofer is None:
        return found
    source = "kernel:gofer-mountinfo"
    try:
        readonly = F.rootfs_readonly(F.parse_mountinfo(_read_path(f"/proc/{gofer}/mountinfo")))
    except (OSError, ValueError) as exc:
        return [f for f in found if f.name != "rootfs_readonly"] + _failed(
            ["rootfs_readonly"], source, exc
        )
    return [f for f in found if f.name != "rootfs_readonly"] + _facts(
        {"rootfs_readonly": readonly}, source
    )


# -- cgroups ------------------------------------------------------------------------------


def _cgroup_facts(proc_fd: int, pid: int) -> list[Fact]:
    source = "kernel:proc-cgroup"
    try:
        groups = F.parse_cgroup(_read_at(proc_fd, "cgroup"))
        # Only the hierarchies matter; skipping the other lines halves the parse.
        mine = _read_path("/proc/self/mountinfo").splitlines()
        host_mounts = F.parse_mountinfo("\n".join(m for m in mine if " - cgroup" in m))
    except (OSError, ValueError) as exc:
        return _failed(["memory_limit", "pids_limit", "cpu_quota"], source, exc)
    found: list[Fact] = []
    # (fact, controller, {version: (the file it is read from, reader)})
    readers: list[tuple[str, str, dict[str, tuple[str, Callable[[str], FactValue]]]]] = [
        (
            "memory_limit",
            "memory",
            {
                "v1": (
                    "memory.limit_in_bytes",
                    lambda d: F.parse_memory_limit_v1(_read_path(f"{d}/memory.limit_in_bytes")),
                ),
                "v2": ("memory.max", lambda d: F.parse_max(_read_path(f"{d}/memory.max"))),
            },
        ),
        (
            "pids_limit",
            "pids",
            {
                "v1": ("pids.max", lambda d: F.parse_max(_read_path(f"{d}/pids.max"))),
                "v2": ("pids.max", lambda d: F.parse_max(_read_path(f"{d}/pids.max"))),
            },
        ),
        (
            "cpu_quota",
            "cpu",
            {
                "v1": (
                    "cpu.cfs_quota_us",
                    lambda d: F.parse_cpu_v1(
                        _read_path(f"{d}/cpu.cfs_quota_us"), _read_path(f"{d}/cpu.cfs_period_us")
                    ),
                ),
                "v2": ("cpu.max", lambda d: F.parse_cpu_max(_read_path(f"{d}/cpu.max"))),
            },
        ),
    ]
    for name, controller, read in readers:
        where = F.cgroup_dir(controller, groups, host_mounts)
        if where is None:
            found += _facts({name: None}, f"{source} (no {controller} hierarchy)")
            continue
        version, directory = where
        filename, reader = read[version]
        # The kind of source and the file, never the host directory (SPEC §5: results
        # carry no host paths); the log names the directory when a read fails.
        src = f"cgroup:{filename}"
        try:
            found += _facts({name: reader(directory)}, src)
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s in %s: %s", filename, directory, exc)
            found += _facts({name: None}, f"{src} ({_why(exc)})")
    return found


# -- network namespace --------------------------------------------------------------------


def _net_facts(proc_fd: int, pid: int) -> list[Fact]:
    source = "netns:rtnetlink"
    try:
        links, routes = read_netns(proc_fd)
    except (OSError, ValueError) as exc:
        return _failed(["net_links", "net_routes"], source, exc)
    return _facts(
        {"net_links": sorted(links.values()), "net_routes": F.outside_routes(routes)}, source
    )


def read_netns(proc_fd: int) -> tuple[dict[int, str], list[F.Route]]:
    """(ifindex → link name, routes) of the network namespace of the process at `proc_fd`
    (an fd of its /proc/<pid> directory). Two rtnetlink dumps; no packet is sent.

    Raises OSError (no permission to enter the namespace, netlink errors, timeout).
    """
    ns_fd = os.open("ns/net", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
    try:
        sock = netlink_socket_in(ns_fd)
    finally:
        os.close(ns_fd)
    with sock:
        sock.settimeout(NETLINK_TIMEOUT_S)
        sock.bind((0, 0))
        link_req = ifinfmsg()
        link_req["family"] = socket.AF_UNSPEC
        links = {
            int(m["index"]): str(m.get_attr("IFLA_IFNAME"))
            for m in _dump(sock, link_req, RTM_GETLINK, 1)
        }
        route_req = rtmsg()
        route_req["family"] = socket.AF_UNSPEC
        routes = [_route(m, links) for m in _dump(sock, route_req, RTM_GETROUTE, 2)]
    return links, routes


def netlink_socket_in(ns_fd: int) -> socket.socket:
    """An rtnetlink socket inside the network namespace `ns_fd`, made on a throwaway thread.

    Raises OSError (EPERM without CAP_SYS_ADMIN, EINVAL if `ns_fd` is not a netns).
    """
    box: list[socket.socket] = []
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(ns_fd, CLONE_NEWNET)
                try:
                    box.append(
                        socket.socket(
                            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_ROUTE
                        )
                    )
                finally:
                    try:
                        _setns(home, CLONE_NEWNET)
                    except OSError:
                        # This thread is discarded next, so staying in the namespace is moot.
                        log.warning("could not leave a container's network namespace")
            finally:
                os.close(home)
        except BaseException as exc:  # handed to the caller's thread below
            errors.append(exc)

    thread = threading.Thread(target=enter, name="substrate-netns", daemon=True)
    thread.start()
    thread.join()
    if errors:
        for sock in box:
            sock.close()
        raise errors[0]
    return box[0]


def _setns(fd: int, nstype: int) -> None:
    setns = getattr(os, "setns", None)  # Python 3.12+
    if setns is not None:
        setns(fd, nstype)
        return
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _dump(sock: socket.socket, msg: Any, msg_type: int, seq: int) -> list[Any]:
    """Send one rtnetlink dump request and collect its replies until NLMSG_DONE."""
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_DUMP
    msg["header"]["sequence_number"] = seq
    msg["header"]["pid"] = 0
    msg.encode()
    sock.send(msg.data)
    marshal = MarshalRtnl()
    out: list[Any] = []
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise OSError(errno.EPIPE, "netlink socket closed during a dump")
        for part in marshal.parse(data):
            header = part["header"]
            if header.get("sequence_number") != seq:
                continue
            if header.get("error") is not None:
                err = header["error"]
                raise err if isinstance(err, OSError) else OSError(errno.EIO, str(err))
            if header["type"] == NLMSG_DONE:
                return out
            if header["type"] == NLMSG_ERROR:
                raise OSError(errno.EIO, "netlink error reply")
            out.append(part)


def _route(m: Any, links: Mapping[int, str]) -> F.Route:
    table = m.get_attr("RTA_TABLE")
    oif = m.get_attr("RTA_OIF")
    gateway = m.get_attr("RTA_GATEWAY")
    if gateway is None and m.get_attr("RTA_MULTIPATH") is not None:
        gateway = "multipath"
    return F.Route(
        family=int(m["family"]),
        table=int(table if table is not None else m["table"]),
        type=int(m["type"]),
        dst=m.get_attr("RTA_DST"),
        dst_len=int(m["dst_len"]),
        gateway=None if gateway is None else str(gateway),
        oif=None if oif is None else links.get(int(oif), f"if{oif}"),
    )


# -- engine (pure readers of the inspect dict) ----------------------------------------


def engine_kept_caps(host_config: Mapping[str, Any]) -> list[str]:
    """The capability set the engine was asked for: defaults - CapDrop + CapAdd, sorted."""
    if host_config.get("Privileged"):
        return list(F.CAP_NAMES)

    def norm(names: Any) -> set[str]:
        return {str(n).upper().removeprefix("CAP_") for n in names or ()}

    drop, add = norm(host_config.get("CapDrop")), norm(host_config.get("CapAdd"))
    base = set() if "ALL" in drop else set(ENGINE_DEFAULT_CAPS) - drop
    if "ALL" in add:
        return list(F.CAP_NAMES)
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
        out.append(f"{path}={F.tmpfs_pages(F.size_option_bytes(size)) if size else 'unlimited'}")
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


def runsc_flags(argv: Sequence[str]) -> dict[str, str]:
    """runsc's global flags from a sandbox's argv ("--network=none" → {"network": "none"}).

    Only `--name=value` and bare `--name` flags before the subcommand count (the form the
    engine passes); a bare flag maps to "". Empty when argv[0] is not runsc's. Pure.
    """
    if not argv or "runsc" not in argv[0].rsplit("/", 1)[-1]:
        return {}
    out: dict[str, str] = {}
    for arg in argv[1:]:
        if not arg.startswith("-"):
            break  # the subcommand ("boot"); what follows are its own flags
        name, _, value = arg.lstrip("-").partition("=")
        out[name] = value
    return out


def docker_socket_mounted(sources: Iterable[str]) -> bool:
    """Does any bind source expose the engine's socket (the socket, or a directory above)?"""
    for src in sources:
        path = "/" + "/".join(p for p in src.split("/") if p)
        if path.rsplit("/", 1)[-1] == "docker.sock":
            return True
        if any(sock == path or sock.startswith(path.rstrip("/") + "/") for sock in DOCKER_SOCKETS):
            return True
    return False
