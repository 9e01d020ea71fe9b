"""A pack and its index verified whole, in bounded memory, before either joins a store.

Theory of operation: the pack checked is the copy substrate made of it (beneath the
destination's `objects/pack`, under a temp name nobody else writes), mapped read-only;
the index is bytes read once. What a reader of the store later relies on is checked:

1. the pack: `PACK`, version 2 or 3, its object count, and its trailer — the SHA-1 of
   every byte before it (`bad_pack_checksum`);
2. the index (version 2, dulwich's `PackIndex2` over the bytes): its own checksum, the
   pack checksum it names, the same object count, ids strictly ascending, the fan-out
   table counting them, offsets unique and inside the pack (`index_mismatch`);
3. every entry, in offset order, has a known type and the objects tile the pack: each
   zlib stream ends exactly where the next entry starts, the last at the trailer, and
   its bytes have the CRC-32 the index gives (`unparsable`, `index_mismatch`);
4. every object resolves: walked depth-first from the whole objects through the deltas
   based on them, so each is inflated once; an offset delta's base comes before it; a
   chain deeper than `max_delta_depth` is `delta_too_deep`; an entry never reached is
   `missing_base` (its base is not in the pack: a thin pack) or `delta_loop`;
5. each object's bytes hash to the id the index gives it at its offset
   (`hash_mismatch`) and a commit, tree or tag parses as its type (dulwich's `check`,
   what `git fsck` asks, plus no tree entry named `.git` in any case) (`unparsable`).

Memory: the index and a few words per object (bounded by the caller's object count),
plus the objects held while their deltas are resolved — the bases on the current path
of the walk and the one being made, at most `max_held_bytes` together, else
`too_large`. A whole blob that is no delta's base is streamed into its hash, never
held, however large. The pack itself is mapped, never read into memory.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import mmap
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dulwich.object_format import SHA1
from dulwich.objects import S_IFGITLINK, Commit, ShaFile, Tag, Tree
from dulwich.pack import PackIndex2, load_pack_index_file

from substrate.git.store import (
    BLOB,
    OFS_DELTA,
    REF_DELTA,
    TREE,
    TYPE_NAMES,
    WINDOW,
    StoreDamaged,
    delta_sizes,
    entry_header,
    object_header,
    patch,
)

#: Called with each verified object: (raw id, type, parsed object or None for a blob).
Visit = Callable[[bytes, int, ShaFile | None], None]

_HEADER = 12
_TRAILER = 20
#: The most one inflate step makes.
PIECE = 1 << 20


class PackRefused(Exception):
    """The pack or its index fails a check; `reason` is the refusal's name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Work:
    """Bytes an import may still make by inflating and applying deltas (shared by every
    entry of one import): zlib makes up to ~1,000 bytes of one, a delta's copy
    instructions ~8,000, so what is read alone does not bound the time spent."""

    def __init__(self, budget: int) -> None:
        self.left = budget

    def spend(self, n: int) -> None:
        """Take `n` bytes; raises PackRefused `too_large` when there are not as many."""
        if n > self.left:
            raise PackRefused("too_large", "the import would inflate more than its bound")
        self.left -= n


@dataclass(frozen=True)
class Limits:
    """What one pack may cost."""

    #: Objects in the pack, at most.
    max_objects: int
    #: Deltas on one chain, at most (git's `pack-objects --depth` caps it at 4095).
    max_delta_depth: int = 4095
    #: Bytes of objects held at once while deltas are resolved.
    max_held_bytes: int = 1 << 30
    #: Bytes inflated and made by deltas, at most, over the whole import.
    work: Work = field(default_factory=lambda: Work(1 << 40))


def read_index(idx_bytes: bytes) -> PackIndex2:
    """The version-2 pack index in `idx_bytes` (parsed by dulwich from memory). Raises
    PackRefused `unparsable` for any other version or a file too short for its count."""
    try:
        index = load_pack_index_file("pack.idx", io.BytesIO(idx_bytes), SHA1)
    except Exception as exc:  # dulwich raises AssertionError, KeyError, struct.error
        raise PackRefused("unparsable", f"the pack index does not parse: {exc}") from None
    if not isinstance(index, PackIndex2):
        raise PackRefused("unparsable", "only version-2 pack indexes are taken")
    return index


def pack_checksum(buf: mmap.mmap | bytes) -> bytes:
    """The SHA-1 of every byte of the pack before its trailer (streamed, 1 MiB at a time)."""
    digest = hashlib.sha1()
    end = len(buf) - _TRAILER
    with memoryview(buf) as view:
        for start in range(0, end, 1 << 20):
            digest.update(view[start : min(end, start + (1 << 20))])
    return digest.digest()


def _inflate_at(
    view: memoryview, pos: int, size: int, digest: hashlib._Hash | None
) -> tuple[bytes | None, int]:
    """Inflate the zlib stream at `pos` of exactly `size` bytes: (content, end offset);
    with `digest`, the content is fed to it instead of kept (returns None), at most
    `PIECE` bytes at a time however well it compressed."""
    inflater = zlib.decompressobj()
    kept: list[bytes] = []
    done = 0
    tail: bytes | memoryview = b""
    while not inflater.eof:
        if not tail:
            tail = view[pos : pos + WINDOW]
            if not tail:
                raise StoreDamaged("a zlib stream runs past the pack")
            pos += len(tail)
        try:
            piece = inflater.decompress(tail, min(PIECE, size + 1 - done))
        except zlib.error as exc:
            raise StoreDamaged(f"not a zlib stream: {exc}") from None
        tail = inflater.unconsumed_tail
        done += len(piece)
        if done > size:
            raise StoreDamaged("an entry inflates past the size its header gives")
        if digest is None:
            kept.append(piece)
        else:
            digest.update(piece)
        if not piece and tail and not inflater.eof:
            raise StoreDamaged("a zlib stream makes no progress")
    if done != size:
        raise StoreDamaged("an entry inflates short of the size its header gives")
    # Past the stream's end zlib leaves the rest of the last input in `unused_data`
    # (and, with a length limit, in `unconsumed_tail` too): that input ended at `pos`.
    end = pos - len(inflater.unused_data)
    return (b"".join(kept) if digest is None else None), end


def check_parsed(type_num: int, content: bytes) -> ShaFile:
    """`content` parsed as a commit, tree or tag and checked as `git fsck` would; raises
    ValueError (or dulwich's ObjectFormatException) when it is not one."""
    obj = ShaFile.from_raw_string(type_num, content)
    obj.check()
    if type_num == TREE:
        for entry in obj.items():  # type: ignore[attr-defined]
            if entry.path.lower() == b".git":
                raise ValueError("a tree entry is named .git")
    return obj


def references(obj: ShaFile | None) -> Iterator[bytes]:
    """The raw ids `obj` names: a commit's tree and parents, a tree's entries (but a
    submodule's commit: another repository's), a tag's object; a blob names none."""
    if isinstance(obj, Commit):
        yield bytes.fromhex(obj.tree.decode("ascii"))
        for parent in obj.parents:
            yield bytes.fromhex(parent.decode("ascii"))
    elif isinstance(obj, Tree):
        for entry in obj.iteritems():
            if entry.mode != S_IFGITLINK:
                yield bytes.fromhex(entry.sha.decode("ascii"))
    elif isinstance(obj, Tag):
        yield bytes.fromhex(obj.object[1].decode("ascii"))


@dataclass
class _Entries:
    """The index's entries in offset order, and what pass 1 read of each header."""

    offsets: list[int] = field(default_factory=list)
    ids: list[bytes] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    data_at: list[int] = field(default_factory=list)
    by_offset: dict[int, int] = field(default_factory=dict)


def _check_index(index: PackIndex2, idx_bytes: bytes, count: int, size: int) -> _Entries:
    if len(index) != count:
        raise PackRefused("index_mismatch", "the index and the pack count different objects")
    try:
        index.check()
    except Exception:
        raise PackRefused("index_mismatch", "the index's own checksum is wrong") from None
    fanout = struct.unpack(">256L", idx_bytes[8 : 8 + 1024])
    counts = [0] * 256
    rows: list[tuple[int, bytes, int]] = []
    previous = b""
    try:
        for raw_id, offset, crc in index.iterentries():
            raw = bytes(raw_id)
            if raw <= previous:
                raise PackRefused("index_mismatch", "the index's ids are not ascending")
            previous = raw
            counts[raw[0]] += 1
            if not _HEADER <= offset < size - _TRAILER:
                raise PackRefused("index_mismatch", "an index offset is outside the pack")
            rows.append((offset, raw, crc or 0))
    except (struct.error, IndexError):
        raise PackRefused("index_mismatch", "the index's offset table is truncated") from None
    total = 0
    for byte in range(256):
        total += counts[byte]
        if fanout[byte] != total:
            raise PackRefused("index_mismatch", "the index's fan-out table is wrong")
    rows.sort()
    entries = _Entries()
    for i, (offset, raw, crc) in enumerate(rows):
        if i and rows[i - 1][0] == offset:
            raise PackRefused("index_mismatch", "two index entries share an offset")
        entries.offsets.append(offset)
        entries.ids.append(raw)
        entries.crcs.append(crc)
        entries.by_offset[offset] = i
    if entries.offsets and entries.offsets[0] != _HEADER:
        raise PackRefused("unparsable", "the pack has bytes before its first object")
    return entries


def verify_pack(buf: mmap.mmap | bytes, idx_bytes: bytes, limits: Limits, visit: Visit) -> int:
    """Check the pack `buf` against its index `idx_bytes` (module docstring, steps 1-5);
    `visit` is called with each object once it passed. Returns the object count.

    Raises PackRefused with the first check that failed. Costs one pass hashing the
    pack, one reading the entries' headers, and one inflating each entry once (plus
    applying each delta once and parsing each commit, tree and tag).
    """
    size = len(buf)
    if size < _HEADER + _TRAILER or buf[:4] != b"PACK":
        raise PackRefused("unparsable", "not a pack")
    version, count = (int(n) for n in struct.unpack(">LL", buf[4:12]))
    if version not in (2, 3):
        raise PackRefused("unparsable", f"pack version {version}")
    if count > limits.max_objects:
        raise PackRefused("too_many", f"the pack holds {count} objects")
    if pack_checksum(buf) != bytes(buf[-_TRAILER:]):
        raise PackRefused("bad_pack_checksum", "the pack's trailer is not its checksum")
    index = read_index(idx_bytes)
    try:
        if index.get_pack_checksum() != bytes(buf[-_TRAILER:]):
            raise PackRefused("index_mismatch", "the index names another pack")
        entries = _check_index(index, idx_bytes, count, size)
    finally:
        index.close()
    with memoryview(buf) as view:
        roots, ofs_children, ref_children = _read_headers(view, entries)
        done = _walk(view, entries, roots, (ofs_children, ref_children), limits, visit)
    if done != count:
        known = set(entries.ids)
        if any(base not in known for base in ref_children):
            raise PackRefused("missing_base", "a delta's base is not in the pack")
        raise PackRefused("delta_loop", "deltas are based on each other in a loop")
    return count


def _read_headers(
    view: memoryview, entries: _Entries
) -> tuple[list[int], dict[int, list[int]], dict[bytes, list[int]]]:
    """Pass 1: each entry's header; the whole objects, and the deltas waiting on each base."""
    roots: list[int] = []
    ofs_children: dict[int, list[int]] = {}
    ref_children: dict[bytes, list[int]] = {}
    for i, offset in enumerate(entries.offsets):
        try:
            type_num, size, base, data_at = entry_header(view, offset)
        except StoreDamaged as exc:
            raise PackRefused("unparsable", str(exc)) from None
        entries.types.append(type_num)
        entries.sizes.append(size)
        entries.data_at.append(data_at)
        if type_num in TYPE_NAMES:
            roots.append(i)
        elif type_num == OFS_DELTA:
            assert isinstance(base, int)
            j = entries.by_offset.get(base)
            if j is None or base >= offset:
                raise PackRefused("unparsable", "an offset delta's base is no earlier entry")
            ofs_children.setdefault(j, []).append(i)
        elif type_num == REF_DELTA:
            assert isinstance(base, bytes)
            ref_children.setdefault(base, []).append(i)
        else:
            raise PackRefused("unparsable", f"unknown pack entry type {type_num}")
    return roots, ofs_children, ref_children


def _walk(
    view: memoryview,
    entries: _Entries,
    roots: list[int],
    waiting: tuple[dict[int, list[int]], dict[bytes, list[int]]],
    limits: Limits,
    visit: Visit,
) -> int:
    """Pass 2: resolve every object reachable from the whole ones, depth-first, each
    inflated once; returns how many were."""
    ofs_children, ref_children = waiting
    done = 0
    for root in roots:
        # The objects on the current path that deltas still wait on: (type, content,
        # the deltas left); `held` is their bytes.
        path: list[tuple[int, bytes, Iterator[int]]] = []
        held = 0
        todo: int | None = root
        while True:
            if todo is None:
                if not path:
                    break
                todo = next(path[-1][2], None)
                if todo is None:
                    held -= len(path.pop()[1])
                    continue
            i, todo = todo, None
            if len(path) > limits.max_delta_depth:
                raise PackRefused(
                    "delta_too_deep", f"a delta chain is over {limits.max_delta_depth}"
                )
            children = ofs_children.pop(i, []) + ref_children.pop(entries.ids[i], [])
            base = path[-1][:2] if path else None
            room = limits.max_held_bytes - held
            type_num, content = _resolve(view, entries, i, base, bool(children), room, limits.work)
            visit(entries.ids[i], type_num, _parsed(type_num, content))
            done += 1
            if children:
                assert content is not None
                path.append((type_num, content, iter(children)))
                held += len(content)
    return done


def _parsed(type_num: int, content: bytes | None) -> ShaFile | None:
    if type_num == BLOB:
        return None
    assert content is not None
    try:
        return check_parsed(type_num, content)
    except Exception as exc:  # dulwich's ObjectFormatException, ValueError, ...
        raise PackRefused(
            "unparsable", f"a {TYPE_NAMES[type_num].decode()} does not parse: {exc}"
        ) from None


def _resolve(
    view: memoryview,
    entries: _Entries,
    i: int,
    base: tuple[int, bytes] | None,
    keep: bool,
    room: int,
    work: Work,
) -> tuple[int, bytes | None]:
    """Entry `i` inflated (and applied to `base` when it is a delta), its place, CRC
    and id checked: (type, content); the content is None for a whole blob streamed into
    its hash (`keep` false: no delta waits on it)."""
    type_num, declared, start = entries.types[i], entries.sizes[i], entries.data_at[i]
    offset = entries.offsets[i]
    following = entries.offsets[i + 1] if i + 1 < len(entries.offsets) else len(view) - _TRAILER
    digest: hashlib._Hash | None = None
    try:
        if base is None and type_num == BLOB and not keep:
            digest = hashlib.sha1(object_header(BLOB, declared))
            work.spend(declared)
            content, end = _inflate_at(view, start, declared, digest)
        else:
            if declared > room:
                raise PackRefused("too_large", f"an entry of {declared} bytes is over {room}")
            work.spend(declared)
            content, end = _inflate_at(view, start, declared, None)
            assert content is not None
            if base is not None:
                type_num = base[0]
                work.spend(delta_sizes(content)[1])
                content = patch(base[1], content, room)
    except StoreDamaged as exc:
        raise PackRefused("unparsable", str(exc)) from None
    if end != following:
        raise PackRefused("unparsable", "the pack's entries do not follow each other exactly")
    if binascii.crc32(view[offset:end]) != entries.crcs[i]:
        raise PackRefused("index_mismatch", "an entry's CRC-32 is not the index's")
    if digest is None:
        assert content is not None
        digest = hashlib.sha1(object_header(type_num, len(content)))
        digest.update(content)
    if digest.digest() != entries.ids[i]:
        raise PackRefused("hash_mismatch", "an object does not hash to the id its index gives")
    return type_num, content
