"""Output bytes: spooling them (docs/protocol.md §5 "Output refs"), previewing them, reading them back.

One `OutputSink` per process stream spools it; `substrate.artifacts.store` stores what the
sinks produce and answers `artifact.*` with the line readers of `substrate.artifacts.lines`.

Theory of operation: a sink appends everything it is given to a spool file (one
`os.write` per call, nothing held back, so a daemon killed at any moment leaves every
byte it was given in the spool) while hashing it incrementally, so daemon memory stays
flat whatever the output size. Past `HASH_THREAD_AFTER` bytes the hashing moves to a
thread of the sink's own, overlapping with the writes (hashlib and os.write both release
the GIL); at most `HASH_BACKLOG_BYTES` wait for it. Past `max_bytes` the rest is
discarded and `truncated` is set; `bytes`/`sha256` always describe what was kept.
`close()` turns the spool into an `OutputRef`: inline text (the spool is removed) when
the stream is at most `inline_limit` bytes, otherwise an artifact (the spool is moved
into the content-addressed store by its owner, `substrate.artifacts.store`) with head and
tail previews. A sink must be closed: its hash thread waits for `close`.

Previews: each is a `str` whose UTF-8 encoding is at most `PREVIEW_BYTES`. The cut never
splits a valid multi-byte character (the head backs off to the start of a character the
cut would split; the tail skips the continuation bytes it would start in). Bytes that are
not UTF-8 decode to U+FFFD; because U+FFFD takes 3 bytes, a preview of binary output
covers fewer than 4096 source bytes (characters are dropped at the cut end until the
encoding fits).

Threading: `write` is called from one or more worker threads as output arrives and is
blocking (a plain `os.write`); `read_at` and `written` may be called from any thread at
any time, also after `close`. One lock orders them. No fsync per write; with
`durable=True` the spool is fsynced once at close.
"""

from __future__ import annotations

import base64
import collections
import errno
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

import msgspec

from substrate.errors import ArtifactUnknown
from substrate.schema.artifact import OutputRef

log = logging.getLogger("substrate.artifacts.sink")

#: Previews are at most this many bytes of UTF-8 each.
PREVIEW_BYTES = 4096
#: Past this many bytes a sink hashes in its own thread, overlapping hashing with the
#: writes (hashlib and os.write both release the GIL) ...
HASH_THREAD_AFTER = 4 << 20
#: ... in batches of about this many bytes (one hand-over per batch, not per write) ...
HASH_BATCH_BYTES = 256 << 10
#: ... with at most this many bytes handed over and not yet hashed (back-pressure).
HASH_BACKLOG_BYTES = 2 << 20


class SinkClosed(Exception):
    """`write` was called after `close`: the caller's bug (output after the stream ended)."""


class SinkOwner(Protocol):
    """What a sink needs from its store (implemented by `ArtifactStore`)."""

    def finish_sink(self, sink: OutputSink, sha256: str | None) -> str | None:
        """Inline (`sha256` None): drop the spool. Otherwise store it; return the artifact id."""
        ...

    def read_artifact(self, artifact: str, offset: int, length: int) -> bytes:
        """Bytes of a stored artifact; raises `ArtifactUnknown` once it was collected."""
        ...


# --- UTF-8 boundaries and previews (pure) ------------------------------------------------


def _sequence_length(lead: int) -> int:
    """Length of the UTF-8 sequence a lead byte announces (1 for ASCII and invalid bytes)."""
    if lead >= 0xF0:
        return 4 if lead < 0xF8 else 1
    if lead >= 0xE0:
        return 3
    if lead >= 0xC0:
        return 2
    return 1


def boundary_before(data: bytes | bytearray, cut: int) -> int:
    """The largest index ≤ `cut` that does not split a multi-byte sequence of `data`.

    `data` ending at or before `cut` is taken as complete (nothing to split). Looks back at most 3 bytes for a lead byte whose sequence crosses `cut`. Invalid
    bytes count as one-byte characters, so the result is never more than 3 below `cut`.
    """
    if cut >= len(data):
        return len(data)
    for back in range(1, 4):
        i = cut - back
        if i < 0:
            break
        b = data[i]
        if b < 0x80:
            break
        if b >= 0xC0:
            return i if i + _sequence_length(b) > cut else cut
    return cut


def boundary_after(data: bytes | bytearray, start: int) -> int:
    """The smallest index ≥ `start` not inside a sequence: skips ≤ 3 continuation bytes."""
    i = start
    while i < len(data) and i - start < 3 and 0x80 <= data[i] < 0xC0:
        i += 1
    # Still inside continuation bytes after 3: invalid data, leave it to U+FFFD.
    return i if i == len(data) or not 0x80 <= data[i] < 0xC0 else start


def _fit_front(text: str, limit: int) -> str:
    """Keep the longest prefix of `text` whose UTF-8 encoding is at most `limit` bytes."""
    excess = len(text.encode("utf-8")) - limit
    end = len(text)
    while excess > 0:
        end -= 1
        excess -= len(text[end].encode("utf-8"))
    return text[:end]


def _fit_back(text: str, limit: int) -> str:
    """Keep the longest suffix of `text` whose UTF-8 encoding is at most `limit` bytes."""
    excess = len(text.encode("utf-8")) - limit
    start = 0
    while excess > 0:
        excess -= len(text[start].encode("utf-8"))
        start += 1
    return text[start:]


def head_preview(data: bytes, limit: int = PREVIEW_BYTES) -> str:
    """Preview of the start of a stream; `data` is its first bytes, more than `limit` if
    the stream is longer (so a character split by the cut is recognised)."""
    piece = data[: boundary_before(data, limit)]
    return _fit_front(piece.decode("utf-8", "replace"), limit)


def tail_preview(data: bytes, *, cut: bool, limit: int = PREVIEW_BYTES) -> str:
    """Preview of the end of a stream; `data` is its last bytes, `cut` if more came before."""
    start = max(0, len(data) - limit)
    if cut or start > 0:
        start = boundary_after(data, start)
    return _fit_back(data[start:].decode("utf-8", "replace"), limit)


def inline_ref(data: bytes, sha256: str, truncated: bool) -> OutputRef:
    """The inline form: UTF-8 text when the bytes are valid UTF-8, else base64."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        b64 = base64.b64encode(data).decode("ascii")
        return OutputRef(
            bytes=len(data), sha256=sha256, truncated=truncated, encoding="base64", inline=b64
        )
    return OutputRef(
        bytes=len(data), sha256=sha256, truncated=truncated, encoding="utf-8", inline=text
    )


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """Read `length` bytes at `offset` (fewer only at end of file)."""
    chunks: list[bytes] = []
    while length > 0:
        block = os.pread(fd, length, offset)
        if not block:
            break
        chunks.append(block)
        offset += len(block)
        length -= len(block)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# --- the sink ---------------------------------------------------------------------------


class _HashThread:
    """SHA-256 of a byte sequence fed in order, computed by a thread of its own.

    `feed` takes a batch of chunks (so small writes cost one hand-over per batch, not per
    chunk) and blocks while more than `HASH_BACKLOG_BYTES` wait: memory stays bounded.
    The chunks must not change after `feed` (bytes, or private copies).
    """

    def __init__(self, digest: hashlib._Hash) -> None:
        self._digest = digest
        self._cv = threading.Condition()
        self._queue: collections.deque[list[bytes]] = collections.deque()
        self._backlog = 0
        self._ending = False
        self._thread = threading.Thread(target=self._run, name="substrate-sha256", daemon=True)
        self._thread.start()

    def feed(self, batch: list[bytes], size: int) -> None:
        with self._cv:
            while self._backlog > HASH_BACKLOG_BYTES:
                self._cv.wait()
            self._queue.append(batch)
            self._backlog += size
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._ending:
                    self._cv.wait()
                if not self._queue:
                    return
                batches = list(self._queue)
                self._queue.clear()
            done = 0
            for batch in batches:
                for data in batch:
                    self._digest.update(data)
                    done += len(data)
            with self._cv:
                self._backlog -= done
                self._cv.notify_all()

    def finish(self) -> None:
        """Wait until everything fed is hashed; the thread ends."""
        with self._cv:
            self._ending = True
            self._cv.notify_all()
        self._thread.join()


class OutputSink:
    """One stream of one process, spooled to `fd` (a file the owner created for it).

    Made by `ArtifactStore.open_sink`; not constructed directly. `fd` may be -1 with an
    `opener` that makes the spool file: then the spool is made by the first non-empty
    write (still before that write is accepted, so every byte kept is in the spool), and
    a stream that stays empty never touches the disk (a quiet command's two streams
    cost no file at all).
    """

    def __init__(
        self,
        owner: SinkOwner,
        artifact_id: str,
        proc: str,
        stream: str,
        fd: int,
        *,
        inline_limit: int,
        max_bytes: int,
        created: float,
        durable: bool = False,
        opener: Callable[[], int] | None = None,
    ) -> None:
        self.id = artifact_id
        self.proc = proc
        self.stream = stream
        self.created = created
        self.inline_limit = inline_limit
        self.truncated = False
        self._owner = owner
        self._fd = fd
        self._opener = opener if fd < 0 else None
        self._max = max_bytes
        self._durable = durable
        self._lock = threading.Lock()
        self._hash = hashlib.sha256()
        self._hasher: _HashThread | None = None
        self._batch: list[bytes] = []  # written, not yet handed to the hash thread
        self._batch_bytes = 0
        self._written = 0  # bytes in the spool file
        self._closing = False
        self._kept: bytes | None = None  # the inline bytes, once closed inline
        self._ref: OutputRef | None = None

    @property
    def written(self) -> int:
        """Bytes kept so far (all of them in the spool file)."""
        with self._lock:
            return self._written

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closing

    def write(self, data: bytes) -> None:
        """Append `data`; past `max_bytes` the rest is discarded and `truncated` set.

        Blocking: one `os.write` (nothing is held back in memory, so a daemon killed
        right after still has every byte in the spool). Cost per call is a few
        microseconds plus the copy into the page cache: pass chunks of 32 KiB or more
        for throughput. Raises `SinkClosed` after `close`. A disk error (ENOSPC, EIO)
        does not raise: the spool is cut back to what was fully written, the stream is
        marked truncated and later writes are discarded.
        """
        if not data:
            return
        with self._lock:
            if self._closing:
                raise SinkClosed(f"{self.id}: write after close")
            room = self._max - self._written
            if len(data) > room:
                self.truncated = True
                if room <= 0:
                    return
                data = data[:room]
            self._append(data)

    @property
    def spooled(self) -> bool:
        """Has a spool file been made for this stream? (False: nothing was written.)"""
        with self._lock:
            return self._fd >= 0 or self._opener is None

    def _append(self, data: bytes) -> None:
        """Write all of `data` to the spool (made now if this is the first write), then
        hash it. Lock held."""
        if self._fd < 0 and not self._open_spool():
            return
        done = 0
        try:
            with memoryview(data) as view:
                while done < len(view):
                    done += os.write(self._fd, view[done:])
        except OSError as exc:
            # Keep the spool equal to what gets hashed: cut off the partial write.
            os.ftruncate(self._fd, self._written)
            self._max = self._written
            self.truncated = True
            log.warning(
                "%s: output cut at %d bytes: %s",
                self.id,
                self._written,
                errno.errorcode.get(exc.errno or 0, exc),
            )
            return
        self._written += done
        if self._hasher is None:
            self._hash.update(data)
            if self._written >= HASH_THREAD_AFTER:
                self._hasher = _HashThread(self._hash)
            return
        # Callers' bytes are immutable and are handed over as they are.
        self._batch.append(data if type(data) is bytes else bytes(data))
        self._batch_bytes += done
        if self._batch_bytes >= HASH_BATCH_BYTES:
            self._hand_over()

    def _open_spool(self) -> bool:
        """Make the spool file (lock held). A failure is a disk error like a failed write:
        the stream keeps nothing and is marked truncated."""
        opener, self._opener = self._opener, None
        if opener is None:
            return False
        try:
            self._fd = opener()
        except OSError as exc:
            self._max = 0
            self.truncated = True
            log.warning(
                "%s: output not kept, its spool could not be made: %s",
                self.id,
                errno.errorcode.get(exc.errno or 0, exc),
            )
            return False
        return True

    def _hand_over(self) -> None:
        if self._hasher is not None and self._batch:
            self._hasher.feed(self._batch, self._batch_bytes)
            self._batch = []
            self._batch_bytes = 0

    def rewind(self) -> None:
        """Drop every byte kept so far: the stream is empty again, and goes on from 0.

        For a stream that held no output of the command's own (the engine's message
        about an exec it could not start: `procs.start_failure`). Raises `SinkClosed`
        after `close`. Costs one `ftruncate`.
        """
        with self._lock:
            if self._closing:
                raise SinkClosed(f"{self.id}: rewind after close")
            if self._hasher is not None:
                self._hasher.finish()
                self._hasher = None
            self._batch = []
            self._batch_bytes = 0
            if self._fd >= 0:
                os.ftruncate(self._fd, 0)
                os.lseek(self._fd, 0, os.SEEK_SET)
            self._written = 0
            self._hash = hashlib.sha256()
            self.truncated = False

    def read_at(self, offset: int, length: int) -> bytes:
        """Up to `length` kept bytes from `offset`; b"" at or past the current end.

        Works while writing (reads the spool: one `pread`), and after `close` (the inline
        bytes, or the stored artifact: `ArtifactUnknown` once collected).
        """
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be non-negative")
        with self._lock:
            if self._kept is not None:
                return self._kept[offset : offset + length]
            if self._ref is None:
                if self._fd < 0 and self._opener is not None:
                    return b""  # nothing written yet
                if self._fd < 0:
                    raise ArtifactUnknown(f"{self.id}: the stream could not be stored")
                end = min(offset + length, self._written)
                return pread_exact(self._fd, end - offset, offset) if end > offset else b""
        return self._owner.read_artifact(self.id, offset, length)

    def close(self) -> OutputRef:
        """End the stream and return its `OutputRef`; calling it again returns the same ref.

        Costs one read of at most `inline_limit` bytes (inline) or 2 x 4 KiB (previews),
        a rename and one database commit (artifact); plus one fsync when `durable`.
        """
        with self._lock:
            if self._ref is not None:
                return self._ref
            if self._closing:
                raise SinkClosed(f"{self.id}: closed concurrently")
            self._closing = True
            if self._hasher is not None:
                self._hand_over()
                self._hasher.finish()
                self._hasher = None
            size = self._written
            sha256 = self._hash.hexdigest()
            if size <= self.inline_limit:
                self._kept = pread_exact(self._fd, size, 0) if size else b""
                ref = inline_ref(self._kept, sha256, self.truncated)
            else:
                # A few bytes past the preview tell whether the cut splits a character.
                head = pread_exact(self._fd, PREVIEW_BYTES + 4, 0)
                tail = pread_exact(self._fd, PREVIEW_BYTES, max(0, size - PREVIEW_BYTES))
                if self._durable:
                    os.fsync(self._fd)
                ref = OutputRef(
                    bytes=size,
                    sha256=sha256,
                    truncated=self.truncated,
                    preview_head=head_preview(head),
                    preview_tail=tail_preview(tail, cut=size > len(tail)),
                )
        # The owner takes its own locks; never call it holding ours (lock order: store,
        # then sink). Live readers keep using the fd meanwhile: it survives the rename.
        done = False
        try:
            artifact = self._owner.finish_sink(self, None if self._kept is not None else sha256)
            if artifact is not None:
                ref = msgspec.structs.replace(ref, artifact=artifact, encoding=None, inline=None)
            done = True
        finally:
            with self._lock:
                if self._fd >= 0:
                    os.close(self._fd)
                self._fd = -1
                self._opener = None
                if done:
                    self._ref = ref
        return ref
