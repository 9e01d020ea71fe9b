"""Pure parts of `substrate.process.runner`: argv rules, timeouts, workdirs, signals, the demuxer."""

from __future__ import annotations

import struct

import pytest

from substrate.errors import ArgvDenied, LimitExceeded, PathInvalid
from substrate.process.runner import (
    MAX_ARGV_ITEMS,
    effective_timeout,
    exec_env,
    signal_of,
    start_failure,
    validate_argv,
    workdir_for,
)
from substrate.process.stream import Demuxer
from substrate.sandbox.profiles import Profile
from substrate.sandbox.reaper import MARKER


def frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxI", stream, len(payload)) + payload


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


def test_demuxer_splits_frames_across_any_chunking() -> None:
    stream = frame(1, b"hello ") + frame(2, b"oops") + frame(1, b"world") + frame(1, b"")
    expected = [(1, b"hello "), (2, b"oops"), (1, b"world")]
    for size in (1, 2, 3, 7, 8, 9, len(stream)):
        demux = Demuxer()
        got: list[tuple[int, bytes]] = []
        for i in range(0, len(stream), size):
            got.extend(demux.feed(stream[i : i + size]))
        merged: dict[int, bytes] = {}
        for sid, piece in got:
            merged[sid] = merged.get(sid, b"") + piece
        assert merged == {1: b"hello world", 2: b"oops"}, size
        assert not demux.mid_frame
    whole = Demuxer().feed(stream)
    assert [(s, p) for s, p in whole if p] == expected


def test_demuxer_notices_a_cut_frame() -> None:
    demux = Demuxer()
    demux.feed(frame(1, b"abcdef")[:-2])
    assert demux.mid_frame


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
