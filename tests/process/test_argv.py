"""`substrate.process.argv` (pure): argv rules, timeouts, workdirs, environment, exit readings."""

from __future__ import annotations

import pytest

from substrate.errors import ArgvDenied, LimitExceeded, PathInvalid
from substrate.process.argv import (
    MAX_ARGV_ITEMS,
    effective_timeout,
    exec_env,
    signal_of,
    start_failure,
    validate_argv,
    workdir_for,
)
from substrate.sandbox.profiles import Profile
from substrate.sandbox.reaper import MARKER


def test_argv_rules() -> None:
    validate_argv(["echo", "$(id)", ";", "rm", "-rf", "/"], [])
    validate_argv(["echo"], ["echo", "ls"])
    for bad, allow in (([], []), (["a\x00b"], []), (["ls", "x\x00"], []), (["cat"], ["echo"])):
        with pytest.raises(ArgvDenied):
            validate_argv(bad, allow)
    with pytest.raises(ArgvDenied):
        validate_argv(["x"] * (MAX_ARGV_ITEMS + 1), [])


def test_timeout_may_only_lower_the_profile() -> None:
    profile = Profile(name="p", timeout_s=60)
    assert effective_timeout(None, profile) == 60
    assert effective_timeout(5, profile) == 5
    assert effective_timeout(60, profile) == 60
    with pytest.raises(LimitExceeded) as caught:
        effective_timeout(61, profile)
    assert caught.value.data["limit"] == 60


def test_workdir() -> None:
    rw = Profile(name="p")
    assert workdir_for(rw, ".") == "/workspace"
    assert workdir_for(rw, "a/b") == "/workspace/a/b"
    for bad in ("..", "/etc", "a/../b", "", "a\\b"):
        with pytest.raises(PathInvalid):
            workdir_for(rw, bad)
    none = Profile(name="p", workspace="none")
    assert workdir_for(none, ".") == "/"
    with pytest.raises(PathInvalid):
        workdir_for(none, "a")


def test_environment_is_the_profile_plus_the_marker() -> None:
    profile = Profile(name="p", env={"A": "1"})
    assert exec_env(profile, "p_1") == {"A": "1", MARKER: "p_1"}


def test_signal_names_from_exit_codes() -> None:
    assert signal_of(137) == "KILL"
    assert signal_of(143) == "TERM"
    assert signal_of(130) == "INT"
    assert [signal_of(c) for c in (None, 0, 1, 128, 255)] == [None] * 5


ENGINE = b"OCI runtime exec failed: exec failed: unable to start container process: exec: "


def test_an_exec_the_engine_could_not_start_reads_like_a_shell() -> None:
    assert start_failure(
        "nope", ENGINE + b'"nope": executable file not found in $PATH: unknown\r\n'
    ) == (127, "substrate: nope: command not found\n")
    assert start_failure(
        "/no/x", ENGINE + b'"/no/x": stat /no/x: no such file or directory: unknown\r\n'
    ) == (127, "substrate: /no/x: no such file or directory\n")
    assert start_failure(
        "/etc/passwd", ENGINE + b'"/etc/passwd": permission denied: unknown\r\n'
    ) == (126, "substrate: /etc/passwd: permission denied\n")
    assert start_failure("x", b"something else") == (126, "substrate: x: could not be started\n")
