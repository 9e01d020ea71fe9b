"""What a command request may ask for, and how its end reads (pure: no I/O, no clock).

The rules a `proc.run` request must pass before anything runs (`validate_argv`,
`effective_timeout`, `workdir_for`), the environment every exec gets (`exec_env`), and the
readings of how an exec ended (`start_failure` for a program the engine could not start,
`signal_of` for a `128 + n` exit code). Used by `substrate.process.processes` and by the
terminal backend (`substrate.pty.docker`), so a shell passes the same rules as a command.
Tested without Docker in tests/process/test_argv.py.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from substrate.errors import ArgvDenied, LimitExceeded, PathInvalid
from substrate.fs import paths
from substrate.sandbox import reaper
from substrate.sandbox.profiles import Profile, git_env
from substrate.sandbox.spec import WORKSPACE_TARGET

#: Largest argv (items) and total argv bytes accepted.
MAX_ARGV_ITEMS = 4096
MAX_ARGV_BYTES = 1 << 20
#: The exec's own code when the engine could not start the program at all.
ENGINE_START_FAILED = 126


def validate_argv(argv: Sequence[str], allow: Sequence[str]) -> None:
    """Refuse `argv_denied`: empty, a NUL anywhere, too large, argv[0] not in `allow`.

    Cost: one pass over the argv's bytes.
    """
    if not argv:
        raise ArgvDenied("argv is empty")
    if len(argv) > MAX_ARGV_ITEMS:
        raise ArgvDenied(f"argv has more than {MAX_ARGV_ITEMS} items")
    total = 0
    for i, arg in enumerate(argv):
        if "\x00" in arg:
            raise ArgvDenied(f"argv[{i}] contains NUL", index=i)
        total += len(arg.encode("utf-8", "surrogatepass")) + 1
    if total > MAX_ARGV_BYTES:
        raise ArgvDenied(f"argv is larger than {MAX_ARGV_BYTES} bytes")
    if allow and argv[0] not in allow:
        raise ArgvDenied(
            f"argv[0] {argv[0]!r} is not in the profile's argv_allow", allowed=list(allow)
        )


def effective_timeout(requested: float | None, profile: Profile) -> float:
    """The command's wall-clock limit: the profile's, or a lower requested one.

    Refuses `limit_exceeded` for a request above the profile's (a request never weakens
    a profile).
    """
    if requested is None:
        return profile.timeout_s
    if requested > profile.timeout_s:
        raise LimitExceeded(
            f"timeout_s {requested:g} is above profile {profile.name!r}'s {profile.timeout_s:g}",
            limit=profile.timeout_s,
        )
    return requested


def workdir_for(profile: Profile, cwd: str) -> str:
    """The exec's working directory for a workspace-relative `cwd`.

    Refuses `path_invalid` for a `cwd` that is not a valid relative path, or anything but
    "." under a profile that mounts no workspace. Validation only: whether the directory
    exists is the runner's check, through the held root fd.
    """
    parts = paths.split_relpath(cwd, allow_root=True)
    if profile.workspace == "none":
        if parts:
            raise PathInvalid(f"profile {profile.name!r} mounts no workspace: cwd must be '.'")
        return "/"
    return "/".join((WORKSPACE_TARGET, *parts))


def exec_env(profile: Profile, proc: str) -> dict[str, str]:
    """The command's whole environment: the profile's, its `git_identity` over it (the
    operator's identity wins: docs/working-layer.md, "The git layer"), and the reaper's
    marker.

    Given the sandbox's profile (`Sandbox.profile`), `env` already holds the values of its
    secrets (`profiles.with_secrets`): they reach each exec, never the container's
    configuration (docs/environments.md)."""
    return {**profile.env, **git_env(profile), reaper.MARKER: proc}


def start_failure(argv0: str, engine_text: bytes) -> tuple[int, str]:
    """(exit code, stderr text) for an exec the engine could not start.

    The engine reports such an exec as exit 126 with its own message ("OCI runtime exec
    failed: ... executable file not found in $PATH") on *stdout*. A shell says 127 for
    a program that is not there and 126 for one that cannot be executed, on stderr,
    naming it; so does substrate (docs/execution.md).
    """
    text = engine_text.decode("utf-8", "replace").lower()
    name = argv0[:256]
    if "permission denied" in text:
        return 126, f"substrate: {name}: permission denied\n"
    if "not found" in text or "no such file or directory" in text:
        why = "no such file or directory" if "/" in argv0 else "command not found"
        return 127, f"substrate: {name}: {why}\n"
    return ENGINE_START_FAILED, f"substrate: {name}: could not be started\n"


def signal_of(exit_code: int | None) -> str | None:
    """The signal name the engine's `128 + n` exit code stands for, if any.

    The engine reports a signal death as 128 + n, the way a shell does; a process that
    calls `exit(137)` looks the same (docs/execution.md).
    """
    if exit_code is None or not 128 < exit_code < 128 + 65:
        return None
    try:
        return signal.Signals(exit_code - 128).name.removeprefix("SIG")
    except ValueError:
        return None
