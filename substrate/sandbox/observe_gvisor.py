"""Observing a gVisor (runsc) sandbox from the host: the Sentry and its gofer.

Under runsc the container's init pid (inspect `State.Pid`) is gVisor's sandbox process,
the Sentry: its status shows the Sentry's own seccomp filter and credentials, not the
command's, so the command's credentials, capabilities and bind mounts come from the
engine (`substrate.sandbox.observe`), and the kernel view of the Sentry is reported here
as `sandbox_*` facts: its user namespace and the flags runsc was started with. The
container's files are opened on the host by the gofer (`gofer_pid`, the one lookup of
it): its mounts give the read-only root (`gofer_rootfs`), its root the identities of the
workspace mounts (`observe.identities`). docs/confinement.md lists what stays invisible.

Blocking procfs reads; a failed read becomes facts with value None (a mismatch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from substrate.layer.mounts import mountinfo
from substrate.sandbox import parsers as P
from substrate.sandbox.facts import Fact
from substrate.sandbox.readings import facts, failed, read_at, read_path


def sandbox_facts(proc_fd: int) -> list[Fact]:
    """The gVisor sandbox process: its user namespace and runsc's flags."""
    found: list[Fact] = []
    source = "kernel:proc-ns-user"
    try:
        theirs = os.stat("ns/user", dir_fd=proc_fd)
        ours = os.stat("/proc/self/ns/user")
        found += facts(
            {"sandbox_userns": (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino)},
            source,
        )
    except OSError as exc:
        found += failed(["sandbox_userns"], source, exc)
    source = "kernel:proc-cmdline"
    try:
        argv = read_at(proc_fd, "cmdline").split("\0")
    except OSError as exc:
        return found + failed(["sandbox_network", "sandbox_oci_seccomp"], source, exc)
    flags = runsc_flags(argv)
    if not flags or "boot" not in argv:
        return found + facts(dict.fromkeys(["sandbox_network", "sandbox_oci_seccomp"]), source)
    found += facts(
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
        status = P.parse_status_field(read_path(f"/proc/{sandbox_pid}/status"), "PPid")
        if status is None:
            return None
        parent = int(status)
        groups = read_path(f"/proc/{sandbox_pid}/cgroup")
        children: list[int] = []
        for task in os.listdir(f"/proc/{parent}/task"):
            children += [int(c) for c in read_path(f"/proc/{parent}/task/{task}/children").split()]
    except (OSError, ValueError):
        return None
    for child in children:
        if child == sandbox_pid:
            continue
        try:
            argv0 = read_path(f"/proc/{child}/cmdline").split("\0", 1)[0]
            same = read_path(f"/proc/{child}/cgroup") == groups
        except OSError:
            continue
        if argv0.rsplit("/", 1)[-1] == "runsc-gofer" and same:
            return child
    return None


def gofer_rootfs(found: list[Fact], sandbox_pid: int) -> list[Fact]:
    """Replace the engine's `rootfs_readonly` with the gofer's mount when it can be seen.

    Only the root filesystem: runsc (20221219) mounts binds read-write in the gofer and
    enforces read-only binds in the Sentry, so the gofer's view of them proves nothing.
    """
    gofer = gofer_pid(sandbox_pid)
    if gofer is None:
        return found
    source = "kernel:gofer-mountinfo"
    try:
        readonly = P.rootfs_readonly(
            mountinfo.parse_mountinfo(read_path(f"/proc/{gofer}/mountinfo"))
        )
    except (OSError, ValueError) as exc:
        return [f for f in found if f.name != "rootfs_readonly"] + failed(
            ["rootfs_readonly"], source, exc
        )
    return [f for f in found if f.name != "rootfs_readonly"] + facts(
        {"rootfs_readonly": readonly}, source
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
