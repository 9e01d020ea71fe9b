#!/usr/bin/env python3
"""Syscall probe: run INSIDE a sandbox container, print what each probed syscall returned.

Usage: ``python3 syscalls.py [NAME ...]`` (no names = every probe). Prints one JSON
object ``{"<probe>": errno, ...}`` on stdout: ``0`` means the call succeeded, a positive
number is the errno it failed with, a negative number ``-N`` means the probe's child was
killed by signal ``N`` (a seccomp KILL action, say). Exit status 0 unless the machine's
architecture is unsupported (2) or a name is unknown (2).

Each probe makes exactly one raw ``syscall(2)`` through ctypes, in a forked child so that
an unexpected success cannot change the probe itself. Arguments are chosen so that the
kernel, when it is allowed to look at the call, fails it with an errno *other than*
EPERM (EINVAL, EFAULT, EBADF, ESRCH, ...) before it would touch anything: so EPERM can
only come from the seccomp filter, and a probe run under ``seccomp=unconfined`` shows the
``UNFILTERED`` errno instead. ``socket_af_*`` are the exception: the address family is
the argument the filter inspects, so they pass the real one (unfiltered they succeed or
fail with EAFNOSUPPORT, never EPERM).

Stdlib only; supports x86_64 and aarch64. Nothing here is imported by substrate: the file
is copied or bind-mounted into a container by tests.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import sys

#: Syscall numbers, (x86_64, aarch64). aarch64 uses the asm-generic table.
NUMBERS: dict[str, tuple[int, int]] = {
    "getpid": (39, 172),
    "unshare": (272, 97),
    "mount": (165, 40),
    "umount2": (166, 39),
    "setns": (308, 268),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "socket": (41, 198),
    "clone3": (435, 435),
    "get_mempolicy": (239, 236),
}

CLONE_NEWUSER = 0x10000000
AF_UNIX, AF_INET, AF_ALG, AF_VSOCK = 1, 2, 38, 40
SOCK_STREAM, SOCK_SEQPACKET = 1, 5
PTRACE_ATTACH = 16
NO_SUCH_PID = 0x3FFFFFFF  # above pid_max's ceiling (4194304): always ESRCH
UFFD_USER_MODE_ONLY = 1
NO_SUCH_FD = (
    1_000_000  # above any RLIMIT_NOFILE a sandbox gets: always EBADF (fd -1 is special to io_uring)
)

#: probe name → (syscall name, raw arguments, errno the kernel gives when unfiltered).
#: ``None`` as the unfiltered errno: success or a kernel-dependent non-EPERM errno.
PROBES: dict[str, tuple[str, tuple[int, ...], int | None]] = {
    # Control: the filter must let ordinary calls through.
    "getpid": ("getpid", (), 0),
    # A bit of CSIGNAL is not a valid unshare flag: EINVAL before any namespace work.
    "unshare": ("unshare", (CLONE_NEWUSER | 0x1,), errno.EINVAL),
    # A NULL target path faults in the path lookup, before the capability check.
    "mount": ("mount", (0, 0, 0, 0, 0), errno.EFAULT),
    # Unknown umount flags are rejected first.
    "umount2": ("umount2", (0, 0x80000000), errno.EINVAL),
    "setns": ("setns", (NO_SUCH_FD, 0), errno.EBADF),
    # An unknown keyctl operation.
    "keyctl": ("keyctl", (0x7FFF, 0, 0, 0, 0), errno.EOPNOTSUPP),
    # NULL key type string.
    "add_key": ("add_key", (0, 0, 0, 0, 0), errno.EFAULT),
    "request_key": ("request_key", (0, 0, 0, 0), errno.EFAULT),
    # An unknown bpf command with an empty attr (kernels >= 5.8 check privilege per command).
    "bpf": ("bpf", (0x7FFF, 0, 0), errno.EINVAL),
    # NULL attr faults while being copied in, before perf_event_paranoid is consulted.
    "perf_event_open": ("perf_event_open", (0, 0, -1, -1, 0), errno.EFAULT),
    # USER_MODE_ONLY passes the privilege check, the unknown bit 0x2 is then EINVAL.
    "userfaultfd": ("userfaultfd", (UFFD_USER_MODE_ONLY | 0x2,), errno.EINVAL),
    # NULL params fault while being copied in.
    "io_uring_setup": ("io_uring_setup", (1, 0), errno.EFAULT),
    "io_uring_enter": ("io_uring_enter", (NO_SUCH_FD, 0, 0, 0, 0, 0), errno.EBADF),
    "io_uring_register": ("io_uring_register", (NO_SUCH_FD, 0, 0, 0), errno.EBADF),
    # Attach to a pid that cannot exist: ESRCH, distinct from the filter's EPERM.
    "ptrace": ("ptrace", (PTRACE_ATTACH, NO_SUCH_PID, 0, 0), errno.ESRCH),
    # A non-zero flags word is EINVAL before the target is looked up.
    "process_vm_readv": ("process_vm_readv", (NO_SUCH_PID, 0, 0, 0, 0, 1), errno.EINVAL),
    "process_vm_writev": ("process_vm_writev", (NO_SUCH_PID, 0, 0, 0, 0, 1), errno.EINVAL),
    # NULL args: EINVAL (size 0 is below CLONE_ARGS_SIZE_VER0). Docker-style policies
    # answer ENOSYS so that glibc falls back to clone(2).
    "clone3": ("clone3", (0, 0), errno.EINVAL),
    # Not in strict's allow list and not named by it: shows the default action's errno.
    # Unknown flags are EINVAL first.
    "get_mempolicy": ("get_mempolicy", (0, 0, 0, 0, 0xFFFF), errno.EINVAL),
    # Address-family probes: the family is what the filter looks at.
    "socket_af_alg": ("socket", (AF_ALG, SOCK_SEQPACKET, 0), None),
    "socket_af_vsock": ("socket", (AF_VSOCK, SOCK_STREAM, 0), None),
    "socket_af_unix": ("socket", (AF_UNIX, SOCK_STREAM, 0), 0),
    "socket_af_inet": ("socket", (AF_INET, SOCK_STREAM, 0), 0),
}


def _arch_index() -> int:
    machine = platform.machine()
    if machine in ("x86_64", "amd64"):
        return 0
    if machine in ("aarch64", "arm64"):
        return 1
    raise SystemExit(f"syscalls.py: unsupported architecture {machine!r}")


def probe(name: str, arch: int) -> int:
    """Run one probe in a forked child; return 0, its errno, or -signal if it was killed."""
    syscall_name, args, _ = PROBES[name]
    number = NUMBERS[syscall_name][arch]
    pid = os.fork()
    if pid == 0:  # child: one syscall, report through the exit status
        code = 0
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
            ret = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
            code = ctypes.get_errno() if ret == -1 else 0
        except BaseException:
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def main(argv: list[str]) -> int:
    arch = _arch_index()
    names = argv or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        print(f"syscalls.py: unknown probe(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    print(json.dumps({name: probe(name, arch) for name in names}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
