"""Many loose objects written as one pack, each checked as it streams in, the pack checked whole.

Why: a file per object costs a create, a chmod and a rename each, and on a busy disk
that is most of an import; git itself keeps what a fetch brings as one pack once it
holds `transfer.unpackLimit` (100) objects or more, and so does `objects.import_objects`
(`UNPACK_LIMIT`).

Theory of operation: the pack is a temp file in the destination's `objects/pack`. Each
loose object is read once from its source fd (`loose.stream_checked`: its bytes hash to
its name, it parses) while its content is deflated into the next whole entry (no
deltas: nothing is held but a commit's, tree's or tag's content to parse it); one that
fails is cut off again (`ftruncate`) and named by the caller. `finish` writes the
header's count, the trailer (the SHA-1 of the pack, read back from the file) and the
version-2 index (dulwich's `write_pack_index_v2`), keeping only the objects asked for
— a dropped one is left out by copying the others' entries, unchanged, into a new temp
— and then checks the result as any pack is (`packs.verify_pack`), so what is linked
passed the same checks as an agent's pack.
"""

from __future__ import annotations

import binascii
import dataclasses
import hashlib
import io
import mmap
import os
import secrets
import struct
import zlib
from dataclasses import dataclass, field

from dulwich.object_format import SHA1
from dulwich.pack import pack_object_header, write_pack_index_v2

from substrate.fs import fsops
from substrate.git import loose, packs

#: From this many new loose objects on, an import writes them as one pack (git's
#: `transfer.unpackLimit` default).
UNPACK_LIMIT = 100
_HEADER = 12


@dataclass
class _Row:
    raw: bytes
    start: int
    end: int
    crc: int


@dataclass
class PackWriter:
    """A pack being written into `dir_fd` under a temp name, one checked object at a time."""

    dir_fd: int
    owner: tuple[int, int]
    temp: str = field(default_factory=lambda: "tmp_pack_" + secrets.token_hex(8))
    rows: list[_Row] = field(default_factory=list)
    pos: int = _HEADER
    fd: int = -1

    def __post_init__(self) -> None:
        self.fd = fsops.create_exclusive(self.dir_fd, self.temp, read=True)
        os.pwrite(self.fd, b"PACK" + struct.pack(">LL", 2, 0), 0)

    def _write(self, data: bytes, crc: list[int]) -> None:
        with memoryview(data) as view:
            done = 0
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], self.pos + done)
        self.pos += len(data)
        crc[0] = binascii.crc32(data, crc[0])

    def add_loose(
        self, src_fd: int, oid: str, *, max_bytes: int, max_held: int, work: packs.Work
    ) -> tuple[int, tuple[bytes, ...]]:
        """Check the loose object `oid` (open as `src_fd`) and append it as an entry:
        (its type, the raw ids it names). Raises LooseRefused, the pack as it was."""
        start = self.pos
        crc = [0]
        deflater = zlib.compressobj()

        def header(type_num: int, size: int) -> None:
            self._write(bytes(pack_object_header(type_num, None, size, SHA1)), crc)

        def content(piece: bytes) -> None:
            self._write(deflater.compress(piece), crc)

        try:
            sink = loose.Sink(header=header, content=content)
            found = loose.stream_checked(src_fd, oid, max_bytes, max_held, sink, work)
            self._write(deflater.flush(), crc)
        except BaseException:
            os.ftruncate(self.fd, start)
            self.pos = start
            raise
        self.rows.append(_Row(bytes.fromhex(oid), start, self.pos, crc[0] & 0xFFFFFFFF))
        return found

    def finish(self, keep: set[bytes], limits: packs.Limits) -> tuple[str, str, bytes, int]:
        """Make the pack of the objects in `keep`: (pack temp name, index temp name,
        checksum, bytes written). Raises PackRefused should the result fail its check."""
        if {row.raw for row in self.rows} != keep:
            self._drop(keep)
        os.pwrite(self.fd, b"PACK" + struct.pack(">LL", 2, len(self.rows)), 0)
        os.ftruncate(self.fd, self.pos)
        digest = hashlib.sha1()
        for offset in range(0, self.pos, 1 << 20):
            digest.update(os.pread(self.fd, min(1 << 20, self.pos - offset), offset))
        checksum = digest.digest()
        os.pwrite(self.fd, checksum, self.pos)
        if os.geteuid() == 0:
            os.fchown(self.fd, *self.owner)
        os.fchmod(self.fd, 0o444)
        os.fsync(self.fd)
        index = io.BytesIO()
        write_pack_index_v2(index, sorted((r.raw, r.start, r.crc) for r in self.rows), checksum)
        idx_bytes = index.getvalue()
        with mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) as buf:
            # What it inflates was spent from the import's work as the objects came in.
            own = dataclasses.replace(limits, work=packs.Work(1 << 62))
            packs.verify_pack(buf, idx_bytes, own, lambda *_: None)
        idx_temp = "tmp_idx_" + secrets.token_hex(8)
        fsops.write_new(self.dir_fd, idx_temp, idx_bytes, mode=0o444, owner=self.owner)
        return self.temp, idx_temp, checksum, self.pos + 20 + len(idx_bytes)

    def _drop(self, keep: set[bytes]) -> None:
        """Rewrite the pack with only the entries in `keep` (copied unchanged from this
        file, which only this writer writes)."""
        old_fd, old_temp = self.fd, self.temp
        self.temp = "tmp_pack_" + secrets.token_hex(8)
        self.fd = fsops.create_exclusive(self.dir_fd, self.temp, read=True)
        rows, self.rows, self.pos = self.rows, [], _HEADER
        try:
            for row in rows:
                if row.raw in keep:
                    start = self.pos
                    for at in range(row.start, row.end, 1 << 20):
                        self._write(os.pread(old_fd, min(1 << 20, row.end - at), at), [0])
                    self.rows.append(_Row(row.raw, start, self.pos, row.crc))
        finally:
            os.close(old_fd)
            fsops.unlink_quietly(self.dir_fd, old_temp)

    def close(self, *, unlink: bool) -> None:
        """Close the file; with `unlink`, remove the temp too (a pack never finished)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if unlink:
            fsops.unlink_quietly(self.dir_fd, self.temp)
