"""substrate.workspace.uploads: the spool of uploads in progress, its order and its caps.

In-process, on a temp state dir, with a fake clock: no daemon, no workspace.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import (
    LimitExceeded,
    TooLarge,
    UploadConflict,
    UploadIncomplete,
    UploadMismatch,
    UploadUnknown,
)
from substrate.workspace.uploads import SPOOL_DIR, Upload, Uploads
from tests.harness.waiting import wait_until

ME, OTHER = "agent:1000", "agent:1001"
DATA = bytes(range(256)) * 40  # 10240 bytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def uploads(tmp_path: Path, clock: Clock) -> Iterator[Uploads]:
    u = Uploads(tmp_path, max_bytes=1 << 20, max_open=3, idle_s=60.0, clock=clock)
    try:
        yield u
    finally:
        u.close()


def begin(u: Uploads, data: bytes = DATA, owner: str = ME, sha: str | None = None) -> Upload:
    return u.begin(
        owner,
        workspace="ws_x",
        path="big.bin",
        base_sha256=None,
        size=len(data),
        sha256=sha or hashlib.sha256(data).hexdigest(),
        mode=None,
        create_parents=False,
    )


def spool(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / SPOOL_DIR))


def send_all(u: Uploads, up: Upload, data: bytes = DATA, step: int = 4096) -> None:
    for offset in range(0, len(data), step):
        u.chunk(ME, up.id, offset, data[offset : offset + step])


def test_chunks_in_order_make_the_file_and_its_digest(uploads: Uploads, tmp_path: Path) -> None:
    up = begin(uploads)
    path = tmp_path / SPOOL_DIR / up.id
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / SPOOL_DIR).stat().st_mode) == 0o700
    with pytest.raises(UploadIncomplete) as info:
        Uploads.check_complete(up)
    assert info.value.data == {"received": 0, "size": len(DATA)}
    send_all(uploads, up)
    assert up.received == len(DATA)
    Uploads.check_complete(up)
    assert path.read_bytes() == DATA
    fd = uploads.open_spool(up)
    try:
        assert os.pread(fd, 10, 0) == DATA[:10]
    finally:
        os.close(fd)


def test_a_resent_range_with_the_same_bytes_is_accepted(uploads: Uploads) -> None:
    up = begin(uploads)
    uploads.chunk(ME, up.id, 0, DATA[:4096])
    uploads.chunk(ME, up.id, 0, DATA[:4096])  # a retry of the whole chunk
    assert up.received == 4096
    uploads.chunk(ME, up.id, 1000, DATA[1000:6000])  # overlapping the end: the rest lands
    assert up.received == 6000
    uploads.chunk(ME, up.id, 6000, DATA[6000:])
    Uploads.check_complete(up)


def test_a_resent_range_with_other_bytes_is_a_conflict(uploads: Uploads, tmp_path: Path) -> None:
    up = begin(uploads)
    uploads.chunk(ME, up.id, 0, DATA[:4096])
    with pytest.raises(UploadConflict) as info:
        uploads.chunk(ME, up.id, 100, b"\xff" * 100)
    assert info.value.data["received"] == 4096
    assert up.received == 4096
    assert (tmp_path / SPOOL_DIR / up.id).read_bytes() == DATA[:4096]


def test_a_gap_or_bytes_past_the_size_are_conflicts(uploads: Uploads) -> None:
    up = begin(uploads)
    with pytest.raises(UploadConflict, match="gap") as gap:
        uploads.chunk(ME, up.id, 1, DATA[1:10])
    assert gap.value.data == {"received": 0}
    with pytest.raises(UploadConflict, match="past the declared size") as past:
        uploads.chunk(ME, up.id, 0, DATA + b"x")
    assert past.value.data == {"size": len(DATA), "received": 0}
    assert up.received == 0


def test_wrong_bytes_are_a_mismatch_at_the_end(uploads: Uploads) -> None:
    up = begin(uploads, sha="0" * 64)
    send_all(uploads, up)
    with pytest.raises(UploadMismatch) as info:
        Uploads.check_complete(up)
    assert info.value.data == {
        "sha256": "0" * 64,
        "received_sha256": hashlib.sha256(DATA).hexdigest(),
    }


def test_an_upload_is_its_callers_only(uploads: Uploads) -> None:
    up = begin(uploads)
    with pytest.raises(UploadUnknown):
        uploads.chunk(OTHER, up.id, 0, DATA[:10])
    with pytest.raises(UploadUnknown):
        uploads.abort(OTHER, up.id)
    with pytest.raises(UploadUnknown):
        uploads.chunk(ME, "upl_" + "0" * 32, 0, b"")
    assert up.received == 0


def test_abort_removes_the_spool(uploads: Uploads, tmp_path: Path) -> None:
    up = begin(uploads)
    uploads.chunk(ME, up.id, 0, DATA[:100])
    assert uploads.abort(ME, up.id) == 100
    assert spool(tmp_path) == []
    with pytest.raises(UploadUnknown):
        uploads.chunk(ME, up.id, 100, DATA[100:200])


def test_size_over_the_cap_is_too_large(uploads: Uploads, tmp_path: Path) -> None:
    with pytest.raises(TooLarge) as info:
        begin(uploads, data=b"x" * ((1 << 20) + 1))
    assert info.value.data == {"limit": 1 << 20}
    assert spool(tmp_path) == []


def test_open_uploads_are_capped_per_caller(uploads: Uploads) -> None:
    mine = [begin(uploads) for _ in range(3)]
    with pytest.raises(LimitExceeded) as info:
        begin(uploads)
    assert info.value.data == {"limit": 3, "scope": "uploads"}
    begin(uploads, owner=OTHER)  # another caller has its own
    uploads.abort(ME, mine[0].id)
    begin(uploads)


def test_idle_uploads_expire_with_their_spool(
    uploads: Uploads, clock: Clock, tmp_path: Path
) -> None:
    old = begin(uploads)
    clock.now += 30
    fresh = begin(uploads)
    uploads.chunk(ME, old.id, 0, DATA[:10])  # a call restarts the idle time
    clock.now += 59
    assert uploads.expire() == []
    clock.now += 1
    assert sorted(uploads.expire()) == sorted([old.id, fresh.id])
    assert spool(tmp_path) == []
    with pytest.raises(UploadUnknown):
        uploads.chunk(ME, old.id, 10, DATA[10:20])


def test_an_upload_in_use_never_expires(uploads: Uploads, clock: Clock) -> None:
    up = begin(uploads)
    with uploads.using(ME, up.id):
        clock.now += 3600
        assert uploads.expire() == []
    clock.now += 60
    assert uploads.expire() == [up.id]


def test_begin_expires_idle_uploads_to_make_room(uploads: Uploads, clock: Clock) -> None:
    for _ in range(3):
        begin(uploads)
    clock.now += 60
    begin(uploads)
    assert uploads.count() == 1


def test_calls_on_one_upload_wait_for_each_other(uploads: Uploads) -> None:
    up = begin(uploads)
    entered = threading.Event()
    release = threading.Event()
    done: list[int] = []

    def commit_like() -> None:
        with uploads.using(ME, up.id):
            entered.set()
            release.wait(30)
            uploads.finish(up)

    t = threading.Thread(target=commit_like)
    t.start()
    assert entered.wait(30)

    def chunk() -> None:
        try:
            uploads.chunk(ME, up.id, 0, DATA[:10])
        except UploadUnknown:
            done.append(1)

    c = threading.Thread(target=chunk)
    c.start()
    wait_until(lambda: up.busy == 2, 30)  # the chunk is in, waiting for the lock
    release.set()
    t.join(30)
    c.join(30)
    # The chunk waited for the commit, then found the upload finished.
    assert done == [1]
    assert up.received == 0


def test_close_removes_every_spool(tmp_path: Path, clock: Clock) -> None:
    u = Uploads(tmp_path, max_bytes=1 << 20, max_open=3, idle_s=60.0, clock=clock)
    up = begin(u)
    u.chunk(ME, up.id, 0, DATA[:100])
    u.close()
    assert spool(tmp_path) == []


def test_a_start_removes_what_a_crashed_run_left_and_only_that(
    tmp_path: Path, clock: Clock
) -> None:
    (tmp_path / SPOOL_DIR).mkdir(mode=0o700)
    left = "upl_" + "ab" * 16  # a spool file of a run that crashed
    (tmp_path / SPOOL_DIR / left).write_bytes(DATA[:100])
    (tmp_path / SPOOL_DIR / "keep-me").write_text("not a spool file")
    u = Uploads(tmp_path, max_bytes=1 << 20, max_open=3, idle_s=60.0, clock=clock)
    try:
        assert u.removed_at_start == 1
        assert spool(tmp_path) == ["keep-me"]
        with pytest.raises(UploadUnknown):
            u.chunk(ME, left, 0, DATA[:100])
    finally:
        u.close()
    assert spool(tmp_path) == ["keep-me"]
