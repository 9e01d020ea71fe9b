"""A git object store read beneath its held `objects` directory fd: lookups and bounded reads.

Theory of operation: a store is held as an open fd of its `objects` directory, never as
a path. A loose object is the regular file `xx/<38 hex>` beneath it, opened `O_NOFOLLOW`
one component at a time (`substrate.fs.paths`); a packed one is found through the
`pack/pack-*.idx` files, each opened the same way and handed to dulwich as a file object
(dulwich maps it; it opens nothing by path). `objects/info/alternates` is never read: an
object only an alternate holds counts as absent, so at worst an import copies it again.

The store is the host's: its objects are read with the same bounds as an agent's (a
cap on an object's size and on a delta chain's length), since a checkout's `.git` is
whatever its owner put there. Lookups cost an lstat for a loose object and a bisection
per pack index; the indexes are mapped once per `ObjectStore`.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import zlib
from collections.abc import Iterator
from types import TracebackType
from typing import IO, Self

from dulwich.object_format import SHA1
from dulwich.objects import RawObjectID
from dulwich.pack import PackData, PackIndex, apply_delta, load_pack_index_file

from substrate.errors import Refusal
from substrate.fs import paths

#: A loose object's fan-out directory and file name; a pack's index and data names.
FANOUT = re.compile(r"[0-9a-f]{2}")
LOOSE_NAME = re.compile(r"[0-9a-f]{38}")
PACK_NAME = re.compile(r"pack-[0-9a-f]{40}\.(pack|idx)")
OID = re.compile(r"[0-9a-f]{40}")
#: The object id of nothing, as git's reflogs and update-ref write it.
ZERO_OID = "0" * 40

#: Pack entry types (git's `enum object_type`).
COMMIT, TREE, BLOB, TAG, OFS_DELTA, REF_DELTA = 1, 2, 3, 4, 6, 7
TYPE_NAMES = {COMMIT: b"commit", TREE: b"tree", BLOB: b"blob", TAG: b"tag"}
TYPE_NUMS = {name: num for num, name in TYPE_NAMES.items()}
#: The longest delta chain read from a store (git's `pack-objects --depth` maximum).
MAX_DELTA_DEPTH = 4095
#: Inflate and feed at most this much at a time.
WINDOW = 1 << 16


class StoreDamaged(Exception):
    """An object the store claims to hold cannot be read: truncated, not zlib, a delta
    that does not apply or whose chain is too long, or over the caller's size cap."""


def valid_oid(oid: str) -> bool:
    """Whether `oid` is a SHA-1 object id as git writes it: 40 lowercase hex digits."""
    return OID.fullmatch(oid) is not None


def object_header(type_num: int, size: int) -> bytes:
    """The header git hashes before an object's content: `<type> <size>\\0`."""
    return TYPE_NAMES[type_num] + b" " + str(size).encode() + b"\0"


def inflate(data: bytes | memoryview, cap: int) -> tuple[bytes, bytes]:
    """The zlib stream at the start of `data`: (content, bytes after the stream).

    Raises StoreDamaged when it is not zlib, ends early, or inflates past `cap` bytes
    (memory stays at most `cap` + `WINDOW`).
    """
    inflater = zlib.decompressobj()
    out: list[bytes] = []
    size = 0
    with memoryview(data) as view:
        pos = 0
        while not inflater.eof:
            chunk = view[pos : pos + WINDOW]
            if not chunk:
                raise StoreDamaged("the zlib stream ends early")
            pos += len(chunk)
            try:
                piece = inflater.decompress(chunk, cap + 1 - size)
            except zlib.error as exc:
                raise StoreDamaged(f"not a zlib stream: {exc}") from None
            size += len(piece)
            if size > cap or inflater.unconsumed_tail:
                raise StoreDamaged(f"an object inflates past {cap} bytes")
            out.append(piece)
    return b"".join(out), inflater.unused_data


def delta_sizes(delta: bytes) -> tuple[int, int]:
    """A delta's (base size, result size) from its header (two little-endian varints)."""
    sizes: list[int] = []
    pos = 0
    for _ in range(2):
        value = shift = 0
        while True:
            if pos >= len(delta) or shift > 63:
                raise StoreDamaged("a delta's size header is truncated")
            byte = delta[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        sizes.append(value)
    return sizes[0], sizes[1]


def patch(base: bytes, delta: bytes, cap: int) -> bytes:
    """`delta` applied to `base` (dulwich's `apply_delta`), its result size checked
    against `cap` before anything is allocated. Raises StoreDamaged."""
    base_size, result_size = delta_sizes(delta)
    if result_size > cap:
        raise StoreDamaged(f"a delta's result is {result_size} bytes, over {cap}")
    if base_size != len(base):
        raise StoreDamaged("a delta's base size does not match its base")
    try:
        return b"".join(apply_delta(base, delta))
    except Exception as exc:  # dulwich raises ApplyDeltaError, ValueError, AssertionError
        raise StoreDamaged(f"a delta does not apply: {exc}") from None


def entry_header(buf: bytes | memoryview, pos: int) -> tuple[int, int, int | bytes | None, int]:
    """The header of the pack entry at `pos`: (type, size, delta base, data offset).

    The base is a negative-offset distance (already subtracted: the base's own offset)
    for an OFS_DELTA, the base's raw id for a REF_DELTA, None otherwise. Raises
    StoreDamaged on a truncated or overlong header.
    """
    end = len(buf)
    start = pos
    if pos >= end:
        raise StoreDamaged("a pack entry starts past the end")
    byte = buf[pos]
    pos += 1
    type_num = (byte >> 4) & 7
    size = byte & 0x0F
    shift = 4
    while byte & 0x80:
        if pos >= end or shift > 60:
            raise StoreDamaged("a pack entry's header is truncated")
        byte = buf[pos]
        pos += 1
        size |= (byte & 0x7F) << shift
        shift += 7
    base: int | bytes | None = None
    if type_num == OFS_DELTA:
        if pos >= end:
            raise StoreDamaged("a pack entry's base offset is truncated")
        byte = buf[pos]
        pos += 1
        distance = byte & 0x7F
        while byte & 0x80:
            if pos >= end or distance > 1 << 56:
                raise StoreDamaged("a pack entry's base offset is truncated")
            byte = buf[pos]
            pos += 1
            distance = ((distance + 1) << 7) | (byte & 0x7F)
        base = start - distance
    elif type_num == REF_DELTA:
        if pos + 20 > end:
            raise StoreDamaged("a pack entry's base id is truncated")
        base = bytes(buf[pos : pos + 20])
        pos += 20
    return type_num, size, base, pos


def open_file(dir_fd: int, name: str, where: str) -> IO[bytes]:
    """The regular file `name` in `dir_fd` as a binary file object (never a symlink).

    Raises the refusal `paths.open_regular` does (`symlink_refused`, `not_a_file`, ...).
    """
    return os.fdopen(paths.open_regular(dir_fd, name, where), "rb")


class _Pack:
    """One pack of a store: its mapped index and data, both opened beneath the store."""

    def __init__(self, pack_dir_fd: int, stem: str) -> None:
        self._files: list[IO[bytes]] = []
        try:
            idx_file = self._keep(open_file(pack_dir_fd, stem + ".idx", "pack index"))
            self.index: PackIndex = load_pack_index_file(stem + ".idx", idx_file, SHA1)
            data_file = self._keep(open_file(pack_dir_fd, stem + ".pack", "pack"))
            self.data = PackData(stem + ".pack", SHA1, file=data_file)
        except BaseException:
            self.close()
            raise

    def _keep(self, file: IO[bytes]) -> IO[bytes]:
        self._files.append(file)
        return file

    def close(self) -> None:
        data = getattr(self, "data", None)
        if data is not None:
            data.close()
        index = getattr(self, "index", None)
        if index is not None:
            index.close()
        for file in self._files:
            file.close()


class ObjectStore:
    """The objects beneath a held `objects` directory fd (dup'ed; `close` releases it).

    `has` and `read` look in the loose objects, then in every pack whose `.idx` and
    `.pack` are both regular files; a pack that cannot be opened or parsed is skipped
    (git would also ignore it). Use as a context manager.
    """

    def __init__(self, objects_fd: int) -> None:
        self._fd = os.dup(objects_fd)
        self._packs: list[_Pack] | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for pack in self._packs or ():
            pack.close()
        self._packs = []
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def fd(self) -> int:
        return self._fd

    def packs(self) -> list[_Pack]:
        """The store's packs, opened at the first call (a pack added later is not seen
        until `refresh`)."""
        if self._packs is None:
            self._packs = list(self._open_packs())
        return self._packs

    def refresh(self) -> None:
        for pack in self._packs or ():
            pack.close()
        self._packs = None

    def _open_packs(self) -> Iterator[_Pack]:
        try:
            pack_dir = paths.open_dir(self._fd, ("pack",), "objects/pack")
        except Refusal:
            return
        try:
            with os.scandir(pack_dir) as entries:
                stems = sorted(
                    e.name[:-4]
                    for e in entries
                    if PACK_NAME.fullmatch(e.name) and e.name[-4:] == ".idx"
                )
            for stem in stems:
                with contextlib.suppress(Refusal, OSError, ValueError, AssertionError, KeyError):
                    yield _Pack(pack_dir, stem)
        finally:
            os.close(pack_dir)

    def has_loose(self, oid: str) -> bool:
        try:
            with paths.opened_dir(self._fd, (oid[:2],), "objects") as fan:
                st = paths.lstat_at(fan, oid[2:])
        except Refusal:
            return False
        return st is not None and stat.S_ISREG(st.st_mode)

    def has_packed(self, raw: bytes) -> bool:
        for pack in self.packs():
            with contextlib.suppress(KeyError):
                pack.index.object_offset(RawObjectID(raw))
                return True
        return False

    def has_raw(self, raw: bytes) -> bool:
        """`has` for a raw (20-byte) id."""
        return len(raw) == 20 and (self.has_loose(raw.hex()) or self.has_packed(raw))

    def has(self, oid: str) -> bool:
        """Whether the store holds `oid` (40 hex), loose or packed. Costs an lstat and a
        bisection per pack; reads no object."""
        return valid_oid(oid) and (self.has_loose(oid) or self.has_packed(bytes.fromhex(oid)))

    def read(self, oid: str, cap: int) -> tuple[int, bytes] | None:
        """(type, content) of `oid`, or None when the store does not hold it.

        Raises StoreDamaged when it holds it but it cannot be read within `cap` bytes
        (also a delta chain's bases: each at most `cap`) or `MAX_DELTA_DEPTH` deltas.
        """
        if not valid_oid(oid):
            return None
        found = self._read_loose(oid, cap)
        if found is not None:
            return found
        raw = bytes.fromhex(oid)
        for pack in self.packs():
            try:
                offset = pack.index.object_offset(RawObjectID(raw))
            except KeyError:
                continue
            return self._read_packed(pack, offset, cap)
        return None

    def _read_loose(self, oid: str, cap: int) -> tuple[int, bytes] | None:
        try:
            with paths.opened_dir(self._fd, (oid[:2],), "objects") as fan:
                file = open_file(fan, oid[2:], "loose object")
        except Refusal:
            return None
        with file:
            # A loose object's zlib stream is never much larger than what it inflates to.
            data = file.read(cap + cap // 2 + 1024)
        content, _ = inflate(data, cap + 64)
        head, sep, body = content.partition(b"\0")
        kind, _, size = head.partition(b" ")
        if not sep or kind not in TYPE_NUMS or not size.isdigit() or int(size) != len(body):
            raise StoreDamaged(f"loose object {oid}: bad header")
        if len(body) > cap:
            raise StoreDamaged(f"loose object {oid}: over {cap} bytes")
        return TYPE_NUMS[kind], body

    def _read_packed(self, pack: _Pack, offset: int, cap: int) -> tuple[int, bytes]:
        # The view is released before the pack's mapping can be closed.
        with memoryview(pack.data._buffer()) as buf:
            return self._read_chain(pack, buf, offset, cap)

    def _read_chain(self, pack: _Pack, buf: memoryview, offset: int, cap: int) -> tuple[int, bytes]:
        deltas: list[bytes] = []
        while True:
            type_num, size, base, data_at = entry_header(buf, offset)
            if size > cap:
                raise StoreDamaged(f"a packed object is {size} bytes, over {cap}")
            content, _ = inflate(buf[data_at:], size)
            if len(content) != size:
                raise StoreDamaged("a packed object's size does not match its header")
            if type_num in TYPE_NAMES:
                break
            if len(deltas) >= MAX_DELTA_DEPTH:
                raise StoreDamaged(f"a delta chain is longer than {MAX_DELTA_DEPTH}")
            deltas.append(content)
            if isinstance(base, int):
                if not 0 < base < offset:
                    raise StoreDamaged("an offset delta's base is not before it")
                offset = base
            elif isinstance(base, bytes):
                try:
                    offset = pack.index.object_offset(RawObjectID(base))
                except KeyError:
                    # Only a pack in transit is thin; one on disk holds its bases.
                    raise StoreDamaged("a delta's base is not in its pack") from None
            else:
                raise StoreDamaged(f"unknown pack entry type {type_num}")
        for delta in reversed(deltas):
            content = patch(content, delta, cap)
        return type_num, content
