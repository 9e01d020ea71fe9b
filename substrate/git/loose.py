"""A loose object verified as it is copied, streamed: its bytes hash to its name and it parses.

Theory of operation: the source file (`xx/<38 hex>`, opened `O_NOFOLLOW` beneath its
held fan-out directory) is read once, in chunks; each chunk is written unchanged to a
new temp file in the destination's fan-out directory (`tmp_obj_<hex>`, git's own name for
one, so a copy a crash leaves is what `git prune` already removes) and fed to zlib. What
it inflates to must be `<type> <size>\\0<content>` with a known type and exactly `size`
bytes, the zlib stream must end at the file's end, the SHA-1 of it all must be the
file's name (`hash_mismatch`), and a commit, tree or tag must parse (`unparsable`).
A blob's content is hashed as it streams, never held; a commit's, tree's or tag's is
held to be parsed, at most `max_held_bytes`.

The temp file is not linked here: the caller links every checked file at once, after
one flush (`objects.import_objects`), so no name ever holds bytes not yet on disk.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from substrate.fs import fsops
from substrate.git.packs import PackRefused, Work, check_parsed, references
from substrate.git.store import BLOB, TYPE_NUMS

#: The read size of a loose object's copy.
CHUNK = 1 << 16
#: The longest header git writes (`commit 18446744073709551615\0` is 28 bytes).
MAX_HEADER = 32
#: A loose object's mode, as git leaves it.
OBJECT_MODE = 0o444


class LooseRefused(Exception):
    """The loose object fails a check; `reason` is the refusal's name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Copied:
    """A checked copy waiting to be linked: its temp name in the destination's fan-out
    directory, its size in bytes, its type, and the raw ids it names."""

    temp: str
    size: int
    type_num: int
    names: tuple[bytes, ...]


def copy_loose(
    src_fd: int,
    dest_fan_fd: int,
    oid: str,
    *,
    owner: tuple[int, int],
    max_bytes: int,
    max_held_bytes: int,
    work: Work | None = None,
) -> Copied:
    """Copy the open source file `src_fd` (the loose object `oid`) into a temp file in
    `dest_fan_fd`, checking it as it streams (module docstring).

    Raises LooseRefused (`too_large` over `max_bytes` compressed or a held object over
    `max_held_bytes`, `hash_mismatch`, `unparsable`); the temp file is then removed.
    Costs one read and one write of the file, one inflate; no fsync (the caller flushes).
    """
    temp = "tmp_obj_" + secrets.token_hex(8)
    out = fsops.create_exclusive(dest_fan_fd, temp)
    try:
        type_num, names = stream_checked(
            src_fd,
            oid,
            max_bytes,
            max_held_bytes,
            Sink(raw=lambda chunk: fsops.write_all(out, chunk)),
            work,
        )
        size = os.fstat(out).st_size
        if os.geteuid() == 0:
            os.fchown(out, *owner)
        os.fchmod(out, OBJECT_MODE)
    except BaseException:
        os.close(out)
        fsops.unlink_quietly(dest_fan_fd, temp)
        raise
    os.close(out)
    return Copied(temp, size, type_num, names)


def _pieces(inflater: zlib._Decompress, chunk: bytes) -> Iterator[bytes]:
    """What `chunk` inflates to, at most `CHUNK` * 16 bytes at a time (a small chunk of a
    zlib bomb never becomes one large buffer)."""
    data = chunk
    while data:
        try:
            piece = inflater.decompress(data, CHUNK * 16)
        except zlib.error as exc:
            raise LooseRefused("unparsable", f"not a zlib stream: {exc}") from None
        yield piece
        data = inflater.unconsumed_tail
    if inflater.unused_data:
        raise LooseRefused("unparsable", "bytes follow the zlib stream")


class _Content:
    """The inflated bytes of one object: its header parsed, its content hashed (and
    held, for a commit, tree or tag)."""

    def __init__(self, max_held: int, sink: Sink, work: Work | None) -> None:
        self.sink = sink
        self.work = work
        self.digest = hashlib.sha1()
        self.head = b""
        self.type_num = 0
        self.declared = -1
        self.seen = 0
        self.held: list[bytes] | None = None
        self.max_held = max_held

    def feed(self, piece: bytes) -> None:
        if self.declared < 0:
            self.head += piece
            nul = self.head.find(b"\0")
            if nul < 0:
                if len(self.head) > MAX_HEADER:
                    raise LooseRefused("unparsable", "no object header")
                return
            self.type_num, self.declared = _header(self.head[:nul])
            if self.type_num != BLOB and self.declared > self.max_held:
                raise LooseRefused("too_large", f"a {self.declared}-byte object to parse")
            self.held = None if self.type_num == BLOB else []
            self.digest.update(self.head[: nul + 1])
            piece = self.head[nul + 1 :]
            if self.sink.header is not None:
                self.sink.header(self.type_num, self.declared)
        self.seen += len(piece)
        if self.work is not None:
            try:
                self.work.spend(len(piece))
            except PackRefused:
                raise LooseRefused(
                    "too_large", "the import would inflate more than its bound"
                ) from None
        if self.seen > self.declared:
            raise LooseRefused("unparsable", "more content than its header gives")
        self.digest.update(piece)
        if self.held is not None:
            self.held.append(piece)
        if self.sink.content is not None and piece:
            self.sink.content(piece)


@dataclass(frozen=True)
class Sink:
    """Where a checked stream goes as it is read: the file's bytes (`raw`), and its
    object's header (`header`: type, size) and content (`content`), inflated."""

    raw: Callable[[bytes], None] | None = None
    header: Callable[[int, int], None] | None = None
    content: Callable[[bytes], None] | None = None


def stream_checked(
    src_fd: int, oid: str, max_bytes: int, max_held: int, sink: Sink, work: Work | None = None
) -> tuple[int, tuple[bytes, ...]]:
    """Read the loose object `oid` from `src_fd` once, feeding `sink`, and check it
    (module docstring): (its type, the raw ids it names). Raises LooseRefused."""
    inflater = zlib.decompressobj()
    content = _Content(max_held, sink, work)
    copied = 0
    while chunk := os.read(src_fd, CHUNK):
        copied += len(chunk)
        if copied > max_bytes:
            raise LooseRefused("too_large", f"over {max_bytes} bytes")
        if sink.raw is not None:
            sink.raw(chunk)
        if inflater.eof:
            raise LooseRefused("unparsable", "bytes follow the zlib stream")
        for piece in _pieces(inflater, chunk):
            content.feed(piece)
    if not inflater.eof or content.declared < 0:
        raise LooseRefused("unparsable", "the zlib stream ends early")
    if content.seen != content.declared:
        raise LooseRefused("unparsable", "less content than its header gives")
    if content.digest.hexdigest() != oid:
        raise LooseRefused("hash_mismatch", "its bytes do not hash to its name")
    if content.held is None:
        return content.type_num, ()
    try:
        obj = check_parsed(content.type_num, b"".join(content.held))
        return content.type_num, tuple(references(obj))
    except Exception as exc:  # dulwich's ObjectFormatException, ValueError, ...
        raise LooseRefused("unparsable", f"does not parse: {exc}") from None


def _header(head: bytes) -> tuple[int, int]:
    kind, sep, size = head.partition(b" ")
    if (
        not sep
        or kind not in TYPE_NUMS
        or not size.isdigit()
        or (size.startswith(b"0") and size != b"0")
    ):
        raise LooseRefused("unparsable", "a bad object header")
    return TYPE_NUMS[kind], int(size)
