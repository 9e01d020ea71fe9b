"""substrate.layer.changes.apply of big files: streamed from the upper layer into the
temp file, hashed on the way, in memory that does not grow with the file; a file that
changes while it is applied is `layer_changed`, never a torn file in the checkout."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.layer.changes import ApplyResult, ChangeSet, apply, scan
from substrate.workspace.checkpoints import Checkpoints
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import TEMP_PREFIX, Writer, streamed
from tests.harness.state import DaemonState

ACTOR = "agent:0"
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
MIB = 1 << 20


@dataclass
class Env:
    root: Path
    upper: Path
    ws: Workspace
    writer: Writer

    def scan(self, **bounds: int) -> ChangeSet:
        ufd = os.open(self.upper, DIR)
        try:
            return scan(ufd, self.ws.root_fd, **bounds)
        finally:
            os.close(ufd)

    def apply(self, cs: ChangeSet) -> ApplyResult:
        ufd = os.open(self.upper, DIR)
        try:
            return apply(self.writer, self.ws, ufd, cs, ACTOR)
        finally:
            os.close(ufd)

    def temps(self) -> list[str]:
        return [p.name for p in self.root.rglob(f"{TEMP_PREFIX}*")]


@pytest.fixture
def env(daemon_state: DaemonState, tmp_path: Path, make_workspace: Callable[..., Path]) -> Env:
    root = make_workspace("demo", {"old.bin": b"old\n"})
    ws = daemon_state.registry.adopt(str(root), None, None, ACTOR)
    upper = tmp_path / "upper"
    upper.mkdir()
    return Env(root, upper, ws, Writer(daemon_state.store, daemon_state.journal))


def write_pattern(path: Path, mib: int, seed: int = 0) -> str:
    """`mib` MiB of a pattern at `path`, a MiB at a time; its digest."""
    digest = hashlib.sha256()
    with path.open("wb") as f:
        for i in range(mib):
            block = bytes([(i + seed) % 251]) * MIB
            f.write(block)
            digest.update(block)
    return digest.hexdigest()


def digest_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_a_256_mib_file_is_scanned_and_applied_in_bounded_memory(env: Env) -> None:
    want = write_pattern(env.upper / "big.bin", 256)
    tracemalloc.start()
    try:
        cs = env.scan()
        result = env.apply(cs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cs.blocked == ()
    assert [(o.path, o.op) for o in result.applied] == [("big.bin", "create")]
    assert digest_of(env.root / "big.bin") == want
    # A copy buffer and a hash buffer, not the file: far under its 256 MiB.
    assert peak < 8 * MIB, peak
    assert env.temps() == []


def test_replacing_a_big_file_binds_to_its_streamed_digest(env: Env) -> None:
    write_pattern(env.root / "old.bin", 80, seed=7)  # the checkout's, over 64 MiB
    want = write_pattern(env.upper / "old.bin", 70)
    result = env.apply(env.scan())
    assert [(o.path, o.op) for o in result.applied] == [("old.bin", "replace")]
    assert digest_of(env.root / "old.bin") == want


def test_a_big_file_grown_since_the_scan_is_layer_changed(env: Env) -> None:
    write_pattern(env.upper / "big.bin", 20)
    cs = env.scan()
    with (env.upper / "big.bin").open("ab") as f:
        f.write(b"more")
    result = env.apply(cs)
    [conflict] = result.conflicts
    assert (conflict.path, conflict.reason) == ("big.bin", "layer_changed")
    assert not (env.root / "big.bin").exists()
    assert env.temps() == []


def test_a_big_file_changed_while_it_is_copied_is_never_torn(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = write_pattern(env.root / "old.bin", 12, seed=3)
    write_pattern(env.upper / "old.bin", 12)
    cs = env.scan()
    real = streamed._kernel_copy
    calls = []

    def then_the_command_writes(src: int, dst: int, offset: int, count: int, how: list[str]) -> int:
        done = real(src, dst, offset, count, how)
        if not calls:  # after the first chunk: the last one changes under the copy
            with (env.upper / "old.bin").open("r+b") as f:
                f.seek(11 * MIB)
                f.write(b"\xff" * MIB)
        calls.append(offset)
        return done

    monkeypatch.setattr(streamed, "_kernel_copy", then_the_command_writes)
    result = env.apply(cs)
    assert len(calls) > 1
    [conflict] = result.conflicts
    assert (conflict.path, conflict.reason) == ("old.bin", "layer_changed")
    assert digest_of(env.root / "old.bin") == old  # the old bytes, whole
    assert env.temps() == []


def test_past_the_file_bound_a_file_is_too_large(env: Env) -> None:
    write_pattern(env.upper / "big.bin", 3)
    write_pattern(env.upper / "small.bin", 1)
    cs = env.scan(max_file_bytes=2 * MIB)
    assert [(b.path, b.reason) for b in cs.blocked] == [("big.bin", "too_large")]
    assert [c.path for c in cs.changes] == ["small.bin"]


def test_copy_hashed_refuses_a_source_of_another_size(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_pattern(src, 3)
    for size in (2 * MIB, 4 * MIB, 3 * MIB):
        dst = tmp_path / f"dst{size}"
        with src.open("rb") as s, dst.open("w+b") as d:
            got = streamed.copy_hashed(s.fileno(), d.fileno(), size)
        assert got == (digest_of(src) if size == 3 * MIB else None)
    assert digest_of(tmp_path / f"dst{3 * MIB}") == digest_of(src)


def test_under_a_live_checkpoint_a_file_over_64_mib_is_not_replaced(
    env: Env, daemon_state: DaemonState
) -> None:
    checkpoints = Checkpoints(daemon_state.store, daemon_state.journal, daemon_state.path, 1 << 30)
    try:
        writer = Writer(daemon_state.store, daemon_state.journal, checkpoints)
        old = write_pattern(env.root / "old.bin", 65, seed=5)
        checkpoints.create(env.ws, ACTOR)
        write_pattern(env.upper / "old.bin", 2)
        ufd = os.open(env.upper, DIR)
        try:
            result = apply(writer, env.ws, ufd, env.scan(), ACTOR)
        finally:
            os.close(ufd)
        # A restore could not put it back: a conflict by name, the file whole.
        [conflict] = result.conflicts
        assert (conflict.path, conflict.reason) == ("old.bin", "too_large")
        assert digest_of(env.root / "old.bin") == old
        assert env.temps() == []
    finally:
        checkpoints.close()
