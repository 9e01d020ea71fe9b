"""Output spooling and previews (substrate.artifacts.sink): pure, on a temp dir, no Docker."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import resource
import signal
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.artifacts.sink import (
    HASH_THREAD_AFTER,
    PREVIEW_BYTES,
    OutputSink,
    SinkClosed,
    boundary_after,
    boundary_before,
    head_preview,
    tail_preview,
)
from substrate.errors import ArtifactUnknown

MiB = 1 << 20


class FakeOwner:
    """Stands in for `ArtifactStore`: remembers what the sinks hand over."""

    def __init__(self, spool_dir: Path) -> None:
        self.spool_dir = spool_dir
        self.finished: dict[str, str | None] = {}
        self.stored: dict[str, bytes] = {}
        self.keep_bytes = True  # False: drop stored artifacts instead of reading them in

    def open(self, *, inline_limit: int = 64 << 10, max_bytes: int = 1 << 40) -> OutputSink:
        name = f"art_{len(self.finished) + len(self.stored)}_{random.getrandbits(32):x}"
        fd = os.open(self.spool_dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return OutputSink(
            self,
            name,
            "proc_1",
            "stdout",
            fd,
            inline_limit=inline_limit,
            max_bytes=max_bytes,
            created=0.0,
        )

    def finish_sink(self, sink: OutputSink, sha256: str | None) -> str | None:
        path = self.spool_dir / sink.id
        self.finished[sink.id] = sha256
        if sha256 is None:
            path.unlink()
            return None
        if self.keep_bytes:
            self.stored[sink.id] = path.read_bytes()
        path.unlink()
        return sink.id

    def read_artifact(self, artifact: str, offset: int, length: int) -> bytes:
        if artifact not in self.stored:
            raise ArtifactUnknown(artifact)
        return self.stored[artifact][offset : offset + length]


@pytest.fixture
def owner(tmp_path: Path) -> FakeOwner:
    return FakeOwner(tmp_path)


def chunks(data: bytes, rng: random.Random) -> Iterator[bytes]:
    """`data` in pieces of very different sizes: tiny, buffered, direct, huge."""
    pos = 0
    while pos < len(data):
        size = rng.choice([1, 7, 4096, 65535, 65536, 300_000, 2 * MiB])
        yield data[pos : pos + size]
        pos += size


# --- UTF-8 boundaries and previews --------------------------------------------------------


MIXED = "aé€😀"  # 1, 2, 3 and 4 bytes in UTF-8


def test_boundary_before_never_splits_a_character() -> None:
    data = (MIXED * 50).encode()
    for cut in range(len(data) + 2):
        b = boundary_before(data, cut)
        assert cut - 3 <= b <= min(cut, len(data))
        data[:b].decode("utf-8")  # a whole number of characters


def test_boundary_after_never_starts_inside_a_character() -> None:
    data = (MIXED * 50).encode()
    for start in range(len(data)):
        b = boundary_after(data, start)
        assert start <= b <= start + 3
        data[b:].decode("utf-8")


def test_boundaries_on_invalid_bytes_move_at_most_three() -> None:
    junk = b"\x80" * 10 + b"\xff\xfe" + b"\xe2\x82"  # stray continuations, bad leads
    for cut in range(len(junk) + 1):
        assert cut - 3 <= boundary_before(junk, cut) <= cut
        assert cut <= boundary_after(junk, cut) <= cut + 3


@pytest.mark.parametrize("shift", range(4))
def test_head_preview_at_a_multibyte_cut(shift: int) -> None:
    # Put 4-byte characters across byte 4096 at every alignment.
    data = b"x" * shift + "😀".encode() * 2000
    head = head_preview(data)
    assert len(head.encode()) <= PREVIEW_BYTES
    assert "\ufffd" not in head
    assert data.startswith(head.encode())
    assert len(head.encode()) > PREVIEW_BYTES - 4


@pytest.mark.parametrize("shift", range(4))
def test_tail_preview_at_a_multibyte_cut(shift: int) -> None:
    data = "€".encode() * 3000 + b"y" * shift
    tail = tail_preview(data[-PREVIEW_BYTES:], cut=True)
    assert len(tail.encode()) <= PREVIEW_BYTES
    assert "\ufffd" not in tail
    assert data.endswith(tail.encode())


def test_previews_of_invalid_utf8_are_strings_within_4k() -> None:
    data = bytes(range(256)) * 64  # 16 KiB, mostly not UTF-8
    head = head_preview(data[: PREVIEW_BYTES + 4])
    tail = tail_preview(data[-PREVIEW_BYTES:], cut=True)
    for preview in (head, tail):
        assert "\ufffd" in preview
        assert len(preview.encode()) <= PREVIEW_BYTES
    assert head.startswith("\x00\x01\x02")
    assert tail.endswith("\ufffd")


def test_all_invalid_bytes_still_fit() -> None:
    head = head_preview(b"\xff" * 10000)
    assert set(head) == {"\ufffd"}
    assert len(head.encode()) <= PREVIEW_BYTES


def test_short_stream_previews_are_the_whole_stream() -> None:
    assert head_preview(b"hello") == "hello"
    assert tail_preview(b"hello", cut=False) == "hello"
    # Not cut: a leading continuation byte is really there, shown as U+FFFD.
    assert tail_preview(b"\x80ok", cut=False) == "\ufffdok"


# --- the sink ---------------------------------------------------------------------------


def test_inline_up_to_the_limit(owner: FakeOwner) -> None:
    sink = owner.open(inline_limit=10)
    sink.write(b"0123456789")
    ref = sink.close()
    assert ref.inline == "0123456789"
    assert ref.encoding == "utf-8"
    assert ref.bytes == 10
    assert ref.sha256 == hashlib.sha256(b"0123456789").hexdigest()
    assert ref.artifact is None and ref.preview_head is None
    assert not ref.truncated
    assert owner.finished[sink.id] is None
    assert not (owner.spool_dir / sink.id).exists()


def test_one_byte_over_the_limit_is_an_artifact(owner: FakeOwner) -> None:
    sink = owner.open(inline_limit=10)
    sink.write(b"0123456789!")
    ref = sink.close()
    assert ref.artifact == sink.id
    assert ref.inline is None and ref.encoding is None
    assert ref.preview_head == ref.preview_tail == "0123456789!"
    assert owner.stored[sink.id] == b"0123456789!"


def test_binary_inline_is_base64(owner: FakeOwner) -> None:
    sink = owner.open()
    sink.write(b"\xff\x00\xfe")
    ref = sink.close()
    assert ref.encoding == "base64"
    assert ref.inline is not None
    assert base64.b64decode(ref.inline) == b"\xff\x00\xfe"


def test_empty_stream(owner: FakeOwner) -> None:
    ref = owner.open().close()
    assert (ref.bytes, ref.inline, ref.sha256) == (0, "", hashlib.sha256().hexdigest())


def test_wire_shape_omits_absent_fields(owner: FakeOwner) -> None:
    import msgspec

    inline = msgspec.json.decode(msgspec.json.encode(owner.open().close()))
    assert set(inline) == {"bytes", "sha256", "truncated", "encoding", "inline"}
    sink = owner.open(inline_limit=0)
    sink.write(b"x")
    spilled = msgspec.json.decode(msgspec.json.encode(sink.close()))
    assert set(spilled) == {
        "bytes",
        "sha256",
        "truncated",
        "artifact",
        "preview_head",
        "preview_tail",
    }


def test_exact_bytes_and_sha256_across_every_write_path(owner: FakeOwner) -> None:
    rng = random.Random(7)
    data = rng.randbytes(12 * MiB)  # past HASH_THREAD_AFTER: the hash thread runs too
    sink = owner.open()
    for piece in chunks(data, rng):
        sink.write(piece)
    assert sink.written == len(data)
    ref = sink.close()
    assert ref.bytes == len(data)
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert owner.stored[sink.id] == data
    assert not ref.truncated


def test_truncation_past_max_bytes(owner: FakeOwner) -> None:
    rng = random.Random(3)
    data = rng.randbytes(5 * MiB + 123)
    limit = 3 * MiB + 17
    sink = owner.open(max_bytes=limit)
    for piece in chunks(data, rng):
        sink.write(piece)
    sink.write(b"more")  # past the end: discarded
    ref = sink.close()
    assert ref.truncated
    assert ref.bytes == limit
    assert ref.sha256 == hashlib.sha256(data[:limit]).hexdigest()
    assert owner.stored[sink.id] == data[:limit]


def test_truncated_small_stream_can_be_inline(owner: FakeOwner) -> None:
    sink = owner.open(max_bytes=4)
    sink.write(b"abcdef")
    ref = sink.close()
    assert (ref.inline, ref.bytes, ref.truncated) == ("abcd", 4, True)


def test_artifact_previews_on_utf8_boundaries(owner: FakeOwner) -> None:
    data = b"x" + "😀".encode() * 5000 + b"yz"  # every 4-byte char misaligned at the cuts
    sink = owner.open(inline_limit=0)
    sink.write(data)
    ref = sink.close()
    assert ref.preview_head is not None and ref.preview_tail is not None
    for preview in (ref.preview_head, ref.preview_tail):
        assert len(preview.encode()) <= PREVIEW_BYTES
        assert "\ufffd" not in preview
    assert data.startswith(ref.preview_head.encode())
    assert data.endswith(ref.preview_tail.encode())


def test_artifact_previews_of_binary_output(owner: FakeOwner) -> None:
    sink = owner.open(inline_limit=0)
    sink.write(os.urandom(100_000))
    ref = sink.close()
    assert ref.preview_head is not None and ref.preview_tail is not None
    assert len(ref.preview_head.encode()) <= PREVIEW_BYTES
    assert len(ref.preview_tail.encode()) <= PREVIEW_BYTES


def test_read_at_while_writing_and_after_close(owner: FakeOwner) -> None:
    # Every byte written is in the spool at once (a daemon killed now loses nothing).
    rng = random.Random(11)
    data = rng.randbytes(3 * MiB + 5)
    sink = owner.open()
    seen = 0
    for piece in chunks(data, rng):
        sink.write(piece)
        seen += len(piece)
        lo = max(0, seen - 70_000)
        assert os.path.getsize(owner.spool_dir / sink.id) == seen
        assert sink.read_at(lo, 100_000) == data[lo : min(seen, lo + 100_000)]
        assert sink.read_at(seen, 10) == b""
    sink.close()
    assert sink.read_at(MiB, 1000) == data[MiB : MiB + 1000]
    del owner.stored[sink.id]  # collected
    with pytest.raises(ArtifactUnknown):
        sink.read_at(0, 10)


def test_read_at_from_another_thread_while_a_writer_runs(owner: FakeOwner) -> None:
    data = random.Random(2).randbytes(24 * MiB)
    sink = owner.open()

    def writer() -> None:
        for i in range(0, len(data), 40_000):
            sink.write(data[i : i + 40_000])

    thread = threading.Thread(target=writer)
    thread.start()
    offset = 0
    while offset < len(data):
        piece = sink.read_at(offset, 1 << 20)
        assert piece == data[offset : offset + len(piece)]
        offset += len(piece)
    thread.join()
    assert sink.close().sha256 == hashlib.sha256(data).hexdigest()


def test_read_at_after_inline_close(owner: FakeOwner) -> None:
    sink = owner.open()
    sink.write(b"hello world")
    sink.close()
    assert sink.read_at(6, 100) == b"world"


def test_write_after_close_is_refused_and_close_is_idempotent(owner: FakeOwner) -> None:
    sink = owner.open()
    sink.write(b"a")
    ref = sink.close()
    assert sink.close() is ref
    with pytest.raises(SinkClosed):
        sink.write(b"b")


@pytest.mark.parametrize("before", [100, HASH_THREAD_AFTER + 100])
def test_rewind_starts_the_stream_again_empty(owner: FakeOwner, before: int) -> None:
    # The engine's own message where a command's output would be (procs.start_failure):
    # dropped, with any hashing already under way, before the real bytes go in.
    sink = owner.open(inline_limit=10, max_bytes=before + 50)
    sink.write(b"e" * before)
    sink.rewind()
    assert (sink.written, sink.read_at(0, 10), sink.truncated) == (0, b"", False)
    sink.write(b"substrate: x: command not found\n")
    ref = sink.close()
    data = owner.stored[ref.artifact or ""]
    assert data == b"substrate: x: command not found\n"
    assert (ref.bytes, ref.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    with pytest.raises(SinkClosed):
        sink.rewind()


def test_disk_refusal_cuts_the_stream_cleanly(owner: FakeOwner) -> None:
    # RLIMIT_FSIZE makes the kernel refuse writes past 2 MiB + 100 (EFBIG), as a full
    # disk would (ENOSPC): the spool is cut back to what was hashed.
    limit = 2 * MiB + 100
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    sink = owner.open()
    data = os.urandom(4 * MiB)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
        for i in range(0, len(data), MiB):
            sink.write(data[i : i + MiB])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    sink.write(b"later")  # discarded, no error
    ref = sink.close()
    assert ref.truncated
    assert ref.bytes == 2 * MiB
    assert ref.sha256 == hashlib.sha256(data[: 2 * MiB]).hexdigest()
    assert owner.stored[sink.id] == data[: 2 * MiB]


@pytest.mark.parametrize("chunk", [64 << 10, 4 << 10])
def test_memory_stays_flat(owner: FakeOwner, chunk: int) -> None:
    """200 MiB through a sink: Python allocations peak at a few MiB, not the output size."""
    block = os.urandom(chunk)
    sink = owner.open(inline_limit=0)
    owner.keep_bytes = False
    total = 200 * MiB if chunk == 64 << 10 else 50 * MiB
    tracemalloc.start()
    try:
        for _ in range(total // chunk):
            sink.write(block)
        ref = sink.close()
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ref.bytes == total
    # Hash batches in flight (references to the caller's chunk) and bookkeeping.
    assert peak < 4 * MiB
