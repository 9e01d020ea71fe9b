"""The artifact store (substrate.artifacts.store) and its wire handlers: pure, no Docker."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from substrate.api import artifact as api
from substrate.api.base import Caller
from substrate.api.services import ArtifactServices
from substrate.artifacts import lines as artifact_lines
from substrate.artifacts.store import INDEX_MIN, ArtifactStore
from substrate.errors import ArtifactUnknown, InvalidParams, TooLarge
from substrate.schema.artifact import GrepParams, LinesParams, ReadParams, StatParams
from substrate.store.db import Store

MiB = 1 << 20


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "state.db")
    yield store
    store.close()


@pytest.fixture
def arts(db: Store, tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(db, tmp_path / "artifacts", quota_bytes=1 << 40, max_age_s=1e9)


def put(arts: ArtifactStore, data: bytes, *, proc: str = "proc_1", stream: str = "stdout") -> str:
    """Store `data` as an artifact (inline limit 0) and return its id."""
    sink = arts.open_sink(proc, stream, 0, 1 << 40)
    sink.write(data)
    ref = sink.close()
    assert ref.artifact is not None
    return ref.artifact


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# --- sinks into the store ---------------------------------------------------------------


def test_root_is_private(arts: ArtifactStore) -> None:
    for d in (arts.root, arts.root / "spool", arts.root / "index"):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700


def test_inline_output_leaves_nothing_behind(arts: ArtifactStore) -> None:
    sink = arts.open_sink("proc_1", "stdout", 64 << 10, 1 << 30)
    sink.write(b"hello\n")
    ref = sink.close()
    assert ref.inline == "hello\n"
    assert files_under(arts.root) == set()
    assert arts.by_proc("proc_1") == []
    with pytest.raises(ArtifactUnknown):
        arts.stat(sink.id)


def test_large_output_becomes_an_indexed_content_addressed_file(arts: ArtifactStore) -> None:
    data = os.urandom(100_000)
    sink = arts.open_sink("proc_9", "stderr", 64 << 10, 1 << 30)
    sink.write(data)
    ref = sink.close()
    sha = hashlib.sha256(data).hexdigest()
    assert (ref.artifact, ref.bytes, ref.sha256) == (sink.id, len(data), sha)
    assert files_under(arts.root) == {f"{sha[:2]}/{sha}"}
    assert (arts.root / sha[:2] / sha).read_bytes() == data
    info = arts.stat(sink.id)
    assert (info.artifact, info.bytes, info.sha256) == (sink.id, len(data), sha)
    assert (info.proc, info.stream, info.truncated, info.lost) == ("proc_9", "stderr", False, False)
    assert info.created == sink.created
    assert arts.by_proc("proc_9") == [info]
    assert arts.usage() == len(data)


def test_truncated_flag_is_recorded(arts: ArtifactStore) -> None:
    sink = arts.open_sink("proc_1", "stdout", 10, 100)
    sink.write(b"x" * 1000)
    ref = sink.close()
    assert ref.truncated and ref.bytes == 100
    assert ref.artifact is not None
    assert arts.stat(ref.artifact).truncated


def test_durable_store_keeps_the_same_bytes(db: Store, tmp_path: Path) -> None:
    durable = ArtifactStore(
        db, tmp_path / "durable", quota_bytes=1 << 40, max_age_s=1e9, durable=True
    )
    aid = put(durable, b"synced" * 100)
    assert durable.read(aid, 0, 6).data == "synced"


def test_identical_outputs_share_one_file(arts: ArtifactStore) -> None:
    data = b"same bytes\n" * 10_000
    a, b = put(arts, data), put(arts, data)
    assert a != b
    assert len(files_under(arts.root)) == 1
    assert arts.usage() == len(data)
    assert arts.stat(a).sha256 == arts.stat(b).sha256


def test_live_sink_is_readable_until_collected(arts: ArtifactStore) -> None:
    sink = arts.open_sink("proc_1", "stdout", 0, 1 << 30)
    sink.write(b"abc" * 1000)
    assert sink.read_at(3, 6) == b"abcabc"
    sink.close()
    assert sink.read_at(0, 3) == b"abc"
    arts.max_age_s = 0
    arts.collect(now=sink.created + 1)
    with pytest.raises(ArtifactUnknown):
        sink.read_at(0, 3)


# --- artifact.read ----------------------------------------------------------------------


def test_read_ranges_and_eof(arts: ArtifactStore) -> None:
    data = b"0123456789" * 100
    aid = put(arts, data)
    r = arts.read(aid, 0, 10)
    assert (r.offset, r.eof, r.encoding, r.data) == (0, False, "utf-8", "0123456789")
    r = arts.read(aid, 995, 100)
    assert (r.eof, r.data) == (True, "56789")
    r = arts.read(aid, 5000, 10)
    assert (r.eof, r.data) == (True, "")


def test_read_base64_when_the_slice_is_not_utf8(arts: ArtifactStore) -> None:
    data = "é".encode() * 10  # c3 a9 ...
    aid = put(arts, data)
    assert arts.read(aid, 0, 4).encoding == "utf-8"
    r = arts.read(aid, 1, 4)  # starts inside a character
    assert r.encoding == "base64"
    assert base64.b64decode(r.data) == data[1:5]


def test_read_bounds_and_unknown(arts: ArtifactStore) -> None:
    aid = put(arts, b"x")
    assert arts.read(aid, 0, MiB).data == "x"
    with pytest.raises(TooLarge):
        arts.read(aid, 0, MiB + 1)
    with pytest.raises(ArtifactUnknown):
        arts.read("art_nope", 0, 1)
    with pytest.raises(ArtifactUnknown):
        arts.stat("../../etc/passwd")


# --- artifact.lines ---------------------------------------------------------------------


def naive_lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def test_lines_basic(arts: ArtifactStore) -> None:
    aid = put(arts, b"one\ntwo\nthree\n")
    r = arts.lines(aid, 1, 100)
    assert (r.start, r.lines, r.eof, r.truncated) == (1, ["one", "two", "three"], True, False)
    r = arts.lines(aid, 2, 1)
    assert (r.lines, r.eof) == (["two"], False)
    r = arts.lines(aid, 3, 1)
    assert (r.lines, r.eof) == (["three"], True)
    r = arts.lines(aid, 4, 10)
    assert (r.lines, r.eof) == ([], True)


def test_last_line_without_newline_and_blank_lines(arts: ArtifactStore) -> None:
    aid = put(arts, b"\n\nend")
    assert arts.lines(aid, 1, 10).lines == ["", "", "end"]
    assert arts.lines(aid, 3, 10).lines == ["end"]
    assert arts.lines(aid, 4, 10).lines == []


def test_lines_count_bound(arts: ArtifactStore) -> None:
    aid = put(arts, b"a\n")
    assert arts.lines(aid, 1, 10_000).lines == ["a"]
    with pytest.raises(TooLarge):
        arts.lines(aid, 1, 10_001)
    with pytest.raises(ArtifactUnknown):
        arts.lines("art_nope", 1, 1)


def test_long_lines_are_cut_at_64k_on_a_character_boundary(arts: ArtifactStore) -> None:
    long = b"y" + "€".encode() * 30_000  # 90 KiB, cut falls inside a character
    aid = put(arts, long + b"\nshort\n")
    r = arts.lines(aid, 1, 2)
    assert r.truncated
    assert r.lines[1] == "short"
    cut = r.lines[0].encode()
    assert long.startswith(cut)
    assert artifact_lines.MAX_LINE_BYTES - 3 <= len(cut) <= artifact_lines.MAX_LINE_BYTES


def test_lines_stop_at_the_reply_budget(arts: ArtifactStore) -> None:
    line = b"z" * 60_000
    aid = put(arts, (line + b"\n") * 40)  # 2.4 MB of lines
    r = arts.lines(aid, 1, 100)
    assert 0 < len(r.lines) < 40 and not r.eof
    got = len(r.lines)
    r2 = arts.lines(aid, 1 + got, 100)
    assert len(r2.lines) + got <= 40
    assert r2.lines[0] == line.decode()


def test_lines_on_a_large_artifact_use_the_index(arts: ArtifactStore) -> None:
    rng = random.Random(5)
    parts = [rng.randbytes(rng.choice([0, 1, 10, 200, 5000])).replace(b"\n", b".")]
    while sum(map(len, parts)) < INDEX_MIN + 3 * MiB:
        parts.append(b"L%d:" % len(parts) + b"x" * rng.choice([0, 3, 80, 2000]))
    data = b"\n".join(parts)  # no final newline
    aid = put(arts, data)
    sha = arts.stat(aid).sha256
    expected = naive_lines(data)
    for start in [1, 2, 777, len(expected) // 2, len(expected) - 3, len(expected)]:
        r = arts.lines(aid, start, 5)
        want = [x.decode("utf-8", "replace") for x in expected[start - 1 : start + 4]]
        assert r.lines == want, start
        assert r.eof == (start + 4 >= len(expected))
    assert (arts.root / "index" / sha).exists()
    assert arts.lines(aid, len(expected) + 1, 5).lines == []
    # A damaged index is rebuilt, not trusted.
    (arts.root / "index" / sha).write_bytes(b"\x00" * 24)
    r = arts.lines(aid, len(expected) - 1, 5)
    assert r.lines == [x.decode() for x in expected[-2:]]


def test_lines_at_every_block_boundary(arts: ArtifactStore) -> None:
    # Lines whose newlines sit exactly at, before and after 1 MiB block edges.
    size = INDEX_MIN + 2 * MiB
    data = bytearray(b"a" * size)
    for edge in range(artifact_lines.BLOCK, size, artifact_lines.BLOCK):
        for d in (-1, 0, 1):
            data[edge + d] = 0x0A
    data[-1] = 0x0A
    aid = put(arts, bytes(data))
    expected = naive_lines(bytes(data))
    for start in range(1, len(expected) + 1):
        r = arts.lines(aid, start, 2)
        want = [x[: artifact_lines.MAX_LINE_BYTES] for x in expected[start - 1 : start + 1]]
        assert [x.encode() for x in r.lines] == want, start


# --- artifact.grep ----------------------------------------------------------------------


def naive_grep(data: bytes, pattern: bytes) -> list[tuple[int, bytes]]:
    rx = re.compile(pattern, re.MULTILINE)
    return [(i + 1, ln) for i, ln in enumerate(naive_lines(data)) if rx.search(ln)]


def test_grep_matches_with_line_numbers_across_blocks(arts: ArtifactStore) -> None:
    rng = random.Random(9)
    lines = [
        b"%d %s" % (i, rng.choice([b"ok", b"ERROR boom", b"warn"]) * rng.randint(1, 900))
        for i in range(6000)
    ]
    data = b"\n".join(lines) + b"\n"
    assert len(data) > 2 * artifact_lines.BLOCK
    aid = put(arts, data)
    got = arts.grep(aid, r"ERROR", max_matches=10_000)
    want = naive_grep(data, rb"ERROR")
    assert [m.line for m in got.matches] == [n for n, _ in want]
    for m, (_, text) in zip(got.matches, want, strict=True):
        assert text.startswith(m.text.encode())
        assert len(m.text.encode()) <= artifact_lines.GREP_TEXT_BYTES
    assert not got.truncated


def test_grep_anchors_see_no_phantom_lines(arts: ArtifactStore) -> None:
    data = (b"x" * 1000 + b"\n\n") * 3000  # blank lines everywhere, block edges too
    aid = put(arts, data)
    got = arts.grep(aid, r"^$", max_matches=10_000)
    assert [m.line for m in got.matches] == [n for n, _ in naive_grep(data, rb"^$")]


def test_grep_bounds(arts: ArtifactStore) -> None:
    aid = put(arts, b"hit\n" * 50)
    r = arts.grep(aid, "hit", max_matches=10)
    assert len(r.matches) == 10 and r.truncated
    assert [m.line for m in r.matches] == list(range(1, 11))
    with pytest.raises(TooLarge):
        arts.grep(aid, "hit", max_matches=10_001)
    with pytest.raises(InvalidParams):
        arts.grep(aid, "(unclosed")
    with pytest.raises(InvalidParams, match="nested too deeply"):
        arts.grep(aid, "(" * 1500 + "hit" + ")" * 1500)  # within the 4,096-character cap
    with pytest.raises(ArtifactUnknown):
        arts.grep("art_nope", "x")


def test_grep_fixed_and_ignore_case(arts: ArtifactStore) -> None:
    aid = put(arts, b"a.b\naxb\nA.B\n")
    assert [m.line for m in arts.grep(aid, "a.b").matches] == [1, 2]
    assert [m.line for m in arts.grep(aid, "a.b", fixed=True).matches] == [1]
    got = arts.grep(aid, "a.b", fixed=True, ignore_case=True)
    assert [m.text for m in got.matches] == ["a.b", "A.B"]


def test_grep_searches_only_the_head_of_a_huge_line(arts: ArtifactStore) -> None:
    huge = b"early" + b"-" * (3 * MiB) + b"late"
    aid = put(arts, b"first\n" + huge + b"\nlate again\nlast")
    assert [m.line for m in arts.grep(aid, "early").matches] == [2]
    assert [m.line for m in arts.grep(aid, "late").matches] == [3]
    assert [m.line for m in arts.grep(aid, "last").matches] == [4]
    text = arts.grep(aid, "early").matches[0].text
    assert len(text.encode()) <= artifact_lines.GREP_TEXT_BYTES


def test_grep_binary_text_is_replaced(arts: ArtifactStore) -> None:
    aid = put(arts, b"\xff\xfe needle\n")
    (m,) = arts.grep(aid, "needle").matches
    assert m.text == "\ufffd\ufffd needle"


# --- collection ---------------------------------------------------------------------------


def test_collect_by_age_never_touches_a_live_sink(arts: ArtifactStore) -> None:
    old = put(arts, b"old" * 1000)
    live = arts.open_sink("proc_2", "stdout", 0, 1 << 30)
    live.write(b"running" * 1000)
    created = arts.stat(old).created
    arts.max_age_s = 60
    report = arts.collect(now=created + 3600)
    assert (report.removed, report.files_removed) == (1, 1)
    with pytest.raises(ArtifactUnknown):
        arts.stat(old)
    assert (arts.root / "spool" / live.id).exists()
    live.write(b"more")
    ref = live.close()
    assert ref.artifact is not None
    # Written long before `now`, but new enough by its own clock: kept.
    assert arts.collect(now=created + 30).removed == 0
    assert arts.stat(ref.artifact).bytes == 7004


def test_collect_by_quota_oldest_first_counting_live_spools(arts: ArtifactStore) -> None:
    ids = [put(arts, bytes([i]) * 1000) for i in range(5)]
    live = arts.open_sink("proc_2", "stdout", 0, 1 << 30)
    live.write(b"L" * 2500)
    arts.quota_bytes = 5000
    report = arts.collect()
    # 5000 stored + 2500 spooled: the three oldest go, the spool stays.
    assert report.removed == 3
    assert report.bytes_used == 4500 and not report.over_quota
    for aid in ids[:3]:
        with pytest.raises(ArtifactUnknown):
            arts.stat(aid)
    assert [arts.stat(a).bytes for a in ids[3:]] == [1000, 1000]
    # A spool alone over quota: everything stored goes, the spool is kept.
    live.write(b"L" * 10_000)
    report = arts.collect()
    assert report.over_quota and report.removed == 2
    assert live.read_at(0, 3) == b"LLL"
    live.close()


def test_collect_keeps_a_shared_file_until_its_last_row(arts: ArtifactStore, db: Store) -> None:
    a = put(arts, b"shared" * 500)
    b = put(arts, b"shared" * 500)
    sha = arts.stat(a).sha256
    with db.transaction() as t:
        t.execute("UPDATE artifacts SET created = 100 WHERE id = ?", (a,))
        t.execute("UPDATE artifacts SET created = 200 WHERE id = ?", (b,))
    arts.max_age_s = 50
    report = arts.collect(now=180)
    assert (report.removed, report.files_removed, report.bytes_freed) == (1, 0, 0)
    assert arts.read(b, 0, 6).data == "shared"
    report = arts.collect(now=300)
    assert (report.removed, report.files_removed, report.bytes_freed) == (1, 1, 3000)
    assert not (arts.root / sha[:2] / sha).exists()


# --- repair -------------------------------------------------------------------------------


def test_repair_orphans_dangling_rows_and_wrong_sizes(arts: ArtifactStore) -> None:
    keep = put(arts, b"keep" * 1000)
    gone = put(arts, b"gone" * 1000)
    short = put(arts, b"short" * 1000)

    def path(aid: str) -> Path:
        sha = arts.stat(aid).sha256
        return arts.root / sha[:2] / sha

    prefix = next(p for p in ("ab", "cd", "ef") if not path(keep).name.startswith(p))
    orphan = arts.root / prefix / (prefix + "0" * 62)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"no row")
    (arts.root / "index" / ("cd" * 32)).write_bytes(b"stale index")
    path(gone).unlink()
    os.chmod(path(short), 0o600)
    path(short).write_bytes(b"cut")
    report = arts.repair()
    assert report.dangling_removed == 2
    assert report.orphans_removed == 3  # the orphan, the cut file, the stale index
    assert arts.read(keep, 0, 4).data == "keep"
    for aid in (gone, short):
        with pytest.raises(ArtifactUnknown):
            arts.stat(aid)
    assert not orphan.exists() and not orphan.parent.exists()
    assert arts.repair() == type(report)(
        spools_kept=0, spools_discarded=0, orphans_removed=0, dangling_removed=0
    )


def test_repair_keeps_a_dead_daemons_spool_as_a_lost_artifact(
    arts: ArtifactStore, db: Store
) -> None:
    sink = arts.open_sink("proc_7", "stdout", 64 << 10, 1 << 30)
    sink.write(b"partial output\n" * 3)  # small: would have been inline
    assert sink.read_at(0, 7) == b"partial"
    # The daemon dies: a new store (new process) opens the same directory.
    fresh = ArtifactStore(db, arts.root, quota_bytes=1 << 40, max_age_s=1e9)
    (fresh.root / "spool" / "art_stray").write_bytes(b"no meta")
    (fresh.root / "spool" / "art_gone.meta").write_bytes(b"{}")
    report = fresh.repair()
    assert (report.spools_kept, report.spools_discarded) == (1, 1)
    info = fresh.stat(sink.id)
    assert (info.proc, info.stream, info.lost, info.truncated) == ("proc_7", "stdout", True, True)
    assert info.bytes == 45
    assert info.sha256 == hashlib.sha256(b"partial output\n" * 3).hexdigest()
    assert fresh.read(sink.id, 0, 7).data == "partial"
    assert os.listdir(fresh.root / "spool") == []
    os.close(sink._fd)  # the dead daemon's descriptor


def test_repair_skips_live_sinks(arts: ArtifactStore) -> None:
    sink = arts.open_sink("proc_1", "stdout", 0, 1 << 30)
    sink.write(b"live")
    assert arts.repair().spools_kept == 0
    assert sink.close().artifact == sink.id


# --- wire handlers ----------------------------------------------------------------------


async def _notify(method: str, params: Any) -> None:
    raise AssertionError("no notifications expected")


CALLER = Caller(actor="agent", uid=1000, connection=1, notify=_notify)


async def test_handlers(arts: ArtifactStore) -> None:
    aid = put(arts, b"alpha\nbeta\ngamma\n")
    d = ArtifactServices(
        artifacts=arts,
        fs_limiter=trio.CapacityLimiter(4),
        backtrack_limiter=trio.CapacityLimiter(2),
    )
    stat_r = await api.stat(d, CALLER, StatParams(artifact=aid))
    assert stat_r.bytes == 17
    read_r = await api.read(d, CALLER, ReadParams(artifact=aid, offset=6, length=4))
    assert read_r.data == "beta"
    lines_r = await api.lines(d, CALLER, LinesParams(artifact=aid, start=2, count=5))
    assert lines_r.lines == ["beta", "gamma"] and lines_r.eof
    grep_r = await api.grep(d, CALLER, GrepParams(artifact=aid, pattern="^g"))
    assert [(m.line, m.text) for m in grep_r.matches] == [(3, "gamma")]
    with pytest.raises(TooLarge):
        await api.read(d, CALLER, ReadParams(artifact=aid, length=MiB + 1))
    with pytest.raises(ArtifactUnknown):
        await api.stat(d, CALLER, StatParams(artifact="art_0"))


def test_a_stream_is_spooled_from_its_first_byte_and_an_empty_one_never(
    arts: ArtifactStore,
) -> None:
    spool = arts.root / "spool"
    quiet = arts.open_sink("p1", "stderr", 64, 1 << 20)
    loud = arts.open_sink("p1", "stdout", 64, 1 << 20)
    assert os.listdir(spool) == [] and not quiet.spooled and quiet.read_at(0, 10) == b""
    loud.write(b"hello")
    # Kept before the write returns: a daemon killed now still has it (and its meta).
    assert sorted(os.listdir(spool)) == [loud.id, f"{loud.id}.meta"]
    assert (spool / loud.id).read_bytes() == b"hello" and loud.spooled
    empty = quiet.close()
    assert empty.bytes == 0 and empty.inline == ""
    assert empty.sha256 == hashlib.sha256(b"").hexdigest()
    assert loud.close().inline == "hello"
    assert os.listdir(spool) == []


def test_a_spool_that_cannot_be_made_keeps_nothing_and_says_truncated(
    arts: ArtifactStore, tmp_path: Path
) -> None:
    sink = arts.open_sink("p1", "stdout", 64, 1 << 20)
    spool = arts.root / "spool"
    os.rename(spool, tmp_path / "away")  # root ignores modes: take the directory away
    try:
        sink.write(b"lost")
        sink.write(b"more")
    finally:
        os.rename(tmp_path / "away", spool)
    ref = sink.close()
    assert ref.truncated and ref.bytes == 0 and os.listdir(spool) == []
