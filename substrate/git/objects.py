"""Objects copied from one git object store into another, each verified, none overwritten.

Theory of operation (docs/git.md "Objects"): both stores are held as fds of their
`objects` directories. Every loose object and every pack of the source that the
destination lacks is checked — a loose object as it is copied (`loose`; 100 or more go
into one new pack instead, `packing`), a pack once copied (`packs`) — and waits under a
temp name. Then the new objects must be connected (`_connect`: what each names is in
the destination or arrives with it), and only then is each given its name: one flush
(`syncfs`) first, then a rename with `RENAME_NOREPLACE` each, a pack's `.pack` before its
`.idx` (git sees a pack only through its index). A name already taken is never
replaced: the object there is the destination's, whatever it holds.

What is refused is named in the report (`ObjectRefusal`: the source entry and the
reason) and left out; the rest is imported. Nothing is followed: a symlink in the source
store is refused `symlink`, a FIFO or device `not_a_file`. Names that are not objects
(git's `tmp_obj_*` and `tmp_pack_*`, `info/`, `.keep`, `.bitmap`, `.rev`) are skipped, and
so are overlay whiteouts: the source may be an overlay's upper directory, where a name
the agent deleted (a `git gc` pruning loose objects) is a 0/0 character device.
Everything here is blocking; callers run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
from dulwich.objects import ShaFile

from substrate.errors import NotAFile, Refusal, SymlinkRefused
from substrate.fs import fsops, paths
from substrate.git import loose, packing, packs
from substrate.git.store import FANOUT, LOOSE_NAME, PACK_NAME, ObjectStore

#: A directory of the destination store, as git makes one (its default umask).
DIR_MODE = 0o755
#: What an import may inflate by default, per byte it may write: real repositories'
#: objects compress 2-10 times; zlib can make ~1,000 bytes of one, a delta ~8,000.
INFLATE_RATIO = 32
#: A pack's and its index's mode, as git leaves them.
PACK_MODE = 0o444
#: The index of a pack of n objects is at most this many bytes (v2: fan-out, id, CRC,
#: offset and a large offset per object, two checksums).
_IDX_FIXED, _IDX_PER_OBJECT = 8 + 1024 + 40, 20 + 4 + 4 + 8


class ObjectRefusal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A source entry left out: `name` is the object id (loose), `pack/<name>.pack`, or the
    entry met (`ab`, a fan-out directory); `reason` says which check failed:
    `hash_mismatch`, `unparsable`, `bad_pack_checksum`, `index_mismatch`, `delta_loop`,
    `delta_too_deep`, `missing_base`, `missing_reference` (it names an object neither
    the destination nor the import brings), `too_large`, `too_many`, `symlink`,
    `not_a_file`, `name_taken`."""

    name: str
    reason: str


class ImportReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `import_objects` did: objects new to the destination, objects it already
    had, what was refused, and the bytes written."""

    imported: int
    present: int
    refused: tuple[ObjectRefusal, ...]
    bytes: int


@dataclass
class _Pending:
    """A checked entry waiting for its name: a loose object (`files`: its temp and final
    name) or a pack (its `.pack`'s, then its `.idx`'s), in the directory `dir_fd`.

    `provides`: the raw ids it brings that the destination lacks; `needs`: the raw ids
    its objects name that neither it nor the destination holds; `present`: its objects
    the destination has; `size`: its bytes; `in_pack`: a loose object written into the
    import's own pack (`_Import.writer`), which has no files of its own."""

    name: str
    dir_fd: int
    files: list[tuple[str, str]]
    provides: set[bytes]
    needs: set[bytes]
    present: int
    size: int
    in_pack: bool = False
    refused: bool = False


@dataclass
class _Import:
    """One import's running totals and bounds."""

    dest: ObjectStore
    owner: tuple[int, int]
    max_bytes: int
    max_objects: int
    limits: packs.Limits
    imported: int = 0
    present: int = 0
    written: int = 0
    examined: int = 0
    refused: list[ObjectRefusal] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    dirs: dict[str, int] = field(default_factory=dict)
    # The pack new loose objects are written into, when there are many.
    writer: packing.PackWriter | None = None

    def refuse(self, name: str, reason: str) -> None:
        self.refused.append(ObjectRefusal(name, reason))

    def dest_dir(self, name: str) -> int:
        """The destination's directory `name` (a fan-out or `pack`), made as git makes
        it when missing, held for the import."""
        if name not in self.dirs:
            self.dirs[name] = fsops.make_dirs(
                self.dest.fd, (name,), f"objects/{name}", lambda _: (DIR_MODE, self.owner)
            )
        return self.dirs[name]

    def missing(self, raw: bytes, own: set[bytes] | frozenset[bytes] = frozenset()) -> bool:
        """Whether `raw` is neither in `own` nor in the destination."""
        return raw not in own and not self.dest.has_raw(raw)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close(unlink=True)
        for unit in self.pending:
            for temp, _ in unit.files:
                fsops.unlink_quietly(unit.dir_fd, temp)
        self.pending.clear()
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs.clear()


def import_objects(
    source_objects_fd: int,
    dest_objects_fd: int,
    *,
    owner: tuple[int, int],
    max_bytes: int,
    max_objects: int,
    max_delta_depth: int = 4095,
    max_held_bytes: int = 1 << 30,
    max_inflated_bytes: int | None = None,
) -> ImportReport:
    """Copy every loose object and pack of the source store the destination lacks into
    it, each verified first (module docstring; docs/git.md says what and why).

    `owner` (uid, gid) owns every file and directory made (when the daemon is root);
    `max_bytes` bounds the bytes written, `max_objects` the objects examined (over
    either, the entry is refused `too_large` / `too_many` and the import goes on with
    what fits); `max_delta_depth` and `max_held_bytes` bound a pack's delta chains and
    the bytes held to resolve them; `max_inflated_bytes` (default `INFLATE_RATIO` times
    `max_bytes`) the bytes made by inflating and applying deltas, over the import (the
    time it takes: an entry past it is `too_large`). Never overwrites, never follows a symlink, never
    reads the stores' configuration. Costs a read and a write of each new loose object,
    a copy and three passes over each new pack (hash, headers, inflate), a lookup per
    id a new object names, and two `syncfs`.
    """
    with ObjectStore(dest_objects_fd) as dest:
        run = _Import(
            dest,
            owner,
            max_bytes,
            max_objects,
            packs.Limits(
                max_objects,
                max_delta_depth,
                max_held_bytes,
                packs.Work(
                    INFLATE_RATIO * max_bytes if max_inflated_bytes is None else max_inflated_bytes
                ),
            ),
        )
        try:
            _loose_objects(run, source_objects_fd)
            _packs(run, source_objects_fd)
            if not _partial_clone(run.dest):
                _connect(run)
            _seal_loose_pack(run)
            _link(run)
        finally:
            run.close()
        return ImportReport(run.imported, run.present, tuple(run.refused), run.written)


def _partial_clone(dest: ObjectStore) -> bool:
    """Whether the destination is a partial clone (a `.promisor` pack): objects it lacks
    on purpose may be named by new ones, as git's own connectivity check allows."""
    try:
        with (
            paths.opened_dir(dest.fd, ("pack",), "objects/pack") as pack_dir,
            os.scandir(pack_dir) as listing,
        ):
            return any(e.name.endswith(".promisor") for e in listing)
    except Refusal:
        return False


def _connect(run: _Import) -> None:
    """Refuse (`missing_reference`) every pending entry naming an id that neither the
    destination nor a pending entry not refused brings, until none is left: a ref moved
    onto an imported commit then has its whole history in the store."""
    providers: dict[bytes, int] = {}
    for unit in run.pending:
        for raw in unit.provides:
            providers[raw] = providers.get(raw, 0) + 1
    changed = True
    while changed:
        changed = False
        for unit in run.pending:
            if unit.refused or all(raw in providers for raw in unit.needs):
                continue
            unit.refused = changed = True
            for raw in unit.provides:
                providers[raw] -= 1
                if not providers[raw]:
                    del providers[raw]
    for unit in [u for u in run.pending if u.refused]:
        run.pending.remove(unit)
        for temp, _ in unit.files:
            fsops.unlink_quietly(unit.dir_fd, temp)
        run.written -= unit.size
        run.refuse(unit.name, "missing_reference")


def _link(run: _Import) -> None:
    """Give every pending entry its names: one flush first, then one rename each that
    never replaces (a name taken meanwhile keeps what holds it), then one more flush."""
    if not run.pending:
        return
    fsops.make_durable([run.dest.fd])
    while run.pending:
        unit = run.pending.pop(0)
        done = 0
        try:
            for temp, final in unit.files:
                fsops.rename_new(unit.dir_fd, temp, final)
                done += 1
        except FileExistsError:
            for temp, _ in unit.files[done:]:
                fsops.unlink_quietly(unit.dir_fd, temp)
            if done:  # a pack's .pack linked, its .idx name taken: the .pack is ours
                fsops.unlink_quietly(unit.dir_fd, unit.files[0][1])
            run.written -= unit.size
            run.dest.refresh()
            if all(run.dest.has_raw(raw) for raw in unit.provides):
                run.present += unit.present + len(unit.provides)
            else:
                run.refuse(unit.name, "name_taken")
            continue
        run.imported += len(unit.provides)
        run.present += unit.present
    fsops.make_durable([run.dest.fd])


def has_object(objects_fd: int, oid: str) -> bool:
    """Whether the store beneath `objects_fd` holds `oid` (40 hex), loose or in a pack.
    Costs an lstat, and a mapping and a bisection per pack index."""
    with ObjectStore(objects_fd) as store:
        return store.has(oid)


# --- loose objects --------------------------------------------------------------------------


def _loose_objects(run: _Import, source_fd: int) -> None:
    """Check every loose object of the source the destination lacks, copying each
    (fewer than `UNPACK_LIMIT`) or writing them all into one pack (more)."""
    new = _new_loose(run, source_fd)
    if len(new) >= packing.UNPACK_LIMIT:
        run.writer = packing.PackWriter(run.dest_dir("pack"), run.owner)
    at = ""
    fan_fd = -1
    try:
        for fan, name in new:
            if fan != at:
                if fan_fd >= 0:
                    os.close(fan_fd)
                    fan_fd = -1
                at = fan
                # Replaced since it was listed: its objects are refused below.
                with contextlib.suppress(Refusal):
                    fan_fd = paths.open_dir(source_fd, (fan,), f"objects/{fan}")
            _loose_object(run, fan_fd, fan, name)
    finally:
        if fan_fd >= 0:
            os.close(fan_fd)


def _new_loose(run: _Import, source_fd: int) -> list[tuple[str, str]]:
    """(fan-out, name) of each loose object of the source the destination lacks, at
    most `max_objects` examined; the ones it has are counted present."""
    with os.scandir(source_fd) as listing:
        fans = sorted(e.name for e in listing if FANOUT.fullmatch(e.name))
    new: list[tuple[str, str]] = []
    for fan in fans:
        try:
            fan_fd = paths.open_dir(source_fd, (fan,), f"objects/{fan}")
        except SymlinkRefused:
            run.refuse(fan, "symlink")
            continue
        except Refusal:
            run.refuse(fan, "not_a_file")
            continue
        try:
            # At most one name more than may still be examined is held.
            names = sorted(
                itertools.islice(_object_names(fan_fd), run.max_objects - run.examined + 1)
            )
        finally:
            os.close(fan_fd)
        for name in names:
            if run.examined >= run.max_objects:
                run.refuse(fan + name, "too_many")  # and the rest is not examined
                return new
            run.examined += 1
            if run.dest.has(fan + name):
                run.present += 1
            else:
                new.append((fan, name))
    return new


def _object_names(fan_fd: int) -> Iterator[str]:
    with os.scandir(fan_fd) as listing:
        for entry in listing:
            if LOOSE_NAME.fullmatch(entry.name) and not _whiteout(entry):
                yield entry.name


def _whiteout(entry: os.DirEntry[str]) -> bool:
    """Whether `entry` is an overlay whiteout (a 0/0 character device): in an overlay's
    upper directory, the mark of a name deleted — no object, and nothing to refuse."""
    if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
        return False
    st = entry.stat(follow_symlinks=False)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _loose_object(run: _Import, fan_fd: int, fan: str, name: str) -> None:
    oid = fan + name
    try:
        if fan_fd < 0:
            raise SymlinkRefused(f"objects/{fan}: replaced")
        src = paths.open_regular(fan_fd, name, f"objects/{fan}/{name}")
    except SymlinkRefused:
        run.refuse(oid, "symlink")
        return
    except (NotAFile, Refusal):
        run.refuse(oid, "not_a_file")
        return
    room = run.max_bytes - run.written
    try:
        if run.writer is not None:
            before = run.writer.pos
            _, names = run.writer.add_loose(
                src, oid, max_bytes=room, max_held=run.limits.max_held_bytes, work=run.limits.work
            )
            size = run.writer.pos - before
            unit = _Pending(oid, -1, [], {bytes.fromhex(oid)}, set(), 0, size, in_pack=True)
        else:
            copied = loose.copy_loose(
                src,
                run.dest_dir(fan),
                oid,
                owner=run.owner,
                max_bytes=room,
                max_held_bytes=run.limits.max_held_bytes,
                work=run.limits.work,
            )
            names = copied.names
            files = [(copied.temp, name)]
            unit = _Pending(
                oid, run.dest_dir(fan), files, {bytes.fromhex(oid)}, set(), 0, copied.size
            )
    except loose.LooseRefused as exc:
        run.refuse(oid, exc.reason)
        return
    finally:
        os.close(src)
    unit.needs = {raw for raw in names if run.missing(raw)}
    run.written += unit.size
    run.pending.append(unit)


def _seal_loose_pack(run: _Import) -> None:
    """Finish the pack the new loose objects were written into, with those left after
    `_connect`, as one pending entry in their stead."""
    writer = run.writer
    if writer is None:
        return
    units = [u for u in run.pending if u.in_pack]
    run.pending = [u for u in run.pending if not u.in_pack]
    keep = {raw for u in units for raw in u.provides}
    run.written -= sum(u.size for u in units)
    if not keep:
        return
    try:
        temp, idx_temp, checksum, size = writer.finish(keep, run.limits)
    except packs.PackRefused as exc:  # never, unless the disk gives back other bytes
        for unit in units:
            run.refuse(unit.name, exc.reason)
        return
    final = f"pack-{checksum.hex()}"
    files = [(temp, final + ".pack"), (idx_temp, final + ".idx")]
    run.pending.append(_Pending(f"pack/{final}.pack", writer.dir_fd, files, keep, set(), 0, size))
    run.written += size


# --- packs ----------------------------------------------------------------------------------


def _packs(run: _Import, source_fd: int) -> None:
    try:
        pack_dir = paths.open_dir(source_fd, ("pack",), "objects/pack")
    except SymlinkRefused:
        run.refuse("pack", "symlink")
        return
    except Refusal:
        return
    try:
        with os.scandir(pack_dir) as listing:
            stems = sorted(
                e.name[:-5]
                for e in listing
                if PACK_NAME.fullmatch(e.name) and e.name.endswith(".pack") and not _whiteout(e)
            )
        for stem in stems:
            _pack(run, pack_dir, stem)
    finally:
        os.close(pack_dir)


def _pack(run: _Import, pack_dir: int, stem: str) -> None:
    name = f"pack/{stem}.pack"
    idx = paths.lstat_at(pack_dir, stem + ".idx")
    if idx is None or (stat.S_ISCHR(idx.st_mode) and idx.st_rdev == 0):
        return  # a pack git is still writing, or gave up on: git does not see it either
    opened: list[int] = []
    try:
        for suffix in (".pack", ".idx"):
            opened.append(paths.open_regular(pack_dir, stem + suffix, f"objects/pack/{stem}"))
    except SymlinkRefused:
        run.refuse(name, "symlink")
        return
    except Refusal:
        run.refuse(name, "not_a_file")
        return
    finally:
        if len(opened) < 2:
            for fd in opened:
                os.close(fd)
    pack_fd, idx_fd = opened
    try:
        reason = _pack_from(run, name, pack_fd, idx_fd)
    except packs.PackRefused as exc:
        reason = exc.reason
    finally:
        os.close(pack_fd)
        os.close(idx_fd)
    if reason is not None:
        run.refuse(name, reason)


def _pack_from(run: _Import, name: str, pack_fd: int, idx_fd: int) -> str | None:
    """Copy and check the open pack and index, pending their names; returns the
    refusal's reason, or None."""
    room = run.max_objects - run.examined
    idx_cap = _IDX_FIXED + _IDX_PER_OBJECT * max(room, 0)
    idx_size = os.fstat(idx_fd).st_size
    idx_bytes = None if idx_size > idx_cap else fsops.read_fd(idx_fd, idx_cap, expected=idx_size)
    if idx_bytes is None:
        return "too_many"
    try:
        index = packs.read_index(idx_bytes)
    except packs.PackRefused as exc:
        return exc.reason
    try:
        ids = {bytes(raw) for raw, _, _ in index.iterentries()}
    except Exception:  # a truncated table: struct.error, IndexError
        return "index_mismatch"
    finally:
        index.close()
    if len(ids) > room:
        return "too_many"
    run.examined += len(ids)
    new = {raw for raw in ids if not run.dest.has_raw(raw)}
    if not new:
        run.present += len(ids)
        return None
    size = os.fstat(pack_fd).st_size
    if size + len(idx_bytes) > run.max_bytes - run.written:
        return "too_large"
    pack_dir = run.dest_dir("pack")
    unit = _Pending(name, pack_dir, [], new, set(), len(ids) - len(new), size + len(idx_bytes))
    temps = ["tmp_pack_" + secrets.token_hex(8), "tmp_idx_" + secrets.token_hex(8)]

    def visit(raw: bytes, type_num: int, obj: ShaFile | None) -> None:
        for named in packs.references(obj):
            if named not in unit.needs and run.missing(named, ids):
                unit.needs.add(named)

    try:
        checksum = _copy_and_verify(run, pack_fd, size, idx_bytes, pack_dir, temps[0], visit)
        fsops.write_new(pack_dir, temps[1], idx_bytes, mode=PACK_MODE, owner=run.owner)
    except BaseException:
        for temp in temps:
            fsops.unlink_quietly(pack_dir, temp)
        raise
    final = f"pack-{checksum.hex()}"
    unit.files = [(temps[0], final + ".pack"), (temps[1], final + ".idx")]
    run.pending.append(unit)
    run.written += unit.size
    return None


def _copy_and_verify(
    run: _Import,
    pack_fd: int,
    size: int,
    idx_bytes: bytes,
    pack_dir: int,
    temp: str,
    visit: packs.Visit,
) -> bytes:
    """Copy the pack into a temp file of the destination, then verify the copy against
    `idx_bytes` (nothing the source does meanwhile can change what was checked).
    Returns the pack's checksum; raises PackRefused."""
    out = fsops.create_exclusive(pack_dir, temp, read=True)
    try:
        _copy_range(pack_fd, out, size)
        _finish(out, run.owner)
        with mmap.mmap(out, 0, access=mmap.ACCESS_READ) as buf:
            packs.verify_pack(buf, idx_bytes, run.limits, visit)
            return bytes(buf[-20:])
    finally:
        os.close(out)


def _copy_range(src: int, dst: int, size: int) -> None:
    """Copy the first `size` bytes of `src` to `dst`: in the kernel (`copy_file_range`),
    or through a 1 MiB buffer where it cannot (another file system on an old kernel)."""
    done = 0
    in_kernel = True
    while done < size:
        if in_kernel:
            try:
                n = os.copy_file_range(src, dst, size - done, done, done)
            except OSError:
                in_kernel = False
                continue
        else:
            block = os.pread(src, min(size - done, 1 << 20), done)
            n = os.pwrite(dst, block, done)
        if n == 0:
            raise packs.PackRefused("unparsable", "the pack shrank while it was copied")
        done += n


def _finish(fd: int, owner: tuple[int, int]) -> None:
    if os.geteuid() == 0:
        os.fchown(fd, *owner)
    os.fchmod(fd, PACK_MODE)
    os.fsync(fd)
