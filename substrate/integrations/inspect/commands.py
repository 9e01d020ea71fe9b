"""Inspect's exec and file calls as argv, and their outcomes as Inspect's exceptions (pure).

Theory of operation: substrate runs argv lists only, in the workspace (`/workspace`, the
sample's checkout), as the profile's user, with the profile's environment. What Inspect
asks beyond that is reached with fixed wrappers, launched by absolute path and fed the
caller's values as arguments, never as text of a script:

- `user`: on a profile that runs as root (`id -u` is 0), the sample's default user is
  the checkout's owner (`setpriv --reuid --regid --clear-groups`, as a container whose
  image names a non-root USER); `user="root"` runs as root and any other name through
  `runuser -u NAME`. On a profile that does not run as root only its own user can run:
  another is `SandboxUserUnsupportedError`.
- `env`: `/usr/bin/env NAME=VALUE... cmd`, over the profile's environment.
- `cwd`: a path in the workspace is the command's `cwd` (relative to the checkout); one
  elsewhere is entered by a constant `/bin/sh` script (`cd -- "$1"`, then `exec "$@"`).
- files outside the workspace are read and written by constant `/bin/sh` scripts whose
  exit codes name the failure (`READ_SCRIPT`, `WRITE_SCRIPT`).
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
from dataclasses import dataclass

from inspect_ai.util import SandboxUserUnsupportedError

#: Where the checkout is inside every sandbox (docs/protocol.md §5).
WORKSPACE = "/workspace"
SETPRIV = "/usr/bin/setpriv"
RUNUSER = "/usr/sbin/runuser"
ENV = "/usr/bin/env"
SH = "/bin/sh"
CD_SCRIPT = 'cd -- "$1" || exit 1; shift; exec "$@"'
#: `sh -c READ_SCRIPT sh PATH`: the file's bytes on stdout, or an exit code of `errno`'s.
READ_SCRIPT = (
    'if [ -d "$1" ]; then echo "$1: Is a directory" >&2; exit 21; fi; '
    'if [ ! -e "$1" ]; then echo "$1: No such file or directory" >&2; exit 2; fi; '
    'if [ ! -r "$1" ]; then echo "$1: Permission denied" >&2; exit 13; fi; '
    'exec cat -- "$1"'
)
#: `sh -c WRITE_SCRIPT sh PATH` with the bytes on stdin: parents made, the file replaced.
WRITE_SCRIPT = (
    'if [ -d "$1" ]; then echo "$1: Is a directory" >&2; exit 21; fi; '
    'mkdir -p -- "$(dirname -- "$1")" || exit 13; '
    'if [ -e "$1" ] && [ ! -w "$1" ]; then echo "$1: Permission denied" >&2; exit 13; fi; '
    'cat > "$1" || exit 13'
)
_ID = re.compile(r"uid=(\d+)(?:\(([^)]*)\))? gid=(\d+)")


@dataclass(frozen=True)
class Identity:
    """Who the profile runs commands as (`id` in the sandbox), and who owns the checkout."""

    uid: int
    gid: int
    name: str
    owner_uid: int
    owner_gid: int

    @property
    def root(self) -> bool:
        return self.uid == 0


def parse_id(output: str, owner: tuple[int, int]) -> Identity:
    """`Identity` from the output of `id`; ValueError when it is not `id`'s."""
    found = _ID.search(output)
    if found is None:
        raise ValueError(f"not the output of id: {output[:200]!r}")
    uid, name, gid = int(found[1]), found[2] or found[1], int(found[3])
    return Identity(uid=uid, gid=gid, name=name, owner_uid=owner[0], owner_gid=owner[1])


def workspace_path(file: str) -> str | None:
    """The checkout-relative path of an Inspect path (relative paths are the sample's
    working directory, the checkout), or None when it lies outside the workspace."""
    if not file.startswith("/"):
        return posixpath.normpath(file) if file else file
    normal = posixpath.normpath(file)
    if normal == WORKSPACE:
        return "."
    if normal.startswith(WORKSPACE + "/"):
        return normal[len(WORKSPACE) + 1 :]
    return None


def user_prefix(user: str | None, identity: Identity) -> list[str]:
    """The wrapper that makes a command run as `user` (see the module docstring)."""
    if identity.root:
        if user in ("root", "0"):
            return []
        if user is None or user == str(identity.owner_uid):
            return [
                SETPRIV,
                f"--reuid={identity.owner_uid}",
                f"--regid={identity.owner_gid}",
                "--clear-groups",
                "--",
            ]
        return [RUNUSER, "-u", user, "--"]
    if user is None or user in (identity.name, str(identity.uid)):
        return []
    raise SandboxUserUnsupportedError(
        f"the profile runs commands as {identity.name} (uid {identity.uid}) only; "
        f"running as {user} needs a profile that runs as root (docs/integrations.md)"
    )


def env_prefix(env: dict[str, str] | None) -> list[str]:
    """`/usr/bin/env NAME=VALUE...`; ValueError for a name env cannot set."""
    if not env:
        return []
    for name in env:
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"environment variable name {name!r} cannot be set")
    return [ENV, *(f"{name}={value}" for name, value in env.items())]


def exec_argv(
    cmd: list[str],
    *,
    cwd: str | None,
    env: dict[str, str] | None,
    user: str | None,
    identity: Identity,
) -> tuple[list[str], str]:
    """(argv, the command's checkout-relative cwd) for Inspect's `exec`."""
    if not cmd:
        raise ValueError("exec needs a command")
    inside = "." if cwd is None else workspace_path(cwd)
    outside = [] if inside is not None else [SH, "-c", CD_SCRIPT, "sh", str(cwd)]
    argv = [*user_prefix(user, identity), *env_prefix(env), *outside, *cmd]
    return argv, inside if inside is not None else "."


def file_error(code: int, file: str, stderr: str) -> OSError | None:
    """The exception of a failed file script (or None for exit 0)."""
    match code:
        case 0:
            return None
        case 21:
            return IsADirectoryError(errno.EISDIR, "Is a directory", file)
        case 2:
            return FileNotFoundError(errno.ENOENT, "No such file or directory", file)
        case 13:
            return PermissionError(errno.EACCES, "Permission denied", file)
    if "permission denied" in stderr.lower():
        return PermissionError(errno.EACCES, "Permission denied", file)
    return OSError(errno.EIO, f"exit {code}: {stderr.strip()[:500]}", file)


def exec_permission_error(returncode: int, stderr: str, cmd: list[str]) -> PermissionError | None:
    """Exit 126 with "permission denied": the command could not be executed."""
    if returncode == 126 and "permission denied" in stderr.lower():
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), cmd[0])
    return None
