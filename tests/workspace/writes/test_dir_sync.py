"""substrate.workspace.writes.dir_sync: concurrent callers share directory fsyncs, each
returns only after one that began after its call, and each is woken alone."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from substrate.workspace.writes import dir_sync
from substrate.workspace.writes.dir_sync import DirSyncs

CALLERS = 12
ROUNDS = 15


def test_every_caller_returns_after_a_flush_begun_after_its_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = 0
    ended: list[int] = []  # the number of each flush, as it ends
    lock = threading.Lock()
    real_fsync = dir_sync.os.fsync

    def counted(fd: int) -> None:
        nonlocal started
        with lock:
            started += 1
            mine = started
        time.sleep(0.002)  # long enough for callers to pile up behind it
        real_fsync(fd)
        with lock:
            ended.append(mine)

    monkeypatch.setattr(dir_sync.os, "fsync", counted)
    syncs = DirSyncs()
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    late: list[tuple[int, int]] = []  # (flushes begun at the call, flushes ended at return)

    def caller() -> None:
        for _ in range(ROUNDS):
            with lock:
                at_call = started
            syncs.sync(dir_fd)
            with lock:
                # A flush numbered above `at_call` has ended.
                if not any(n > at_call for n in ended):
                    late.append((at_call, len(ended)))

    try:
        threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        os.close(dir_fd)
    assert late == []
    assert started < CALLERS * ROUNDS  # shared
    assert syncs._dirs == {}  # the directory's record goes with its last user


def test_a_failed_flush_fails_the_callers_it_covered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    calls = 0

    def failing(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            assert gate.wait(10)
            return
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(dir_sync.os, "fsync", failing)
    syncs = DirSyncs()
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    outcomes: list[str] = []

    def caller() -> None:
        try:
            syncs.sync(dir_fd)
            outcomes.append("ok")
        except OSError:
            outcomes.append("failed")

    try:
        first = threading.Thread(target=caller)
        first.start()
        while calls == 0:
            time.sleep(0.001)
        behind = [threading.Thread(target=caller) for _ in range(4)]
        for t in behind:
            t.start()
        st = os.fstat(dir_fd)
        record = syncs._dirs[(st.st_dev, st.st_ino)]
        while len(record.sleepers) < 4:  # they wait behind the first flush
            time.sleep(0.001)
        gate.set()
        for t in [first, *behind]:
            t.join(10)
    finally:
        os.close(dir_fd)
    # The first flush covered the first caller; the second (failed) the four behind it.
    assert sorted(outcomes) == ["failed"] * 4 + ["ok"] and calls == 2
