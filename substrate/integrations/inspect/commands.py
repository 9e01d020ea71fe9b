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
- an argv bigger than one request carries (the daemon's argv caps, or its request line
  limit) is staged: `STAGE_SCRIPT`, as the command's user, writes the argv after the user
  wrapper (the env and cwd wrappers and the command), NUL-terminated, from its stdin to
  a private file in the sandbox's `/tmp`; then the user wrapper runs `EXEC_STAGED_SCRIPT`,
  which reads that file, deletes it and execs the argv with the environment it was given.
  Over `MAX_STAGED_ARGV_BYTES` (Linux's usual `ARG_MAX`) is `OSError(E2BIG)`, as the
  kernel's own "argument list too long".
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
BASH = "/bin/bash"
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
#: The most argv a staged command carries, bytes (each argument's UTF-8 and its NUL, the
#: env and cwd wrappers included): Linux's usual `ARG_MAX` (a quarter of an 8 MiB stack).
MAX_STAGED_ARGV_BYTES = 2 << 20
#: Where a staged argv waits for its command: private (mode 0600) files in the sandbox's /tmp.
STAGED_PREFIX = "/tmp/substrate-argv."
#: `sh -c STAGE_SCRIPT sh` with the NUL-terminated argv on stdin: the file's path on stdout.
STAGE_SCRIPT = (
    f"umask 077 && f=$(mktemp {STAGED_PREFIX}XXXXXXXXXX) || exit 1; "
    'cat > "$f" || { rm -f -- "$f"; exit 1; }; '
    'printf %s "$f"'
)
#: `bash -c EXEC_STAGED_SCRIPT bash FILE`: FILE's argv read and FILE deleted, then that
#: argv exec'd by `env -i` with this process's environment as it was given (bash's own
#: additions, `PWD` and `SHLVL`, dropped). The command's stdin is untouched.
EXEC_STAGED_SCRIPT = (
    'mapfile -d "" -t argv < "$1"; status=$?; /bin/rm -f -- "$1"; '
    'if [ "$status" != 0 ] || [ "${#argv[@]}" = 0 ]; then '
    'echo "substrate: the staged argv could not be read" >&2; exit 126; fi; '
    'mapfile -d "" -t environ < /proc/$$/environ; '
    f'exec {ENV} -i -- "${{environ[@]}}" "${{argv[@]}}"'
)
#: Runs its arguments as they are: in front of a staged argv whose first word `env` would
#: take for an assignment (it holds `=`).
EXEC_SCRIPT = 'exec "$@"'
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


@dataclass(frozen=True)
class ExecArgv:
    """Inspect's `exec` as argv: the user wrapper, then the rest (the env and cwd wrappers
    and the command), and the command's checkout-relative cwd."""

    user: list[str]
    rest: list[str]
    cwd: str

    @property
    def argv(self) -> list[str]:
        return [*self.user, *self.rest]


def exec_parts(
    cmd: list[str],
    *,
    cwd: str | None,
    env: dict[str, str] | None,
    user: str | None,
    identity: Identity,
) -> ExecArgv:
    """`ExecArgv` for Inspect's `exec` (see the module docstring)."""
    if not cmd:
        raise ValueError("exec needs a command")
    inside = "." if cwd is None else workspace_path(cwd)
    outside = [] if inside is not None else [SH, "-c", CD_SCRIPT, "sh", str(cwd)]
    rest = [*env_prefix(env), *outside, *cmd]
    return ExecArgv(user_prefix(user, identity), rest, inside if inside is not None else ".")


def exec_argv(
    cmd: list[str],
    *,
    cwd: str | None,
    env: dict[str, str] | None,
    user: str | None,
    identity: Identity,
) -> tuple[list[str], str]:
    """(argv, the command's checkout-relative cwd) for Inspect's `exec`."""
    parts = exec_parts(cmd, cwd=cwd, env=env, user=user, identity=identity)
    return parts.argv, parts.cwd


def staged_argv(rest: list[str]) -> bytes:
    """The bytes `STAGE_SCRIPT` writes for `rest`: each argument NUL-terminated.

    ValueError for a NUL in an argument (no argv can hold one); `OSError(E2BIG)` past
    `MAX_STAGED_ARGV_BYTES`, before a byte is sent. Cost: one pass over the argv."""
    if not rest:
        raise ValueError("exec needs a command")
    # `env` would take a first word holding "=" for an assignment: `sh` runs it instead.
    words = [SH, "-c", EXEC_SCRIPT, "sh", *rest] if "=" in rest[0] else rest
    out = bytearray()
    for i, arg in enumerate(words):
        if "\0" in arg:
            raise ValueError(f"argv[{i}] contains a NUL byte")
        out += arg.encode("utf-8")
        out += b"\0"
        if len(out) > MAX_STAGED_ARGV_BYTES:
            raise OSError(
                errno.E2BIG,
                f"Argument list too long (over {MAX_STAGED_ARGV_BYTES} bytes of argv)",
                rest[0],
            )
    return bytes(out)


def stage_argv(user: list[str]) -> list[str]:
    """The command that stages an argv (given on its stdin) as the command's user."""
    return [*user, SH, "-c", STAGE_SCRIPT, "sh"]


def run_staged_argv(user: list[str], path: str) -> list[str]:
    """The command that runs the argv staged at `path` as the command's user."""
    return [*user, BASH, "-c", EXEC_STAGED_SCRIPT, "bash", path]


def staged_path(stdout: str) -> str:
    """The staged file's path from `STAGE_SCRIPT`'s stdout; ValueError for anything else."""
    name = stdout.removeprefix(STAGED_PREFIX)
    if name == stdout or not name.isalnum():
        raise ValueError(f"not a staged argv's path: {stdout[:200]!r}")
    return stdout


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
